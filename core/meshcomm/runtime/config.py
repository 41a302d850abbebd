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

from ..protocol.errors import ConfigError
from ..protocol.timeouts import DEFAULT_TIMEOUT
from .placement import Coordinator, coordinator, parse_coordinator, placement

__all__ = ["Config", "Settings", "load_settings", "setting", "env_names", "MAX_TIMEOUT", "MAX_RANKS"]

M = TypeVar("M", bound=BaseModel)


def setting(default: Any, *, env: str, accepts: str, description: str, tuning: bool = False, **kw: Any) -> Any:
    """A pydantic field that knows its environment variable and what values it accepts.

    ``tuning=True`` marks a knob that benchmarks, tests or the launcher turn and users need
    not: it works the same, and is documented among the tuning knobs (docs/tuning.md)
    instead of the user's settings (docs/settings.md)."""
    extra: dict[str, Any] = {"env": env, "accepts": accepts}
    if tuning:
        extra["tuning"] = True
    return Field(default, description=description, json_schema_extra=extra, **kw)


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
#: the most ranks a job can have (MPI, gloo and the sockets frames count ranks in 32-bit ints)
MAX_RANKS = 2**31 - 1


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
            f"{where}={values.get(field)!r} is invalid: {err['msg']}" + (f"; accepted: {accepts}" if accepts else "")
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


