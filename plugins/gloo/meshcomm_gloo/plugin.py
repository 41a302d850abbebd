"""Registers the gloo backend with meshcomm (entry point group ``meshcomm``).

This module must import fast and never fail, so it does not import torch: the
availability check only looks torch up, and the factory imports it when a job
actually starts the backend.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import logging
from typing import TYPE_CHECKING, Any

from meshcomm.plugin import (
    SECRET_HINT,
    BackendRegistrar,
    BackendUnavailableError,
    Config,
    DistributedError,
    check_job_secret,
    hookimpl,
)

from .launcher import GlooLauncher
from .settings import GlooSettings

if TYPE_CHECKING:  # NumPy's import waits for a backend to start: the launcher loads this module too
    from meshcomm.plugin import Backend

__all__ = ["meshcomm_register_backends", "available", "environment", "factory", "NO_SECRET_WARNING"]

log = logging.getLogger("meshcomm.gloo")

_INSTALL = "install it with: pip install torch==2.13.0 (the CPU build)"

#: printed once per process, by rank 0, when a job runs without MESHCOMM_JOB_SECRET
NO_SECRET_WARNING = (
    "meshcomm gloo rank 0: MESHCOMM_JOB_SECRET is not set, so the rendezvous store's values are tagged with a "
    "key anyone can compute: any process that can reach the store's port (other users of this machine, other "
    "machines when it listens on a network address) can write the addresses gloo connects to and the job's "
    f"failure records. {SECRET_HINT}. gloo's data connections are never authenticated or encrypted (use a "
    "WireGuard or ssh tunnel between hosts). Set MESHCOMM_REQUIRE_SECRET=1 to make a missing secret an error."
)


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
    from .placing import missing as lacking

    missing = lacking(config, settings) if isinstance(settings, GlooSettings) else ["gloo settings"]
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
        raise BackendUnavailableError("gloo backend: this torch build has no distributed/gloo support; " + _INSTALL)
    from .admission import admit, note_rejection, rejection_of_others
    from .backend import GlooBackend
    from .errors import StoreAuthError, translate
    from .liveness import RankProcess, spin_for, suspects
    from .rendezvous import WORLD_PREFIX, connect, device_of, make_store
    from .session import open_session

    check_job_secret(
        settings, who="gloo backend", rank=config.rank, size=config.world_size, warning=NO_SECRET_WARNING, log=log
    )
    if config.join:
        return _join(config, settings)
    store, rank, size, where = make_store(config, settings)
    peers: list[RankProcess] = []
    try:
        peers = admit(store, rank, size, open_session(store, rank, size))
        pg, ends, line = connect(store, WORLD_PREFIX, rank, size, config.timeout, device_of(settings), peers)
    except StoreAuthError as exc:
        note_rejection(store, rank, str(exc))
        raise
    except DistributedError:
        raise
    except RuntimeError as exc:
        if store.rejected is not None:  # a forged value whose error lost its class inside gloo
            note_rejection(store, rank, str(store.rejected))
            raise store.rejected from exc
        other = rejection_of_others(store, rank, size)
        if other is not None:
            q, said = other
            raise StoreAuthError(
                f"[gloo] rank {rank} of the world group (size {size}, {where}): start-up "
                f"stopped because rank {q} refused a value in the rendezvous store: {said}",
                key="",
                peer=q,
            ) from exc
        raise translate(
            exc,
            where=f"rank {rank} of the world group (size {size}, {where})",
            op="start-up (connecting to every rank)",
            timeout=config.timeout,
            suspects=suspects(peers, list(range(size)), rank),
        ) from exc
    return GlooBackend(
        pg,
        store,
        WORLD_PREFIX,
        rank,
        size,
        config.timeout,
        device_of(settings),
        peers=peers,
        ends=ends,
        line=line,
        spin=spin_for(settings.spin_us, peers, rank),
    )


def _join(config: Config, settings: GlooSettings) -> Backend:
    """A newcomer's world: ask the running job to admit this process (:mod:`.joining`), then
    connect to the grown world it was given a place in."""
    import datetime

    from .backend import GlooBackend
    from .errors import translate
    from .joining import ask_to_join
    from .liveness import spin_for
    from .rendezvous import connect, device_of, make_store

    store, _rank, _size, where = make_store(config, settings, join=True)
    place = ask_to_join(store, config.timeout)
    store.set_timeout(datetime.timedelta(seconds=config.timeout))
    p, ifname = place, device_of(settings)
    try:
        pg, ends, line = connect(store, p.prefix, p.rank, p.size, config.timeout, ifname, p.peers, p.members)
    except RuntimeError as exc:
        raise translate(
            exc,
            where=f"newcomer, rank {place.rank} of the grown world (size {place.size}, {where})",
            op="joining (connecting to every rank)",
            timeout=config.timeout,
        ) from exc
    world = GlooBackend(
        pg,
        store,
        place.prefix,
        place.rank,
        place.size,
        config.timeout,
        ifname,
        "world",
        place.peers,
        place.members,
        ends,
        line,
        spin_for(settings.spin_us, place.peers, place.members[place.rank]),
    )
    world.epoch = place.epoch
    return world


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
