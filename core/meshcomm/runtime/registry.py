"""Finding backends: plugins loaded lazily through pluggy, what they register, selection.

Plugins are loaded on first use (``init()``, ``backends()``, the CLI), never at
``import meshcomm``. A plugin that fails to import or to register is listed as
unavailable with its error and does not affect the others.

The hook and what it deals in (:class:`BackendRegistrar`, :class:`BackendSpec`, the
``Factory`` / ``Availability`` / ``EnvironmentCheck`` types) are defined in
:mod:`meshcomm.runtime.hookspecs`, below this module, and re-exported here; the built-in size-1
plugin :mod:`meshcomm.runtime.single` imports only that vocabulary, so this module can import it.

It also loads the tools of the entry-point group ``meshcomm.tools`` (the core's tracer is
one) and tells them when a world starts (:meth:`Registry.world_started`).

Environment switches: ``MESHCOMM_PLUGINS`` (comma list of backend plugins' entry-point names
to load; empty = load none) and ``MESHCOMM_DISABLE_PLUGINS`` (comma list to skip, tools too).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from ..protocol.errors import BackendUnavailableError, ConfigError
from . import hookspecs, single
from .hookspecs import Availability, BackendRegistrar, BackendSpec, EnvironmentCheck, Factory

if TYPE_CHECKING:
    from ..protocol.backend import Backend
    from .config import Config

__all__ = [
    "BackendInfo",
    "BackendSpec",
    "BackendRegistrar",
    "Factory",
    "Availability",
    "EnvironmentCheck",
    "Registry",
    "get_registry",
    "reset_registry",
]


@dataclass(frozen=True)
class BackendInfo:
    """What ``meshcomm.backends()`` reports about one backend."""

    name: str
    distribution: str | None
    version: str | None
    available: bool
    reason: str | None
    configured: bool = False
    description: str = ""


@dataclass
class _Broken:
    plugin: str
    distribution: str | None
    version: str | None
    error: str


@dataclass
class Registry:
    """The plugin manager and the backends its plugins registered."""

    pm: pluggy.PluginManager = field(default_factory=lambda: pluggy.PluginManager(hookspecs.PROJECT))
    specs: dict[str, BackendSpec] = field(default_factory=dict)
    broken: list[_Broken] = field(default_factory=list)
    #: the distribution each entry-point plugin came from (by the plugin's id)
    _plugin_dists: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pm.add_hookspecs(hookspecs)

    # -- loading ----------------------------------------------------------------------
    def load(self, environ: Mapping[str, str] | None = None, *, entry_points: bool = True) -> Registry:
        """Register the built-in plugins, then every allowed entry point, then call the hook."""
        environ = os.environ if environ is None else environ
        self.pm.register(single, name="single")
        if entry_points:
            self._load_entry_points(environ)
        registrar = BackendRegistrar(self)
        for impl in self.pm.hook.meshcomm_register_backends.get_hookimpls():
            name = self.pm.get_name(impl.plugin) or repr(impl.plugin)
            dist = self._plugin_dists.get(id(impl.plugin))
            dist_name, version = _dist_info(dist) if dist is not None else ("meshcomm", _own_version())
            registrar._plugin, registrar._dist = name, (dist_name, version)
            try:
                impl.function(register=registrar)
            except Exception as exc:
                self.broken.append(_Broken(name, dist_name, version, f"registration failed: {exc!r}"))
        return self

    def _load_entry_points(self, environ: Mapping[str, str]) -> None:
        allow = environ.get("MESHCOMM_PLUGINS")
        allowed = None if allow is None else {x.strip() for x in allow.split(",") if x.strip()}
        blocked = {x.strip() for x in environ.get("MESHCOMM_DISABLE_PLUGINS", "").split(",") if x.strip()}
        # one pass over the installed distributions' entry points (pluggy's loader makes one
        # per plugin: 4 scans of every distribution in the environment, in every rank's start);
        # MESHCOMM_PLUGINS chooses among the backend plugins, not among the tools
        found = md.entry_points()
        for ep in (*found.select(group=hookspecs.PROJECT), *found.select(group=hookspecs.TOOLS)):
            backend_plugin = ep.group == hookspecs.PROJECT
            if (
                self.pm.get_plugin(ep.name) is not None
                or self.pm.is_blocked(ep.name)
                or ep.name in blocked
                or (backend_plugin and allowed is not None and ep.name not in allowed)
            ):
                continue
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
                self._plugin_dists[id(plugin)] = ep.dist
            except Exception as exc:
                dist = getattr(ep, "dist", None)
                dname, ver = _dist_info(dist) if dist is not None else (None, None)
                last = traceback.format_exception_only(type(exc), exc)[-1].strip()
                self.broken.append(_Broken(ep.name, dname, ver, f"plugin failed to load: {last}"))

    def world_started(self, config: Config, world: Any) -> None:
        """Tell the tools (``meshcomm_world_started``) that ``world`` has started on this rank."""
        self.pm.hook.meshcomm_world_started(config=config, world=world)

    # -- queries ----------------------------------------------------------------------
    def info(self, config: Config | None = None) -> list[BackendInfo]:
        """Every registered backend (and every broken plugin), for listings."""
        config = config or _quiet_config()
        out = []
        for spec in sorted(self.specs.values(), key=lambda s: (s.priority, s.name)):
            reason = spec.unavailable_reason()
            configured = False
            if reason is None and spec.multiprocess:
                configured = _environment_reason(spec, config) is None
            out.append(
                BackendInfo(
                    spec.name, spec.distribution, spec.version, reason is None, reason, configured, spec.description
                )
            )
        for b in self.broken:
            out.append(BackendInfo(b.plugin, b.distribution, b.version, False, b.error))
        return out

    def names(self) -> list[str]:
        return sorted(self.specs)

    def spec(self, name: str) -> BackendSpec:
        """The spec of backend ``name``; ConfigError (a ValueError) listing the installed ones if unknown."""
        key = name.strip().lower()
        if key in self.specs:
            return self.specs[key]
        for b in self.broken:
            if b.plugin == key:
                raise BackendUnavailableError(f"backend {key!r} is installed but broken: {b.error}")
        raise ConfigError(
            f"unknown backend {name!r} (from MLX_BACKEND, init(backend=...) or --backend); "
            f"installed backends: {', '.join(self.names())} (or 'any'). Fix the name, or install "
            "the plugin that provides it, e.g. pip install meshcomm-<name>."
        )

    # -- selection --------------------------------------------------------------------
    def start(self, name: str, config: Config, strict: bool) -> tuple[Backend, str]:
        """Start backend ``name`` (or the first usable one for ``any``).

        Returns the backend and its name; ``("single")`` when nothing applies and not strict.
        """
        if name != "any":
            spec = self.spec(name)
            reason = spec.unavailable_reason() or _environment_reason(spec, config)
            if reason is not None:
                if strict or not spec.multiprocess:
                    raise BackendUnavailableError(f"backend {spec.name!r} cannot start: {reason}")
                warnings.warn(
                    f"meshcomm: backend {spec.name!r} cannot start ({reason}); "
                    "running as a single process. Pass strict=True to make this an error.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return self._start_spec(self.specs["single"], config), "single"
            return self._start_spec(spec, config), spec.name
        why: list[str] = []
        for spec in sorted(self.specs.values(), key=lambda s: (s.priority, s.name)):
            if not spec.multiprocess:
                continue
            reason = spec.unavailable_reason() or _environment_reason(spec, config)
            if reason is None:
                return self._start_spec(spec, config), spec.name
            why.append(f"  {spec.name}: {reason}")
        why += [f"  {b.plugin}: {b.error}" for b in self.broken]
        job = _job_environment(config)
        if job is not None and not strict:
            listing = "\n".join(why) or "  (no multi-process backend is installed)"
            raise BackendUnavailableError(
                f"{job}, but no backend could start, and running it alone would give wrong results. "
                "Installed backends and why each is unusable:\n" + listing + "\nSet MLX_BACKEND and that "
                "backend's variables (for sockets without a hostfile: MLX_COORDINATOR=host:port of rank 0's "
                "machine), or start the program with `meshcomm launch`."
            )
        if strict:
            listing = "\n".join(why) or "  (no multi-process backend is installed)"
            raise BackendUnavailableError(
                "no backend could be started (strict=True). Installed backends and why each is unusable:\n"
                + listing
                + "\nStart the program with `meshcomm launch`, or set MLX_BACKEND and its variables."
            )
        return self._start_spec(self.specs["single"], config), "single"

    @staticmethod
    def _start_spec(spec: BackendSpec, config: Config) -> Backend:
        from ..protocol.backend import Backend  # here: loading the registry (the launcher) needs no NumPy

        settings = spec.load_settings()
        backend = spec.factory(config, settings)
        if not isinstance(backend, Backend):
            raise TypeError(
                f"backend {spec.name!r} (plugin {spec.plugin!r}) returned {type(backend).__name__}, "
                "which is not a meshcomm.protocol.backend.Backend"
            )
        return backend


def _job_environment(config: Config) -> str | None:
    """What says this process is one rank of a multi-process job (None when nothing does):
    a world size above 1 (meshcomm's, a scheduler's or a launcher's variables), or a
    coordinator together with a rank. ``any`` then must not fall back to size 1."""
    where = config.placement_source or "MLX_RANK"
    if config.world_size is not None and config.world_size > 1:
        source = "MLX_WORLD_SIZE says so" if where in ("MLX_RANK", "argument rank") else f"{where}'s variables say so"
        rank = "" if config.rank is None else f"rank {config.rank} "
        return f"this process is {rank}of a job of {config.world_size} ranks ({source})"
    if config.coordinator is not None and config.rank is not None and config.world_size != 1:
        return (
            f"this process is rank {config.rank} ({where}) of a job meeting at the coordinator "
            f"{config.coordinator} ({config.coordinator_source or 'MLX_COORDINATOR'})"
        )
    return None


def _environment_reason(spec: BackendSpec, config: Config) -> str | None:
    try:
        return spec.environment(config, spec.load_settings())
    except ConfigError:
        raise
    except Exception as exc:
        return f"environment check failed: {exc!r}"


def _quiet_config() -> Config:
    from .config import Config

    try:
        return Config.load()
    except ConfigError:
        return Config()


def _dist_info(dist: Any) -> tuple[str | None, str | None]:
    try:
        return dist.metadata["Name"], dist.version
    except Exception:
        return None, None


def _own_version() -> str | None:
    try:
        return md.version("meshcomm")
    except md.PackageNotFoundError:
        return None


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process's registry, loading plugins on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry().load()
    return _REGISTRY


def reset_registry() -> None:
    """Forget loaded plugins so the next call reloads them (for tests and after pip install)."""
    global _REGISTRY
    _REGISTRY = None
