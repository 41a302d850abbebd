"""The tracer and the stall inspector as a tool plugin (entry-point group ``meshcomm.tools``):
they attach when a world starts (``meshcomm_world_started``), so the API never imports them,
and the registry loads this module without them (the launcher loads it too)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..runtime.hookspecs import hookimpl

if TYPE_CHECKING:
    from ..runtime.config import Config

__all__ = ["meshcomm_world_started"]


@hookimpl
def meshcomm_world_started(config: Config, world: Any) -> None:
    """Start tracing and the stall inspector on ``world`` when ``config`` turns them on."""
    from . import recorder

    recorder.start(config, world)