def _from_starter(data: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Rank, world size and coordinator from whatever started the process (Slurm, mpirun,
    torchrun; see :mod:`meshcomm.runtime.placement`) where neither an argument nor meshcomm's own
    variable gives them."""
    out = dict(data)

    def unset(field: str, var: str) -> bool:
        return out.get(field) is None and not env.get(var, "").strip()

    if unset("rank", "MLX_RANK"):
        found = placement(env)
        if found is not None:
            out["rank"] = found.rank
            if unset("world_size", "MLX_WORLD_SIZE") and found.size is not None:
                out["world_size"] = found.size
            out.setdefault("placement_source", found.source)
    elif out.get("placement_source") is None:
        out["placement_source"] = "argument rank" if out.get("rank") is not None else "MLX_RANK"
    if unset("coordinator", "MLX_COORDINATOR"):
        coord = coordinator(env)
        if coord is not None:
            out["coordinator"] = str(coord)
            out.setdefault("coordinator_source", coord.source)
    elif out.get("coordinator_source") is None:
        out["coordinator_source"] = "argument coordinator" if out.get("coordinator") is not None else "MLX_COORDINATOR"
    return out


class Config(Settings):
    """meshcomm's core settings (plugins add their own sections; every variable: docs/settings.md).

    ``Config()`` reads the environment; ``Config.load(environ)`` reads a given mapping instead.
    """

    backend: str = setting(
        "any",
        env="MLX_BACKEND",
        accepts="'any' or the name of an installed backend (see `meshcomm info`)",
        description="which backend init() starts",
    )
    rank: int | None = setting(
        None,
        env="MLX_RANK",
        accepts=f"an integer from 0 to {MAX_RANKS - 1}",
        description="this process's rank",
        ge=0,
        lt=MAX_RANKS,
    )
    world_size: int | None = setting(
        None,
        env="MLX_WORLD_SIZE",
        accepts=f"an integer from 1 to {MAX_RANKS}, the same on every rank",
        description="number of ranks (when unset: from Slurm's, Open MPI's, MPICH's or torchrun's variables)",
        ge=1,
        le=MAX_RANKS,
    )
    coordinator: str | None = setting(
        None,
        env="MLX_COORDINATOR",
        accepts="host:port, e.g. node1:29500 or [fe80::1]:29500",
        description="where rank 0 serves the rendezvous of a job started without a hostfile (when unset: "
        "MASTER_ADDR with MASTER_PORT + 1, or derived from the Slurm step)",
    )
    placement_source: str | None = Field(
        None, description="whose variables gave rank and world size (meshcomm, Slurm, Open MPI, torchrun ...)"
    )
    coordinator_source: str | None = Field(None, description="which variables named the coordinator")
    hostfile: Path | None = setting(
        None,
        env="MLX_HOSTFILE",
        accepts="the path of a JSON hostfile",
        description="peers of the sockets backend",
    )
    timeout: float = setting(
        DEFAULT_TIMEOUT,
        env="MLX_TIMEOUT",
        accepts=f"a number of seconds > 0 and <= {MAX_TIMEOUT} (about 24.8 days)",
        description="seconds a rank waits on a peer (start-up and every operation) before it raises",
        gt=0,
        le=MAX_TIMEOUT,
        allow_inf_nan=False,
    )
    join: bool = setting(
        False,
        env="MESHCOMM_JOIN",
        accepts="1/0, true/false, yes/no, on/off",
        description="this process joins a running job as a new rank when the job's ranks call grow() "
        "(meshcomm launch --restart-lost sets it for the replacements it starts)",
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
        tuning=True,
        accepts="1/0, true/false, yes/no, on/off",
        description="keep freed blocks up to 1 GiB in the process so result arrays do not page-fault",
    )

    compiled: bool = setting(
        True,
        env="MESHCOMM_COMPILED",
        tuning=True,
        accepts="1/0, true/false, yes/no, on/off",
        description="run the core's compiled call path (the one-thread guard) when this installation "
        "has it (meshcomm info says; 0: the pure-Python one, which behaves the same)",
    )

    trace: Path | None = setting(
        None,
        env="MESHCOMM_TRACE",
        accepts="a directory (created if missing); meshcomm launch --trace DIR sets it for every rank",
        description="record every operation and write DIR/rank-R.json at exit (docs/observability.md)",
    )
    trace_events: int = setting(
        100_000,
        env="MESHCOMM_TRACE_EVENTS",
        tuning=True,
        accepts="a number of events from 1 to 2**31 - 1",
        description="operations each rank keeps while tracing (the oldest are dropped beyond it)",
        ge=1,
        le=2**31 - 1,
    )
    stall_after: float = setting(
        60.0,
        env="MESHCOMM_STALL_AFTER",
        accepts=f"a number of seconds from 0 to {MAX_TIMEOUT} (0 turns the stall inspector off)",
        description="after this long in one operation (at most half of MLX_TIMEOUT), a rank logs which "
        "ranks have not joined it",
        ge=0,
        le=MAX_TIMEOUT,
        allow_inf_nan=False,
    )

    def __init__(self, _environ: Mapping[str, str] | None = None, **data: Any) -> None:
        env = os.environ if _environ is None else _environ
        super().__init__(_environ=env, **_from_starter(data, env))
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            where = self.placement_source or "MLX_RANK/MLX_WORLD_SIZE"
            raise ConfigError(
                f"rank {self.rank} is not below the world size {self.world_size} (from {where}): ranks run from 0 "
                f"to {self.world_size - 1}; check how the job was started"
            )

    def coordinator_address(self) -> Coordinator | None:
        """The coordinator as host, port and the variables that named it (None when unset)."""
        if self.coordinator is None:
            return None
        return parse_coordinator(self.coordinator, self.coordinator_source or "MLX_COORDINATOR")

    @field_validator("coordinator")
    @classmethod
    def _check_coordinator(cls, v: str | None) -> str | None:
        if v is None:
            return v
        return str(parse_coordinator(v))

    max_object_bytes: int = setting(
        1 << 30,
        env="MESHCOMM_MAX_OBJECT_BYTES",
        accepts="a number of bytes from 1 to 2**63 - 1 (the ranks agree on it as a 64-bit integer)",
        description="largest pickled object all_gather_object/broadcast_object move (the smallest "
        "setting of any rank applies); larger ones raise ValueError on every rank",
        ge=1,
        le=2**63 - 1,
    )
    unsafe_objects: bool = setting(
        False,
        env="MESHCOMM_UNSAFE_OBJECTS",
        accepts="1/0, true/false, yes/no, on/off",
        description="unpickle all_gather_object/broadcast_object payloads without MESHCOMM_JOB_SECRET to "
        "authenticate them: anyone who can reach the job's connections can then run code as the job's user",
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
