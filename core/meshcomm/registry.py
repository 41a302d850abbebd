"""Finding backends: entry points loaded lazily through pluggy, one registrar, selection.

Plugins are loaded on first use (``init()``, ``backends()``, the CLI), never at
``import meshcomm``. A plugin that fails to import or to register is listed as
unavailable with its error and does not affect the others.

Environment switches: ``MESHCOMM_PLUGINS`` (comma list of entry-point names to load;
empty = load none) and ``MESHCOMM_DISABLE_PLUGINS`` (comma list to skip).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from . import hookspecs
from .backend import Backend
from .errors import BackendUnavailableError, ConfigError
from .launch.spec import ExternalLauncher, LauncherSupport, RankEnvLauncher

if TYPE_CHECKING:  # pydantic is imported by the first init(), not by import meshcomm
    from pydantic import BaseModel

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

#: ``factory(config, settings) -> Backend``: starts the backend (``settings`` is an instance
#: of the model passed as ``settings=``, or None)
Factory = Callable[["Config", Any], Backend]
#: ``available() -> None | str``: None when the backend's libraries load, else why not
Availability = Callable[[], str | None]
#: ``environment(config, settings) -> None | str``: None when this process was started for the backend
EnvironmentCheck = Callable[["Config", Any], str | None]


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
class BackendSpec:
    """Everything a plugin tells the core about one backend."""

    name: str
    factory: Factory
    available: Availability = lambda: None
    environment: EnvironmentCheck = lambda config, settings: None
    settings: type[BaseModel] | None = None
    launcher: LauncherSupport | None = None
    priority: int = 100
    multiprocess: bool = True
    description: str = ""
    plugin: str = ""
    distribution: str | None = None
    version: str | None = None

    def unavailable_reason(self) -> str | None:
        """None when the backend's libraries load, else why not (never raises)."""
        try:
            return self.available()
        except Exception as exc:  # an availability check must not break listing
            return f"availability check failed: {exc!r}"

    def load_settings(self, overrides: Mapping[str, Any] | None = None) -> Any:
        """This backend's validated settings section (None when it has none)."""
        from .config import load_settings

        return None if self.settings is None else load_settings(self.settings, overrides)


class BackendRegistrar:
    """The ``register`` object handed to :func:`meshcomm_register_backends`."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._plugin = ""
        self._dist: tuple[str | None, str | None] = (None, None)

    def __call__(
        self,
        name: str,
        *,
        factory: Factory,
        available: Availability | None = None,
        environment: EnvironmentCheck | None = None,
        settings: type[BaseModel] | None = None,
        launcher: LauncherSupport | None = None,
        priority: int = 100,
        multiprocess: bool = True,
        description: str = "",
    ) -> None:
        """Register backend ``name``.

        Args:
            name: lower-case name users select with ``MLX_BACKEND`` / ``init(backend=...)``.
            factory: ``factory(config, settings) -> Backend``; starts the backend (connects,
                rendezvous). Raise BackendUnavailableError or DistributedError on failure.
            available: ``() -> None | str``: None if the libraries load, else why not.
            environment: ``(config, settings) -> None | str``: None if this process was
                started for this backend (so ``any`` picks it), else what is missing.
            settings: pydantic model of the backend's own settings (built with
                :func:`meshcomm.config.setting` so each field names its environment variable).
            launcher: what ``meshcomm launch --backend NAME`` calls: an object with
                ``rank_env(job)`` or ``external_command(job, argv, env)``
                (:data:`meshcomm.plugin.LauncherSupport`); None if the backend cannot be launched.
            priority: order in which ``any`` tries backends (lower first).
            multiprocess: False for backends that never span processes (size 1).
            description: one line shown by ``meshcomm info``.
        """
        key = name.strip().lower()
        if not callable(factory):
            raise TypeError(f"backend {key!r} (plugin {self._plugin!r}): factory must be callable, got {factory!r}")
        if launcher is not None and not isinstance(launcher, (RankEnvLauncher, ExternalLauncher)):
            raise TypeError(
                f"backend {key!r} (plugin {self._plugin!r}): launcher {type(launcher).__name__} has neither "
                "rank_env(job) nor external_command(job, argv, env); pass one of those (see "
                "meshcomm.plugin.LauncherSupport) or launcher=None"
            )
        if key in self._registry.specs:
            other = self._registry.specs[key]
            raise ValueError(
                f"backend {key!r} registered twice: by {other.plugin!r} and by {self._plugin!r}"
            )
        spec = BackendSpec(
            name=key,
            factory=factory,
            settings=settings,
            launcher=launcher,
            priority=priority,
            multiprocess=multiprocess,
            description=description,
            plugin=self._plugin,
            distribution=self._dist[0],
            version=self._dist[1],
        )
        if available is not None:
            spec.available = available
        if environment is not None:
            spec.environment = environment
        self._registry.specs[key] = spec


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

    def __post_init__(self) -> None:
        self.pm.add_hookspecs(hookspecs)

    # -- loading ----------------------------------------------------------------------
    def load(self, environ: Mapping[str, str] | None = None, *, entry_points: bool = True) -> Registry:
        """Register the built-in plugins, then every allowed entry point, then call the hook."""
        environ = os.environ if environ is None else environ
        from . import single

        self.pm.register(single, name="single")
        if entry_points:
            self._load_entry_points(environ)
        registrar = BackendRegistrar(self)
        dists = {id(p): d for p, d in self.pm.list_plugin_distinfo()}
        for impl in self.pm.hook.meshcomm_register_backends.get_hookimpls():
            name = self.pm.get_name(impl.plugin) or repr(impl.plugin)
            dist = dists.get(id(impl.plugin))
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
        seen: set[str] = set()
        for ep in md.entry_points(group=hookspecs.PROJECT):
            if ep.name in seen or ep.name in blocked or (allowed is not None and ep.name not in allowed):
                continue
            seen.add(ep.name)
            try:
                self.pm.load_setuptools_entrypoints(hookspecs.PROJECT, name=ep.name)
            except Exception as exc:
                dist = getattr(ep, "dist", None)
                dname, ver = _dist_info(dist) if dist is not None else (None, None)
                last = traceback.format_exception_only(type(exc), exc)[-1].strip()
                self.broken.append(_Broken(ep.name, dname, ver, f"plugin failed to load: {last}"))

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
                BackendInfo(spec.name, spec.distribution, spec.version, reason is None, reason,
                            configured, spec.description)
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
        settings = spec.load_settings()
        backend = spec.factory(config, settings)
        if not isinstance(backend, Backend):
            raise TypeError(
                f"backend {spec.name!r} (plugin {spec.plugin!r}) returned {type(backend).__name__}, "
                "which is not a meshcomm.backend.Backend"
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
        return (f"this process is rank {config.rank} ({where}) of a job meeting at the coordinator "
                f"{config.coordinator} ({config.coordinator_source or 'MLX_COORDINATOR'})")
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
