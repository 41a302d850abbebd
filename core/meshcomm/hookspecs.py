"""The hooks a meshcomm plugin implements (pluggy project name ``meshcomm``).

A plugin is a module (or object) listed in the entry-point group ``meshcomm``::

    [project.entry-points.meshcomm]
    mybackend = "meshcomm_mybackend.plugin"

whose hook implementations are marked with :data:`hookimpl`. Plugins import ``hookimpl``
and everything else they use from :mod:`meshcomm.plugin`, not from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .registry import BackendRegistrar

__all__ = ["hookspec", "hookimpl", "PROJECT", "meshcomm_register_backends"]

PROJECT = "meshcomm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def meshcomm_register_backends(register: BackendRegistrar) -> None:
    """Register this plugin's backends by calling ``register(name, factory=..., ...)``.

    :param register: the registrar (:class:`meshcomm.plugin.BackendRegistrar`), typed
        keyword arguments: factory, availability check, environment check, settings model,
        launcher support (:data:`meshcomm.plugin.LauncherSupport`), priority, multiprocess,
        description.
    """
