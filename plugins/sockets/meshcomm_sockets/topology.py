"""Which ranks share a host, the shared-memory set-up, and the world group's path.

At start-up every rank all-gathers (over TCP) a 16-byte host key and whether it allows
shared memory. Ranks with equal keys form a local group; if any rank disallows shared
memory, or setting it up fails anywhere, every rank falls back to TCP, so all ranks always
agree on the path (:mod:`meshcomm_sockets.paths`) every operation takes: ``local`` (the
whole world on one host), ``hier`` (several hosts, some with several ranks) or ``tcp``
(one rank per host, or shared memory off).

A host whose ``/dev/shm`` cannot hold its segment (the host's first rank reserves it with
``posix_fallocate`` and sends the other local ranks an empty name) makes the whole job use
TCP, with one warning naming the size needed and the fix, rather than a SIGBUS later.
Every other reason to fall back to TCP is logged too: by the rank that hit it, and by
rank 0 for the job as a whole. The name and slot size the first rank sends are checked
(form, range; then owner, mode, type and size of the files) before anything is opened.
"""

from __future__ import annotations

import logging

import numpy as np
from meshcomm.plugin import crowded

from . import cma
from .backend import SocketsBackend
from .paths import HostsPath, LocalPath, Path, TcpPath
from .shm import SHM_DIR, ShmGroup, check_name, check_piece, host_key, new_name, remove_dir

log = logging.getLogger("meshcomm.sockets")

__all__ = ["choose_path"]

_NAME_BYTES = 64


def default_piece(local_ranks: int) -> int:
    """Slot size: small pieces keep data in cache; when ranks outnumber cores every piece
    costs context switches, so fewer, larger pieces win (measurement in docs/sockets.md)."""
    return (2048 if crowded(local_ranks) else 512) * 1024


#: the most a waiting rank polls (yielding) when its host has more ranks than cores: the
#: peers it waits for need those cores (measurements in docs/sockets.md)
CROWDED_SPIN_US = 2000


def wait_policy(local_ranks: int, spin_us: int) -> tuple[float, bool]:
    """(seconds to spin before sleeping, yield the core on every spin).

    Waking a sleeping process costs far more than finding a polling one ready (the
    measurement is in docs/benchmarks.md), so a waiting rank first polls for up to
    ``spin_us``; when this host has more ranks than cores it polls at most
    CROWDED_SPIN_US and hands its core to a runnable peer on every round
    (``sched_yield``), so the peer it waits for gets to run. Never longer: then it
    sleeps in the kernel."""
    busy = crowded(local_ranks)
    return (min(spin_us, CROWDED_SPIN_US) if busy else spin_us) / 1e6, busy


def choose_path(
    world: SocketsBackend,
    *,
    enabled: bool,
    piece: int | None,
    host_id: str | None,
    job_id: str | None,
    spin_us: int = 20000,
    seq_start: int = 0,
    direct: bool = True,
    native: bool = True,
) -> Path:
    """Decide how ranks wait and the path of the world's collectives; map the host's segment.

    Every frame of this exchange carries a payload tag whatever MESHCOMM_SOCKETS_INTEGRITY
    says (it steers the job: who shares memory, and which file to map)."""
    with world.fabric.sealed():
        return _choose(
            world,
            enabled=enabled,
            piece=piece,
            host_id=host_id,
            job_id=job_id,
            spin_us=spin_us,
            seq_start=seq_start,
            direct=direct,
            native=native,
        )


