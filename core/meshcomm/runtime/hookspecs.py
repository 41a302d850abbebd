"""The hook vocabulary of meshcomm (pluggy project name ``meshcomm``): the hook, its markers
and the types the hook takes and fills in.

A plugin is a module (or object) listed in the entry-point group ``meshcomm``::

    [project.entry-points.meshcomm]
    mybackend = "meshcomm_mybackend.plugin"

whose hook implementations are marked with :data:`hookimpl`. Plugins import ``hookimpl``
and everything else they use from :mod:`meshcomm.plugin`, not from here. A tool that
watches a job (meshcomm's tracer and stall inspector are one) is listed in the group
``meshcomm.tools`` and implements :func:`meshcomm_world_started`; ``MESHCOMM_PLUGINS``
chooses among the backend plugins only.

This module sits below the plugin manager (:mod:`meshcomm.runtime.registry`) and the built-in
plugin (:mod:`meshcomm.runtime.single`): both import it, it imports neither, so the imports among
the three go one way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

from .launchspec import ExternalLauncher, LauncherSupport, RankEnvLauncher

if TYPE_CHECKING:  # pydantic is imported by the first init(), not by import meshcomm
    from pydantic import BaseModel

    from ..protocol.backend import Backend
    from .config import Config

__all__ = [
    "hookspec",
    "hookimpl",
    "PROJECT",
    "meshcomm_register_backends",
    "meshcomm_world_started",
    "TOOLS",
    "Factory",
    "Availability",
    "EnvironmentCheck",
    "BackendSpec",
    "SpecTable",
    "BackendRegistrar",
]

PROJECT = "meshcomm"
hookspec = pluggy.HookspecMarker(PROJECT)
#: the entry-point group of tools (plugins that watch a job rather than carry it)
TOOLS = f"{PROJECT}.tools"
hookimpl = pluggy.HookimplMarker(PROJECT)


#: ``factory(config, settings) -> Backend``: starts the backend (``settings`` is an instance
#: of the model passed as ``settings=``, or None)
Factory = Callable[["Config", Any], "Backend"]
#: ``available() -> None | str``: None when the backend's libraries load, else why not
Availability = Callable[[], str | None]
#: ``environment(config, settings) -> None | str``: None when this process was started for the backend
EnvironmentCheck = Callable[["Config", Any], str | None]


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


class SpecTable(Protocol):
    """Where a :class:`BackendRegistrar` puts the backends it is given, by name
    (:class:`meshcomm.runtime.registry.Registry`); a protocol so that this module need not import
    the registry."""

    specs: dict[str, BackendSpec]


class BackendRegistrar:
    """The ``register`` object handed to :func:`meshcomm_register_backends`."""

    def __init__(self, registry: SpecTable) -> None:
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
                :func:`meshcomm.runtime.config.setting` so each field names its environment variable).
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
            raise ValueError(f"backend {key!r} registered twice: by {other.plugin!r} and by {self._plugin!r}")
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


@hookspec
def meshcomm_register_backends(register: BackendRegistrar) -> None:
    """Register this plugin's backends by calling ``register(name, factory=..., ...)``.

    :param register: the registrar (:class:`meshcomm.plugin.BackendRegistrar`), typed
        keyword arguments: factory, availability check, environment check, settings model,
        launcher support (:data:`meshcomm.plugin.LauncherSupport`), priority, multiprocess,
        description.
    """


@hookspec
def meshcomm_world_started(config: Config, world: Any) -> None:
    """A world group has started on this rank (``init()``; not the size-1 fallback): a tool
    attaches to it here, e.g. through :mod:`meshcomm.api.observer`.

    :param config: the settings the world started with (:class:`meshcomm.Config`).
    :param world: the world :class:`meshcomm.Group`.
    """
