"""Settings: one pydantic model filled from arguments, then the environment, then defaults.

Every field names its environment variable in ``json_schema_extra["env"]`` and says in
``json_schema_extra["accepts"]`` what it accepts, so that an invalid value gives an
error naming the variable and the accepted values. Plugins describe their own sections
with models built the same way and load them with :func:`load_settings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError

__all__ = ["Config", "Settings", "load_settings", "setting", "env_names", "MAX_TIMEOUT"]

M = TypeVar("M", bound=BaseModel)


def setting(default: Any, *, env: str, accepts: str, description: str, **kw: Any) -> Any:
    """A pydantic field that knows its environment variable and what values it accepts."""
    return Field(default, description=description, json_schema_extra={"env": env, "accepts": accepts}, **kw)


def env_names(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> environment variable name, for every field that has one."""
    out = {}
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "env" in extra:
            out[name] = str(extra["env"])
    return out


#: the longest MLX_TIMEOUT every wait can honour: poll(2) takes an int of milliseconds
MAX_TIMEOUT = (2**31 - 1) // 1000


def _gather(
    model: type[BaseModel], overrides: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The raw values for ``model`` (arguments first, then non-empty environment variables)
    and, for each, where it came from (for error messages)."""
    unknown = set(overrides) - set(model.model_fields)
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {sorted(unknown)} for {model.__name__}; known: {sorted(model.model_fields)}"
        )
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    envs = env_names(model)
    for name in model.model_fields:
        if name in overrides and overrides[name] is not None:
            values[name] = overrides[name]
            origin[name] = f"argument {name}"
        elif name in envs and environ.get(envs[name], "").strip() != "":
            values[name] = environ[envs[name]].strip()
            origin[name] = envs[name]
    return values, origin


def _config_error(
    model: type[BaseModel], exc: ValidationError, values: Mapping[str, Any], origin: Mapping[str, str]
) -> ConfigError:
    """One ConfigError naming, for each invalid field, its variable, its value and what it accepts."""
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        where = origin.get(field, field)
        extra = model.model_fields[field].json_schema_extra if field in model.model_fields else None
        accepts = extra.get("accepts") if isinstance(extra, dict) else None
        lines.append(
            f"{where}={values.get(field)!r} is invalid: {err['msg']}"
            + (f"; accepted: {accepts}" if accepts else "")
        )
    return ConfigError("; ".join(lines))


def load_settings(
    model: type[M], overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> M:
    """Build ``model`` from ``overrides`` (keyword arguments), then ``environ``, then defaults.

    Raises ConfigError naming the argument or environment variable, its value, and what
    it accepts. Empty environment variables count as unset.
    """
    environ = os.environ if environ is None else environ
    if issubclass(model, Settings):
        return model(_environ=environ, **dict(overrides or {}))
    values, origin = _gather(model, dict(overrides or {}), environ)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise _config_error(model, exc, values, origin) from None


class Settings(BaseModel):
    """Base of settings models: constructing one reads the environment, as pydantic-settings does.

    ``Settings(timeout=5)`` takes the argument, every other field from its environment
    variable, else its default; an invalid value is a ConfigError naming the variable.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, _environ: Mapping[str, str] | None = None, **data: Any) -> None:
        values, origin = _gather(type(self), data, os.environ if _environ is None else _environ)
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _config_error(type(self), exc, values, origin) from None


class Config(Settings):
    """meshcomm's core settings (plugins add their own sections, see the README).

    ``Config()`` reads the environment; ``Config.load(environ)`` reads a given mapping instead.
    """

    backend: str = setting(
        "any",
        env="MLX_BACKEND",
        accepts="'any' or the name of an installed backend (see `meshcomm info`)",
        description="which backend init() starts",
    )
    rank: int | None = setting(
        None, env="MLX_RANK", accepts="an integer >= 0", description="this process's rank", ge=0
    )
    hostfile: Path | None = setting(
        None,
        env="MLX_HOSTFILE",
        accepts="the path of a JSON hostfile",
        description="peers of the sockets backend",
    )
    timeout: float = setting(
        300.0,
        env="MLX_TIMEOUT",
        accepts=f"a number of seconds > 0 and <= {MAX_TIMEOUT} (about 24.8 days)",
        description="seconds a rank waits on a peer (start-up and every operation) before it raises",
        gt=0,
        le=MAX_TIMEOUT,
        allow_inf_nan=False,
    )
    debug: bool = setting(
        False,
        env="MLX_DEBUG",
        accepts="1/0, true/false, yes/no, on/off",
        description="check op, shape and dtype across ranks before every operation",
    )

    check_calls: bool = setting(
        True,
        env="MESHCOMM_CHECK_CALLS",
        accepts="1/0, true/false, yes/no, on/off",
        description="on backends that cannot check calls in-band (mpi, gloo), compare each "
        "collective's op, shape, dtype and root across ranks with one small all-reduce first",
    )

    keep_memory: bool = setting(
        True,
        env="MESHCOMM_KEEP_MEMORY",
        accepts="1/0, true/false, yes/no, on/off",
        description="keep freed blocks up to 1 GiB in the process so result arrays do not page-fault",
    )

    @field_validator("backend")
    @classmethod
    def _normalise_backend(cls, v: str) -> str:
        v = v.strip().lower()
        if not v:
            raise ValueError("empty backend name")
        return v

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Settings from keyword arguments, then the environment, then defaults."""
        return load_settings(cls, overrides, environ)
