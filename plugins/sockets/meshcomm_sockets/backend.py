"""``SocketsBackend``: the meshcomm protocol over the TCP mesh, with a pipelined ring.

Small reductions use recursive doubling (latency); large ones a ring reduce-scatter +
all-gather in chunks, where each chunk is reduced as soon as it arrives and forwarded at
once, so sending, receiving and reducing overlap. Subgroups made by ``split`` share the
world's connections; their frames carry their own group id.

Every frame (and every shared-memory piece) carries the call's descriptor: operation,
dtype, element count, sequence number and root. Each collective makes every rank depend,
directly or through others, on every other rank's frames, so ranks that disagree on any
of these get :class:`CollectiveMismatchError` on every rank (the core's own cross-rank
check is therefore not needed: ``checks_calls = True``). A broadcast alone lets the root
finish without hearing from anyone, so over TCP it first exchanges descriptors
(header-only frames, a dissemination pattern).
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from meshcomm import algorithms
from meshcomm.backend import Backend
from meshcomm.dtypes import dtype_code, reducer

from . import wire
from .engine import Call, Fabric, Link, as_bytes
from .shm import ShmGroup

__all__ = ["SocketsBackend", "RING_MIN_BYTES", "FRAME_BYTES"]

#: reductions up to this size use recursive doubling, larger ones the ring
RING_MIN_BYTES = 256 * 1024
#: largest frame of a plain transfer (the header's size field is 32 bits)
FRAME_BYTES = 1 << 26


class SocketsBackend(Backend):
    """One group (the world, or a split of it) over a shared :class:`Fabric`."""

    #: every collective's descriptor (op, dtype, count, root) is checked in-band on every rank
    checks_calls = True

    def __init__(self, fabric: Fabric, members: list[int], *, group_id: int = 0, label: str = "world",
                 chunk_bytes: int = 256 * 1024, owner: bool = False, seq_start: int = 0) -> None:
        self.fabric = fabric
        self.members = members
        self.gid = group_id
        self.label = label
        self.chunk_bytes = chunk_bytes
        self.timeout = fabric.timeout
        self._owner = owner
        self._rank = members.index(fabric.rank)
        self._seq_start = seq_start & wire.SEQ_MASK
        self._seq = self._seq_start
        self._sent: defaultdict[int, int] = defaultdict(lambda: self._seq_start)
        self._received: defaultdict[int, int] = defaultdict(lambda: self._seq_start)
        self._splits = 0
        self._call: Call | None = None
        #: shared memory of this host's ranks (world group only), see topology.py
        self.shm: ShmGroup | None = None
        self.shm_mode = "tcp"
        self.leader_backend: SocketsBackend | None = None

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.members)

    def _link(self, r: int) -> Link:
        return self.fabric.links[self.members[r]]

    @contextmanager
    def _op(self, name: str, buf: np.ndarray, arg: int = 0) -> Iterator[Call]:
        """The call ``name`` on ``buf`` (``arg``: its root) for the frames sent inside."""
        if self._call is not None:  # nested (a collective built from another): one call
            yield self._call
            return
        self._seq = wire.next_seq(self._seq)
        self._call = Call(self.gid, self._seq, wire.OP_CODES[name], dtype_code(buf.dtype), buf.size, self.label,
                          arg)
        try:
            yield self._call
        finally:
            self._call = None

    def _p2p(self, counter: defaultdict[int, int], peer: int, buf: np.ndarray) -> Call:
        if self._call is not None:
            return self._call
        counter[peer] = wire.next_seq(counter[peer])
        return Call(self.gid, counter[peer], wire.OP_CODES["send"], dtype_code(buf.dtype), buf.size, self.label)

    # -- point-to-point -------------------------------------------------------------------
    def send(self, buf: np.ndarray, dst: int) -> None:
        link = self._link(dst)
        self.fabric.post_send(link, self._p2p(self._sent, dst, buf), as_bytes(buf), FRAME_BYTES)
        self.fabric.progress([link])

    def recv(self, buf: np.ndarray, src: int) -> None:
        link = self._link(src)
        self.fabric.post_recv(link, self._p2p(self._received, src, buf), as_bytes(buf), FRAME_BYTES)
        self.fabric.progress([link])

    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None:
        out, inc = self._link(dst), self._link(src)
        self.fabric.post_send(out, self._p2p(self._sent, dst, sendbuf), as_bytes(sendbuf), FRAME_BYTES)
        self.fabric.post_recv(inc, self._p2p(self._received, src, recvbuf), as_bytes(recvbuf), FRAME_BYTES)
        self.fabric.progress([out] if out is inc else [out, inc])

    # -- collectives ----------------------------------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        with self._op(f"all_{op}", sendbuf) as call:
            if self.shm_mode == "local" and self.shm is not None:
                self.shm.all_reduce(call, sendbuf, recvbuf, op)
                return
            if self.shm_mode == "hier":
                self._hierarchical_all_reduce(call, sendbuf, recvbuf, op)
                return
            n = self.size()
            if sendbuf.nbytes <= RING_MIN_BYTES or sendbuf.size < n * 2:
                recvbuf[...] = sendbuf
                algorithms.recursive_doubling(self, recvbuf, op)
            else:
                self._ring(sendbuf, recvbuf, op, offset=0, gather=True)

    def _hierarchical_all_reduce(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """Reduce within the host (shared memory), across hosts (TCP between the hosts'
        first ranks), then hand the result to the host's other ranks (shared memory)."""
        if self.shm is not None:
            self.shm.all_reduce(call, sendbuf, recvbuf, op)
        else:
            recvbuf[...] = sendbuf
        if self.leader_backend is not None:
            self.leader_backend.all_reduce(recvbuf.copy(), recvbuf, op)
        if self.shm is not None:
            self.shm.broadcast(call, recvbuf, 0)

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        with self._op("sum_scatter", sendbuf) as call:
            if self.shm_mode == "local" and self.shm is not None:
                self.shm.reduce_scatter(call, sendbuf, recvbuf, op)
                return
            n, r, m = self.size(), self.rank(), recvbuf.size
            if sendbuf.nbytes <= RING_MIN_BYTES:
                full = np.empty_like(sendbuf)
                full[...] = sendbuf
                algorithms.recursive_doubling(self, full, op)
                recvbuf[...] = full[r * m : (r + 1) * m]
                return
            work = np.empty_like(sendbuf)
            self._ring(sendbuf, work, op, offset=-1, gather=False, bounds=[i * m for i in range(n + 1)])
            recvbuf[...] = work[r * m : (r + 1) * m]

    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        with self._op("all_gather", sendbuf) as call:
            if self.shm_mode == "local" and self.shm is not None:
                self.shm.all_gather(call, sendbuf, recvbuf)
            else:
                algorithms.all_gather(self, sendbuf, recvbuf)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        with self._op("broadcast", buf, root) as call:
            if self.shm_mode == "local" and self.shm is not None:
                self.shm.broadcast(call, buf, root)  # every piece compares every descriptor
            else:
                self._agree()
                algorithms.broadcast(self, buf, root)

    def _agree(self) -> None:
        """Exchange the current call's descriptor with every rank (header-only frames in a
        dissemination pattern: after round k a rank has, directly or through others, checked
        2**(k+1) ranks), so a rank that would otherwise only send (a broadcast's root) still
        learns when another rank called something else."""
        none = np.zeros(0, np.uint8)
        n, r = self.size(), self.rank()
        dist = 1
        while dist < n:
            self.sendrecv(none, (r + dist) % n, none, (r - dist) % n)
            dist <<= 1

    def barrier(self) -> None:
        token = np.zeros(0, np.uint8)
        with self._op("barrier", token) as call:
            if self.shm_mode == "local" and self.shm is not None:
                self.shm.barrier(call)
            else:
                algorithms.barrier(self)

    def split(self, color: int, key: int) -> Backend:
        pair = np.zeros(2, np.int64)
        with self._op("split", pair), self.fabric.sealed():  # membership steers the job: always tagged
            members = algorithms.split_members(self, color, key)
        self._splits += 1
        gid = zlib.crc32(f"{self.gid}/{self._splits}/{color}".encode()) & 0x7FFFFFFF or 1
        return SocketsBackend(self.fabric, [self.members[m] for m in members], group_id=gid,
                              label=f"{self.label}/split{self._splits}(color={color})",
                              chunk_bytes=self.chunk_bytes, seq_start=self._seq_start)

    def abort(self, code: int, reason: str) -> None:
        """This rank's program failed (``reason``, exit ``code``): tell every peer with an
        ABORT frame, so each raises PeerLostError naming this rank instead of waiting (or
        blaming whichever rank it happens to read from first). Does nothing when an earlier
        failure was already reported (that one names the rank that failed first)."""
        self.fabric.abort(code, reason)

    def close(self) -> None:
        if self._owner:
            if self.shm is not None:
                self.shm.close()
            self.fabric.close()

    # -- the pipelined ring ---------------------------------------------------------------
    def _ring(self, sendbuf: np.ndarray, out: np.ndarray, op: str, *, offset: int, gather: bool,
              bounds: list[int] | None = None) -> None:
        """Ring reduce-scatter (and all-gather) of ``sendbuf`` into ``out``, chunk by chunk.

        Reduce-scatter step s sends block (r+offset-s) and receives block (r+offset-s-1);
        a received chunk is reduced with this rank's own chunk into ``out`` and forwarded
        to the right at once. After n-1 steps rank r owns block (r+1+offset), which the
        all-gather steps pass around the ring. Each result element is computed on one rank
        only, so every rank ends with the same bytes.
        """
        call = self._call
        if call is None:  # pragma: no cover - _ring is only reached inside _op
            raise RuntimeError("_ring called outside an operation")
        fab = self.fabric
        f = reducer(op)
        n, r = self.size(), self.rank()
        bounds = bounds or algorithms.block_bounds(sendbuf.size, n)
        right, left = self._link((r + 1) % n), self._link((r - 1) % n)
        ce = max(1, self.chunk_bytes // sendbuf.itemsize)
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
                fab.post_recv(left, call, tmpb[: (hi - lo) * item], FRAME_BYTES,
                              done=lambda s=step, a=lo, b=hi: reduced(s, a, b))
        if gather:
            for step in range(n - 1):
                d = (r + offset - step) % n
                for lo in chunks(d):
                    hi = min(lo + ce, bounds[d + 1])
                    cb = (lambda a=lo, b=hi: forward(a, b)) if step < n - 2 else None
                    fab.post_recv(left, call, out_raw[lo * item : hi * item], FRAME_BYTES, done=cb)
        fab.progress([right] if right is left else [right, left])
