"""Registers the ``sockets`` backend: settings, environment check, factory, launcher support."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, Literal

from meshcomm.plugin import (
    SECRET_HINT,
    BackendRegistrar,
    Config,
    ConfigError,
    DistributedError,
    JobSecretSettings,
    JobSpec,
    PeerLostError,
    check_job_secret,
    hookimpl,
    setting,
)

if TYPE_CHECKING:  # NumPy's import waits for a backend to start: the launcher loads this module too
    from meshcomm.plugin import Backend

    from .connect import Connection
    from .dialing import Dialer
    from .hostfile import Peer
    from .recovery import Recovery

__all__ = ["SocketsSettings", "meshcomm_register_backends", "SocketsLauncher", "NO_SECRET_WARNING"]

log = logging.getLogger("meshcomm.sockets")

#: printed once, by rank 0, when a job runs without MESHCOMM_JOB_SECRET
NO_SECRET_WARNING = (
    "meshcomm sockets rank 0: MESHCOMM_JOB_SECRET is not set, so this job has no secret: any process that can "
    "reach a rank's port (other users of this machine, and other machines when ranks listen on a network "
    "address) can join the job as a rank, read its arrays and change them, and frame authentication then "
    f"uses a key anyone can compute. {SECRET_HINT}. Set MESHCOMM_REQUIRE_SECRET=1 to make a missing secret "
    "an error."
)


class SocketsSettings(JobSecretSettings):
    """Settings of the sockets backend (besides the core's MLX_HOSTFILE, MLX_RANK, MLX_TIMEOUT);
    ``secret`` and ``require_secret`` (every connection proves the job secret) are inherited."""

    bind: str | None = setting(
        None,
        env="MESHCOMM_SOCKETS_BIND",
        accepts="a local address to listen on, e.g. 0.0.0.0 or ::",
        description="listen here instead of this rank's hostfile address (peers still use the hostfile's)",
    )
    integrity: Literal["auto", "payload", "header"] = setting(
        "auto",
        env="MESHCOMM_SOCKETS_INTEGRITY",
        accepts="auto, payload or header (the same on every rank)",
        description="payload: every TCP frame's payload is authenticated too (HMAC-SHA256); header: only "
        "headers and control frames (a changed payload byte goes unnoticed); auto: payload on links "
        "that leave the host, header on loopback links, which no one off the host can be on",
    )
    chunk_kib: int = setting(
        4096,
        env="MESHCOMM_SOCKETS_CHUNK_KIB",
        tuning=True,
        accepts="an integer from 4 to 65536",
        description="chunk size of the pipelined ring, KiB (the same on every rank)",
        ge=4,
        le=65536,
    )
    shm: bool = setting(
        True,
        env="MESHCOMM_SOCKETS_SHM",
        accepts="1/0, true/false",
        description="ranks on the same host exchange data through shared memory (0: TCP only)",
    )
    shm_piece_kib: int | None = setting(
        None,
        env="MESHCOMM_SOCKETS_SHM_PIECE_KIB",
        tuning=True,
        accepts="an integer from 4 to 65536",
        description="size of one shared-memory slot, KiB (default: 512, or 2048 when a host has more "
        "ranks than cores; the host's first rank decides for all)",
        ge=4,
        le=65536,
    )
    direct: bool = setting(
        True,
        env="MESHCOMM_SOCKETS_DIRECT",
        tuning=True,
        accepts="1/0, true/false",
        description="ranks on the same host read each other's arrays in place (process_vm_readv) for "
        "collectives of 256 KiB and more (all-reduces from 2 MiB on 2 local ranks, 16 MiB on more): one copy "
        "instead of two (0: always copy through shared memory)",
    )
    native: bool = setting(
        True,
        env="MESHCOMM_SOCKETS_NATIVE",
        tuning=True,
        accepts="1/0, true/false",
        description="publish and wait on shared memory in C when this installation has the compiled loop "
        "(meshcomm info says; 0: the pure-Python loop; ranks may differ)",
    )
    host_id: str | None = setting(
        None,
        env="MESHCOMM_HOST_ID",
        accepts="any string",
        description="names this rank's host for shared memory (default: hostname + boot id + /dev/shm)",
    )
    spin_us: int = setting(
        20000,
        env="MESHCOMM_SOCKETS_SPIN_US",
        tuning=True,
        accepts="an integer from 0 to 100000",
        description="microseconds a waiting rank polls before it sleeps in the kernel (0: sleep at once); "
        "several scheduler time slices, so on a machine shared with other busy processes a rank is still "
        "polling when its descheduled peer comes back, instead of waiting a slice to be woken",
        ge=0,
        le=100000,
    )
    connect: Literal["auto", "all", "needed"] = setting(
        "auto",
        env="MESHCOMM_SOCKETS_CONNECT",
        accepts="auto, all or needed (the same on every rank)",
        description="all: every pair of ranks connects at start-up (a full mesh; grow() needs it); needed: a "
        "rank connects at start-up to about 2 log2(n) peers (the ring's and the doubling algorithms') and to any "
        "other the first time an operation needs it, so its open sockets grow with what it talks to, not with "
        "the world; auto: all up to 64 ranks, needed above",
    )
    listen_fd: int | None = setting(
        None,
        env="MESHCOMM_SOCKETS_LISTEN_FD",
        tuning=True,
        accepts="an inherited listening socket's file descriptor",
        description="set by meshcomm launch: a listening socket it opened for this rank (no port race)",
        ge=0,
        le=2**31 - 1,
    )


def _version(chunk_kib: int, integrity: str = "payload", connect: str = "all") -> str:
    def v(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "?"

    from .wire import PROTOCOL

    return (
        f"meshcomm {v('meshcomm')}, meshcomm-sockets {v('meshcomm-sockets')}, protocol {PROTOCOL}, "
        f"chunk {chunk_kib} KiB, integrity {integrity}" + ("" if connect == "all" else f", connect {connect}")
    )


def _environment(config: Config, settings: SocketsSettings) -> str | None:
    if config.rank is not None and config.hostfile is not None:
        return None
    if config.rank is not None and config.coordinator is not None and config.world_size is not None:
        return None
    return (
        "needs MLX_RANK with MLX_HOSTFILE, or a rank, a world size and a coordinator (MLX_COORDINATOR, "
        "MASTER_ADDR/MASTER_PORT or a Slurm step) "
        f"(MLX_HOSTFILE={str(config.hostfile) if config.hostfile else ''!r}, "
        f"rank={'' if config.rank is None else config.rank!r}, "
        f"world size={'' if config.world_size is None else config.world_size!r}, "
        f"coordinator={config.coordinator or ''!r})"
    )


#: for tests only: where every sequence counter starts (the same on every rank), so a short
#: job can cross the 2**32 wrap-around that a real one reaches after billions of calls
SEQ_START_ENV = "MESHCOMM_SOCKETS_TEST_SEQ_START"


def _seq_start() -> int:
    text = os.environ.get(SEQ_START_ENV, "0")
    try:
        value = int(text, 0)
    except ValueError:
        raise ConfigError(f"{SEQ_START_ENV}={text!r} is not an integer (a test setting; unset it)") from None
    if not 0 <= value < 1 << 32:
        raise ConfigError(f"{SEQ_START_ENV}={value} must be in [0, 2**32) (a test setting; unset it)")
    return value


def _check_secret(rank: int, settings: SocketsSettings, size: int, hosts: list[str]) -> bytes | None:
    """The per-user key when this one-host job has no secret and uses it (see check_job_secret)."""
    return check_job_secret(
        settings, who="sockets backend", rank=rank, size=size, warning=NO_SECRET_WARNING, log=log, hosts=hosts
    )


def _factory(config: Config, settings: SocketsSettings) -> Backend:
    from .connect import establish, open_listener
    from .dialing import Dialer, connects_all, overlay
    from .hostfile import read_hostfile
    from .recovery import Recovery

    reason = _environment(config, settings)
    if reason is not None or config.rank is None:
        raise ConfigError(reason or "no rank")
    listener = None
    startup = config.timeout
    if config.hostfile is not None:
        peers = read_hostfile(config.hostfile)
        if config.rank >= len(peers):
            raise ConfigError(
                f"MLX_RANK={config.rank} but MLX_HOSTFILE={str(config.hostfile)!r} lists {len(peers)} "
                f"ranks; expected 0 <= MLX_RANK < {len(peers)}"
            )
        local_key = _check_secret(config.rank, settings, len(peers), [p.ip for p in peers])
        secret = local_key or (settings.secret or "").encode()
        if settings.listen_fd is not None:
            listener = socket.socket(fileno=settings.listen_fd)
    else:
        from .rendezvous import peers_from_coordinator

        coord = config.coordinator_address()
        local_key = _check_secret(config.rank, settings, config.world_size or 1, [coord.host] if coord else [])
        secret = local_key or (settings.secret or "").encode()
        peers, listener, startup = peers_from_coordinator(config, settings.bind, settings.host_id, secret)
    all_pairs = connects_all(settings.connect, len(peers))
    version = _version(settings.chunk_kib, settings.integrity, "all" if all_pairs else "needed")
    start = _seq_start()

    def build(rank: int, world: list[Peer], conns: dict[int, Connection], recovery: Recovery | None) -> Backend:
        """The world of ``rank`` among ``world`` over ``conns`` (at start-up, and again for
        the survivors of a failure or with newcomers: :mod:`.recovery`, :mod:`.joining`)."""
        return _world(config, settings, rank, len(world), conns, local_key, start, recovery)

    if config.join:
        return _join(config, settings, peers, listener, secret, version, build)
    if listener is None and len(peers) > 1:
        listener = open_listener(config.rank, peers[config.rank], settings.bind, len(peers))
    if not all_pairs and listener is not None:
        dialer = Dialer(peers, config.rank, listener, secret=secret, version=version, timeout=startup)
        try:
            conns = dialer.start(overlay(config.rank, len(peers)))
            dialer.timeout = config.timeout
            survivors = Recovery(peers, config.rank, secret, version, config.timeout, listener, build)
            dialer.later = survivors.hellos
            return _world(config, settings, config.rank, len(peers), conns, local_key, start, survivors, dialer)
        except BaseException:
            dialer.close()
            raise
    conns = establish(
        peers,
        config.rank,
        secret=secret,
        version=version,
        timeout=startup,
        bind=settings.bind,
        listener=listener,
        keep_listener=True,
    )
    recovery = None
    if listener is not None:
        recovery = Recovery(peers, config.rank, secret, version, config.timeout, listener, build)
    return build(config.rank, peers, conns, recovery)


def _join(
    config: Config,
    settings: SocketsSettings,
    hint: list[Peer],
    listener: socket.socket | None,
    secret: bytes,
    version: str,
    build: Callable[[int, list[Peer], dict[int, Connection], Recovery | None], Backend],
) -> Backend:
    """A newcomer's world: wait until the job's ranks admit it (grow()), then connect to all."""
    from .connect import open_listener
    from .hostfile import Peer
    from .joining import connect_world, join
    from .recovery import Recovery

    slot = config.rank if config.rank is not None else -1
    if listener is None:  # the address of its hostfile entry, on a port of its own (the old one may be taken)
        me = hint[slot] if 0 <= slot < len(hint) else Peer(ip=settings.bind or "127.0.0.1", port=1)
        listener = open_listener(slot, me.model_copy(update={"port": 0}), settings.bind, len(hint) + 1)
    rank, peers, epoch = join(hint, slot, secret, version, config.timeout, listener)
    recovery = Recovery(peers, rank, secret, version, config.timeout, listener, build, epoch)
    return build(rank, peers, connect_world(recovery), recovery)


def _world(
    config: Config,
    settings: SocketsSettings,
    rank: int,
    size: int,
    conns: dict[int, Connection],
    local_key: bytes | None,
    start: int,
    recovery: Recovery | None,
    dialer: Dialer | None = None,
) -> Backend:
    """The world backend of ``rank`` of ``size`` over the authenticated ``conns`` (``dialer``:
    connects the other pairs when first needed)."""
    from .backend import SocketsBackend
    from .engine import Fabric

    fabric = Fabric(
        rank,
        size,
        {q: c.sock for q, c in conns.items()},
        config.timeout,
        keys={q: (c.send_key, c.recv_key) for q, c in conns.items()},
        payload_integrity=None if settings.integrity == "auto" else settings.integrity == "payload",
        direct={q for q, c in conns.items() if c.direct},
    )
    fabric.dialer = dialer
    recovered = dialer is None and recovery is not None and recovery.epoch > 0
    lost = [q for q in range(size) if q != rank and q not in conns] if recovered else []
    if lost:
        # a member that died after the survivors agreed (this rank saw it go before the
        # others decided without it): the world starts failed, naming it, and is shrunk again
        fabric.fail(
            PeerLostError(
                f"rank {rank}: rank {lost[0]} of this world was lost while the survivors formed it; "
                "shrink() this world too",
                peer=lost[0],
            )
        )
    world = SocketsBackend(
        fabric, list(range(size)), chunk_bytes=settings.chunk_kib * 1024, owner=True, seq_start=start
    )
    world.local_key = local_key
    world.recovery = recovery
    if size > 1:
        from .topology import choose_path

        piece = None if settings.shm_piece_kib is None else settings.shm_piece_kib * 1024
        try:
            world.path = choose_path(
                world,
                enabled=settings.shm,
                piece=piece,
                host_id=settings.host_id,
                job_id=os.environ.get("MESHCOMM_JOB_ID"),
                spin_us=settings.spin_us,
                seq_start=start,
                direct=settings.direct,
                native=settings.native,
            )
            world.sum_now = world.path.sum_now  # the core's compiled call path calls it first
        except DistributedError:
            if recovery is None or recovery.epoch == 0:
                raise  # at start-up the error is the answer
            # a member was lost while the survivors set up their world: it is returned failed
            # (its next operation raises, naming the rank), and they shrink it in turn
    return world


class SocketsLauncher:
    """How ``meshcomm launch`` starts a sockets job: a hostfile with a port per rank.

    Local ranks inherit a listening socket the launcher opened (so no two ranks, and no
    other process, can take the port in between); remote ranks get a free port probed
    on their host.
    """

    def rank_env(self, job: JobSpec) -> list[dict[str, str]]:
        entries, envs = [], []
        for place in job.places:
            port, fd = job.listen_socket(place)
            entries.append({"ip": place.ip, "port": port})
            env = {}
            if fd is not None:
                env["MESHCOMM_SOCKETS_LISTEN_FD"] = str(fd)
            else:  # ranks the launcher placed on different hosts never share memory
                env["MESHCOMM_HOST_ID"] = f"launch-host:{place.host}"
            envs.append(env)
        path = job.add_file("hostfile.json", json.dumps(entries, indent=1))
        for env in envs:
            env["MLX_HOSTFILE"] = path
        return envs

    def cleanup_command(self, job: JobSpec) -> str:
        """Run on every host when the job ends: shared memory of a rank that died during
        start-up (normally the names are removed as soon as every local rank opened them;
        each host's segment and FIFOs live in one private directory, hence -r)."""
        return f"rm -rf /dev/shm/meshcomm-{job.job_id}-*"


@hookimpl
def meshcomm_register_backends(register: BackendRegistrar) -> None:
    register(
        "sockets",
        factory=_factory,
        environment=_environment,
        settings=SocketsSettings,
        launcher=SocketsLauncher(),
        priority=10,
        description=f"TCP sockets and shared memory, NumPy only (the default); {loop_name()} loop",
    )


def loop_name() -> str:
    """Which shared-memory loop this installation runs: "compiled" when the wheel's extension
    (``meshcomm_sockets._shm``) is there, else "pure-Python" (a build without a compiler)."""
    return "compiled" if importlib.util.find_spec("meshcomm_sockets._shm") is not None else "pure-Python"
