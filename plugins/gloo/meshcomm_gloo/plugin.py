"""Registers the gloo backend with meshcomm (entry point group ``meshcomm``).

This module must import fast and never fail, so it does not import torch: the
availability check only looks torch up, and the factory imports it when a job
actually starts the backend.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from typing import Any

from meshcomm.backend import Backend
from meshcomm.config import Config
from meshcomm.errors import BackendUnavailableError
from meshcomm.hookspecs import hookimpl
from meshcomm.registry import BackendRegistrar

from .launcher import GlooLauncher
from .settings import GlooSettings

__all__ = ["meshcomm_register_backends", "available", "environment", "factory"]

_INSTALL = "install it with: pip install torch==2.13.0 (the CPU build)"


def available() -> str | None:
    """None if torch (which carries gloo) is installed, else why not; does not import torch."""
    if importlib.util.find_spec("torch") is None:
        return f"torch is not installed; the gloo backend uses the gloo inside torch.distributed; {_INSTALL}"
    try:
        version = md.version("torch")
    except md.PackageNotFoundError:
        return None
    major_minor = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if major_minor < (2, 4):
        return f"torch {version} is too old for the gloo backend (needs >= 2.4); {_INSTALL}"
    return None


def environment(config: Config, settings: Any) -> str | None:
    """None when this process was started for gloo (rank, world size and a rendezvous are set)."""
    missing = settings.missing(config.rank) if isinstance(settings, GlooSettings) else ["gloo settings"]
    return None if not missing else "not set: " + ", ".join(missing)


def factory(config: Config, settings: Any) -> Backend:
    """Rendezvous and connect the world group (imports torch here, not at plugin import)."""
    if not isinstance(settings, GlooSettings):
        settings = GlooSettings()
    reason = available()
    if reason is not None:
        raise BackendUnavailableError(f"gloo backend: {reason}")
    try:
        import torch.distributed as dist
    except Exception as exc:
        raise BackendUnavailableError(f"gloo backend: importing torch.distributed failed: {exc!r}") from exc
    if not dist.is_available() or not dist.is_gloo_available():
        raise BackendUnavailableError(
            "gloo backend: this torch build has no distributed/gloo support; " + _INSTALL
        )
    from .backend import GlooBackend
    from .errors import translate
    from .liveness import exchange
    from .rendezvous import WORLD_PREFIX, connect, make_store

    store, rank, size, where = make_store(config, settings)
    try:
        peers = exchange(store, rank, size)
        pg, ends = connect(store, WORLD_PREFIX, rank, size, config.timeout, settings.ifname)
    except RuntimeError as exc:
        raise translate(exc, where=f"rank {rank} of the world group (size {size}, {where})",
                        op="start-up (connecting to every rank)", timeout=config.timeout) from exc
    return GlooBackend(pg, store, WORLD_PREFIX, rank, size, config.timeout, settings.ifname, peers=peers,
                       ends=ends)


@hookimpl
def meshcomm_register_backends(register: BackendRegistrar) -> None:
    register(
        "gloo",
        factory=factory,
        available=available,
        environment=environment,
        settings=GlooSettings,
        launcher=GlooLauncher(),
        priority=50,
        description="gloo collectives through torch.distributed's ProcessGroupGloo (CPU)",
    )
