"""Which ranks share a host, and the shared-memory setup of the world group.

At start-up every rank all-gathers (over TCP) a 16-byte host key and whether it allows
shared memory. Ranks with equal keys form a local group; if any rank disallows shared
memory, or setting it up fails anywhere, every rank falls back to TCP, so all ranks always
agree on the path each operation takes:

* ``local``: the whole world is on one host: collectives go through shared memory;
* ``hier``: several hosts, some with several ranks: all-reduce is reduced within each
  host in shared memory, across hosts over TCP between one leader per host, then handed
  back within each host; other operations use TCP;
* ``tcp``: one rank per host, or shared memory off.

A host whose ``/dev/shm`` cannot hold its segment (the host's first rank reserves it with
``posix_fallocate`` and sends the other local ranks an empty name) makes the whole job use
TCP, with one warning naming the size needed and the fix, rather than a SIGBUS later.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from .shm import SHM_DIR, ShmGroup, host_key, new_name

log = logging.getLogger("meshcomm.sockets")

__all__ = ["attach_shared_memory"]

_NAME_BYTES = 64


def default_piece(local_ranks: int) -> int:
    """Slot size: small pieces keep data in cache; when ranks outnumber cores every piece
    costs context switches, so fewer, larger pieces win (measured: 64 MiB all-reduce on 4
    ranks / 2 cores took 160 ms with 512 KiB pieces, 75 ms with 2 MiB)."""
    return (2048 if local_ranks > (os.cpu_count() or 1) else 512) * 1024


def wait_policy(local_ranks: int, spin_us: int) -> tuple[float, bool]:
    """(seconds to spin before sleeping, yield the core on every spin).

    Waking a sleeping process costs about 47 µs here against 4 µs for one that polls, so a
    waiting rank first polls for up to ``spin_us``; when this host has more ranks than
    cores it also hands its core to a runnable peer on every round (``sched_yield``), so
    the peer it waits for gets to run. Never longer: then it sleeps in the kernel."""
    return spin_us / 1e6, local_ranks > (os.cpu_count() or 1)


def attach_shared_memory(world, *, enabled: bool, piece: int | None, host_id: str | None,  # noqa: ANN001
                         job_id: str | None, spin_us: int = 200, seq_start: int = 0) -> None:
    """Decide how ranks wait and the path of the world's collectives; map the host's segment."""
    from .backend import SocketsBackend

    n, r = world.size(), world.rank()
    mine = np.zeros(17, np.uint8)
    mine[:16] = np.frombuffer(host_key(host_id), np.uint8)
    mine[16] = 1 if enabled and SHM_DIR.is_dir() else 0
    table = np.empty(17 * n, np.uint8)
    world.all_gather(mine, table)
    table = table.reshape(n, 17)
    keys = [bytes(row[:16]) for row in table]
    hosts: dict[bytes, list[int]] = {}
    for q, k in enumerate(keys):
        hosts.setdefault(k, []).append(q)
    local = hosts[keys[r]]
    world.fabric.spin, world.fabric.yielding = wait_policy(len(local), spin_us)
    if not table[:, 16].all():
        return
    if max(len(v) for v in hosts.values()) < 2:
        return  # one rank per host: nothing to share
    shm: ShmGroup | None = None
    ok = np.ones(1, np.uint8)
    name = ""
    if len(local) > 1:
        raw = np.zeros(_NAME_BYTES, np.uint8)
        if r == local[0]:
            try:
                name = new_name(job_id)
                size = piece or default_piece(len(local))
                shm = ShmGroup(world.fabric, local, name, size, create=True, seq_start=seq_start)
                text = f"{name} {size}".encode()
                raw[: len(text)] = np.frombuffer(text, np.uint8)
            except OSError as exc:
                ok[0] = 0  # peers get an empty name and give up too
                log.warning("meshcomm sockets rank %d: %s", r, exc.strerror if exc.strerror else exc)
            for q in local[1:]:
                world.send(raw, q)
        else:
            world.recv(raw, local[0])
            name, _, size_text = bytes(raw).rstrip(b"\0").decode().partition(" ")
            try:
                if not name:
                    raise OSError("the host's first rank could not create the segment")
                shm = ShmGroup(world.fabric, local, name, int(size_text), create=False, seq_start=seq_start)
            except OSError:
                ok[0] = 0
    world.barrier()  # every FIFO exists
    try:
        if shm is not None and ok[0]:
            shm.connect_fifos(name)
    except OSError:
        ok[0] = 0
    flags = np.empty(n, np.uint8)
    world.all_gather(ok, flags)
    if shm is not None:
        shm.unlink(leader=(r == local[0]))
    world.barrier()
    if not flags.all():
        if shm is not None:
            shm.close()
        return
    world.shm = shm
    if len(hosts) == 1:
        world.shm_mode = "local"
        return
    world.shm_mode = "hier"
    leaders = [v[0] for v in sorted(hosts.values())]
    world.leader_backend = (
        SocketsBackend(world.fabric, leaders, group_id=0x4C454144, label="world/host-leaders",
                       chunk_bytes=world.chunk_bytes, seq_start=seq_start)
        if r in leaders else None
    )