def _create(world: SocketsBackend, local: list[int], job_id: str | None, size: int, seq_start: int) -> ShmGroup:
    """The host's first rank: a new private directory with the segment (a fresh name if one
    happens to exist already)."""
    for attempt in range(3):
        try:
            return ShmGroup(world.fabric, local, new_name(job_id), size, create=True, seq_start=seq_start)
        except FileExistsError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _choose(
    world: SocketsBackend,
    *,
    enabled: bool,
    piece: int | None,
    host_id: str | None,
    job_id: str | None,
    spin_us: int,
    seq_start: int,
    direct: bool,
    native: bool,
) -> Path:
    tcp = TcpPath(world)
    n, r = world.size(), world.rank()
    mine = np.zeros(17, np.uint8)
    mine[:16] = np.frombuffer(host_key(host_id), np.uint8)
    mine[16] = 1 if enabled and SHM_DIR.is_dir() else 0
    flat = np.empty(17 * n, np.uint8)
    world.all_gather(mine, flat)
    table = flat.reshape(n, 17)
    keys = [bytes(row[:16]) for row in table]
    hosts: dict[bytes, list[int]] = {}
    for q, k in enumerate(keys):
        hosts.setdefault(k, []).append(q)
    local = hosts[keys[r]]
    world.fabric.set_waiting(*wait_policy(len(local), spin_us))
    if not table[:, 16].all():
        if enabled and r == 0:
            off = [q for q in range(n) if not table[q, 16]]
            log.warning(
                "meshcomm sockets rank 0: shared memory is off for this job (collectives use TCP): "
                "ranks %s have MESHCOMM_SOCKETS_SHM=0 or no /dev/shm",
                off,
            )
        return tcp
    if max(len(v) for v in hosts.values()) < 2:
        return tcp  # one rank per host: nothing to share
    shm: ShmGroup | None = None
    ok = np.ones(2, np.uint8)  # shared memory works here; this rank can read every local peer directly
    if direct:
        cma.allow_siblings()
    done = False
    try:
        if len(local) > 1:
            raw = np.zeros(_NAME_BYTES, np.uint8)
            if r == local[0]:
                try:
                    size = piece or default_piece(len(local))
                    shm = _create(world, local, job_id, size, seq_start)
                    text = f"{shm.dir.name} {size}".encode()
                    raw[: len(text)] = np.frombuffer(text, np.uint8)
                except OSError as exc:
                    ok[0] = 0  # peers get an empty name and give up too
                    log.warning("meshcomm sockets rank %d: %s", r, exc.strerror if exc.strerror else exc)
                for q in local[1:]:
                    world.send(raw, q)
            else:
                world.recv(raw, local[0])
                name, _, size_text = bytes(raw).rstrip(b"\0").decode("ascii", "replace").partition(" ")
                if name:
                    try:
                        shm = ShmGroup(
                            world.fabric,
                            local,
                            check_name(name, job_id),
                            check_piece(size_text),
                            create=False,
                            seq_start=seq_start,
                        )
                    except OSError as exc:
                        ok[0] = 0
                        log.warning(
                            "meshcomm sockets rank %d: cannot use the shared memory of rank %d: %s; using TCP",
                            r,
                            local[0],
                            exc.strerror if exc.strerror else exc,
                        )
                else:  # the host's first rank said why
                    ok[0] = 0
        world.barrier()  # every FIFO exists, every probe token is in the segment
        try:
            if shm is not None and ok[0]:
                shm.connect_fifos()
        except OSError as exc:
            ok[0] = 0
            log.warning(
                "meshcomm sockets rank %d: cannot open the local ranks' FIFOs: %s; using TCP",
                r,
                exc.strerror if exc.strerror else exc,
            )
        ok[1] = 1 if direct and shm is not None and ok[0] and shm.probe_direct() else 0
        abilities = np.empty(2 * n, np.uint8)  # per rank: shared memory works, can read every local peer
        world.all_gather(ok, abilities)
        flags, can_read = abilities[0::2], abilities[1::2]
        if shm is not None and r == local[0]:
            shm.unlink()  # every local rank opened everything (or gave up)
        world.barrier()
        done = True
    finally:
        if not done and shm is not None:  # set-up failed on this or another rank: leave nothing
            remove_dir(shm.dir)
            shm.close()
    if not flags.all():
        if shm is not None:
            shm.close()
        if r == 0:
            bad = [q for q in range(n) if not flags[q]]
            log.warning(
                "meshcomm sockets rank 0: shared memory is off for this job, collectives use TCP: "
                "ranks %s could not set it up (their warnings say why)",
                bad,
            )
        return tcp
    if shm is not None:
        shm.direct = bool(can_read[local].all())
        if native:
            shm.attach_native()
        if direct and not shm.direct and r == local[0]:
            log.info(
                "meshcomm sockets rank %d: local ranks %s cannot read each other's memory "
                "(process_vm_readv; see ptrace_scope): large collectives copy through shared memory",
                r,
                [q for q in local if not can_read[q]],
            )
    if len(hosts) == 1 and shm is not None:
        return LocalPath(world, shm)
    leaders = [v[0] for v in sorted(hosts.values())]
    leader_group = (
        SocketsBackend(
            world.fabric,
            leaders,
            group_id=0x4C454144,
            label="world/host-leaders",
            chunk_bytes=world.chunk_bytes,
            seq_start=seq_start,
        )
        if r in leaders
        else None
    )
    return HostsPath(world, shm, leader_group)
