"""The route a group's collectives take, chosen once when the world starts (topology.py).

* :class:`TcpPath`: every operation over the TCP mesh (recursive doubling for small
  reductions, the pipelined ring for large ones, the generic algorithms otherwise);
* :class:`LocalPath`: the whole world is on one host: every collective goes through the
  host's shared memory (:class:`~meshcomm_sockets.shm.ShmGroup`);
* :class:`HostsPath`: several hosts, some with several ranks: all-reduce is reduced within
  each host in shared memory, across hosts over TCP between one leader per host, then
  handed back within each host; the other operations use TCP.

Each path takes the call's descriptor (:class:`~meshcomm_sockets.engine.Call`) and
contiguous 1-D buffers, so each can be tuned and tested on its own; the backend only
numbers calls and picks nothing per operation. A path knows its group only as a
:class:`~meshcomm_sockets.mesh.MeshGroup` (the backend imports this module, never the
reverse).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from meshcomm.plugin import Backend, algorithms, reducer

from . import wire
from .engine import Call, as_bytes
from .mesh import MeshGroup

if TYPE_CHECKING:
    from .shm import ShmGroup

__all__ = ["Path", "TcpPath", "LocalPath", "HostsPath", "RING_MIN_BYTES", "FRAME_BYTES"]

#: reductions up to this size use recursive doubling, larger ones the ring
RING_MIN_BYTES = 256 * 1024
#: largest frame of a plain transfer (the header's size field is 32 bits)
FRAME_BYTES = 1 << 26
#: ``ShmGroup.quick_sum``: (backend, sendbuf, recvbuf) -> done
QuickSum = Callable[[Any, np.ndarray, np.ndarray], bool]
#: the backend's ``sum_now`` (``Backend.sum_now``): (sendbuf, recvbuf) -> done
SumNow = Callable[[np.ndarray, np.ndarray], bool]


class Path(Protocol):
    """How one group runs its collectives (``call``: the descriptor every rank agrees on)."""

    #: ``tcp``, ``local`` or ``hier``
    name: str
    #: the all_sum of a small call without a :class:`Call` object, or None on paths without one
    quick_sum: QuickSum | None
    #: that all_sum bound to the path's group: its backend's ``sum_now``
    sum_now: SumNow | None

    def all_reduce(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None: ...
    def reduce_scatter(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None: ...
    def all_gather(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None: ...
    def broadcast(self, call: Call, buf: np.ndarray, root: int) -> None: ...
    def all_to_all(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None: ...
    def gather(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> None: ...
    def scatter(self, call: Call, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> None: ...
    def barrier(self, call: Call) -> None: ...
    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray: ...
    def close(self) -> None: ...


class TcpPath:
    """Every collective of ``group`` over its TCP links."""

    name = "tcp"
    quick_sum: QuickSum | None = None
    sum_now: SumNow | None = None

    def __init__(self, group: MeshGroup) -> None:
        self.group = group

    def all_reduce(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        g = self.group
        if sendbuf.nbytes <= RING_MIN_BYTES or sendbuf.size < g.size() * 2:
            recvbuf[...] = sendbuf
            algorithms.recursive_doubling(g, recvbuf, op)
        else:
            self._ring(call, sendbuf, recvbuf, op, offset=0, gather=True)

    def reduce_scatter(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        g = self.group
        n, r, m = g.size(), g.rank(), recvbuf.size
        if sendbuf.nbytes <= RING_MIN_BYTES:  # latency first: the all-reduce's doubling, then my block
            algorithms.reduce_scatter_by_all_reduce(
                g, sendbuf, recvbuf, op, lambda s, d, o: self.all_reduce(call, s, d, o)
            )
            return
        work = np.empty_like(sendbuf)
        self._ring(call, sendbuf, work, op, offset=-1, gather=False, bounds=[i * m for i in range(n + 1)])
        recvbuf[...] = work[r * m : (r + 1) * m]

    def all_gather(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        algorithms.all_gather(self.group, sendbuf, recvbuf)

    def broadcast(self, call: Call, buf: np.ndarray, root: int) -> None:
        self._agree()
        algorithms.broadcast(self.group, buf, root)

    def all_to_all(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        algorithms.all_to_all(self.group, sendbuf, recvbuf)  # every rank hears from every other

    def gather(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> None:
        self._agree()  # the ranks that only send learn of a root that called something else
        algorithms.gather(self.group, sendbuf, recvbuf, root)

    def scatter(self, call: Call, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> None:
        self._agree()  # the root only sends
        algorithms.scatter(self.group, sendbuf, recvbuf, root)

    def barrier(self, call: Call) -> None:
        algorithms.barrier(self.group)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A result array (see Backend.empty): an ordinary one."""
        return np.empty(shape, dtype)

    def close(self) -> None:
        pass

    def _agree(self) -> None:
        """Exchange the current call's descriptor with every rank: a dissemination barrier
        inside the call, whose frames carry its descriptor (after round k a rank has,
        directly or through others, checked 2**(k+1) ranks), so a rank that would otherwise
        only send (a broadcast's or scatter's root) still learns when another rank called
        something else."""
        algorithms.barrier(self.group)

    def _ring(
        self,
        call: Call,
        sendbuf: np.ndarray,
        out: np.ndarray,
        op: str,
        *,
        offset: int,
        gather: bool,
        bounds: list[int] | None = None,
    ) -> None:
        """Ring reduce-scatter (and all-gather) of ``sendbuf`` into ``out``, chunk by chunk.

        Reduce-scatter step s sends block (r+offset-s) and receives block (r+offset-s-1);
        a received chunk is reduced with this rank's own chunk into ``out`` and forwarded
        to the right at once, so sending, receiving and reducing overlap. After n-1 steps
        rank r owns block (r+1+offset), which the all-gather steps pass around the ring.
        Each result element is computed on one rank only, so every rank ends with the same
        bytes.
        """
        g = self.group
        fab = g.fabric
        f = reducer(op)
        n, r = g.size(), g.rank()
        bounds = bounds or algorithms.block_bounds(sendbuf.size, n)
        right, left = g.link((r + 1) % n), g.link((r - 1) % n)
        ce = max(1, g.chunk_bytes // sendbuf.itemsize)
        tmp = np.empty(min(ce, max(bounds[i + 1] - bounds[i] for i in range(n))), sendbuf.dtype)
        tmpb = as_bytes(tmp)
        item = sendbuf.itemsize
        send_raw = as_bytes(sendbuf)
        out_raw = as_bytes(out)
        last_rs = n - 2

        def chunks(block: int) -> range:
            return range(bounds[block], bounds[block + 1], ce)

        def forward(lo: int, hi: int) -> None:
            fab.post_send(right, call, out_raw[lo * item : hi * item], FRAME_BYTES)

        def reduced(step: int, lo: int, hi: int) -> None:
            region = out[lo:hi]
            f(tmp[: hi - lo], sendbuf[lo:hi], out=region)
            if step < last_rs or gather:
                forward(lo, hi)

        first = (r + offset) % n
        for lo in chunks(first):
            hi = min(lo + ce, bounds[first + 1])
            fab.post_send(right, call, send_raw[lo * item : hi * item], FRAME_BYTES)
        for step in range(n - 1):
            d = (r + offset - step - 1) % n
            for lo in chunks(d):
                hi = min(lo + ce, bounds[d + 1])
                fab.post_recv(
                    left, call, tmpb[: (hi - lo) * item], FRAME_BYTES, done=functools.partial(reduced, step, lo, hi)
                )
        if gather:
            for step in range(n - 1):
                d = (r + offset - step) % n
                for lo in chunks(d):
                    hi = min(lo + ce, bounds[d + 1])
                    cb = (lambda a=lo, b=hi: forward(a, b)) if step < n - 2 else None
                    fab.post_recv(left, call, out_raw[lo * item : hi * item], FRAME_BYTES, done=cb)
        fab.progress([right] if right is left else [right, left])


class LocalPath(TcpPath):
    """Every collective through the shared memory of the one host all ranks are on (large
    all-to-all, gather and scatter too when ranks read each other's arrays directly; small
    ones over TCP)."""

    name = "local"

    def __init__(self, group: MeshGroup, shm: ShmGroup) -> None:
        super().__init__(group)
        self.shm = shm
        # only with the C channel (attached before the path is made): without it every
        # small all_sum would ask quick_sum twice for nothing (3-4 % of a pure-Python call)
        self.quick_sum = shm.quick_sum if shm.native is not None else None
        self.sum_now = shm.sum_entry(group)

    def all_to_all(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        if self.shm.is_direct(sendbuf.nbytes):
            self.shm.all_to_all(call, sendbuf, recvbuf)
        else:
            super().all_to_all(call, sendbuf, recvbuf)

    def gather(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> None:
        if self.shm.is_direct(sendbuf.nbytes):
            self.shm.gather(call, sendbuf, recvbuf, root)
        else:
            super().gather(call, sendbuf, recvbuf, root)

    def scatter(self, call: Call, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> None:
        if self.shm.is_direct(recvbuf.nbytes * self.shm.n):
            self.shm.scatter(call, sendbuf, recvbuf, root)
        else:
            super().scatter(call, sendbuf, recvbuf, root)

    def all_reduce(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        self.shm.all_reduce(call, sendbuf, recvbuf, op)

    def reduce_scatter(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        self.shm.reduce_scatter(call, sendbuf, recvbuf, op)

    def all_gather(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        self.shm.all_gather(call, sendbuf, recvbuf)

    def broadcast(self, call: Call, buf: np.ndarray, root: int) -> None:
        self.shm.broadcast(call, buf, root)  # every piece compares every descriptor

    def barrier(self, call: Call) -> None:
        self.shm.barrier(call)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return self.shm.empty(shape, dtype)

    def close(self) -> None:
        self.shm.close()


class HostsPath(TcpPath):
    """All-reduce in two levels (shared memory within a host, TCP between the hosts' first
    ranks); the other collectives over TCP. ``shm`` is None on a host with one rank;
    ``leaders`` (the group of the hosts' first ranks) is None on every other rank."""

    name = "hier"

    def __init__(self, group: MeshGroup, shm: ShmGroup | None, leaders: Backend | None) -> None:
        super().__init__(group)
        self.shm = shm
        self.leaders = leaders

    def all_reduce(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """Reduce within the host (shared memory), across hosts (TCP between the hosts'
        first ranks), then hand the result to the host's other ranks (shared memory)."""
        if self.shm is not None:
            self.shm.all_reduce(call, sendbuf, recvbuf, op)
        else:
            recvbuf[...] = sendbuf
        if self.leaders is not None:
            leaders = self.leaders
            leaders.shape_key = call.total >> wire.SHAPE_SHIFT  # the leaders' call has the same shape
            if call.owner is not None:  # and is the same user call
                leaders.user_op, leaders.user_no, leaders.user_step = (
                    call.owner.user_op,
                    call.owner.user_no,
                    call.owner.user_step,
                )
            self.leaders.all_reduce(recvbuf.copy(), recvbuf, op)
        if self.shm is not None:
            self.shm.broadcast(call, recvbuf, 0)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
