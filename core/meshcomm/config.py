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

__all__ = ["Config", "load_settings", "setting", "env_names"]

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


def load_settings(
    model: type[M], overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> M:
    """Build ``model`` from ``overrides`` (keyword arguments), then ``environ``, then defaults.

    Raises ConfigError naming the argument or environment variable, its value, and what
    it accepts. Empty environment variables count as unset.
    """
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
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
    try:
        return model(**values)
    except ValidationError as exc:
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
        raise ConfigError("; ".join(lines)) from None


class Config(BaseModel):
    """meshcomm's core settings (plugins add their own sections, see the README)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
        accepts="a number of seconds > 0",
        description="seconds a rank waits on a peer (start-up and every operation) before it raises",
        gt=0,
    )
    debug: bool = setting(
        False,
        env="MLX_DEBUG",
        accepts="1/0, true/false, yes/no, on/off",
        description="check op, shape and dtype across ranks before every operation",
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
