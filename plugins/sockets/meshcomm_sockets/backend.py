"""``SocketsBackend``: the meshcomm protocol over the TCP mesh and the host's shared memory.

The backend numbers calls and sends point-to-point frames; its collectives run on the
:mod:`path <meshcomm_sockets.paths>` chosen when the world starts (TCP, shared memory, or
both in two levels). Subgroups made by ``split`` share the world's connections, always
over TCP; their frames carry their own group id.

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
from collections.abc import Callable

import numpy as np
from meshcomm.plugin import (
    UFUNCS,
    Backend,
    CommTimeoutError,
    DistributedError,
    NotSupportedError,
    PeerLostError,
    algorithms,
    dtype_code,
)

from . import wire
from .dialing import CONNECT_ALL_UP_TO
from .engine import Call, Fabric, Link, as_bytes
from .mesh import MeshGroup
from .paths import FRAME_BYTES, RING_MIN_BYTES, Path, TcpPath
from .recovery import Recovery
from .shm import DIRECT_REDUCE_MIN_BYTES, DIRECT_REDUCE_MIN_BYTES_TWO

__all__ = ["SocketsBackend", "RING_MIN_BYTES", "FRAME_BYTES"]

#: the operation code of each all-reduce ("sum" -> all_sum's)
_ALL_CODES = {op: wire.OP_CODES[f"all_{op}"] for op in UFUNCS}


class _Op:
    """``with backend._op(...) as call``: the backend's current call, cleared at the end
    (a reused object instead of a generator-based context manager: made once per group)."""

    __slots__ = ("backend", "outer")

    def __init__(self, backend: SocketsBackend, outer: bool) -> None:
        self.backend = backend
        self.outer = outer

    def __enter__(self) -> Call:
        return self.backend._call  # type: ignore[return-value]  # set by _op() just before

    def __exit__(self, *exc: object) -> None:
        if self.outer:
            self.backend._call = None


class SocketsBackend(MeshGroup):
    """One group (the world, or a split of it) over a shared :class:`Fabric` (its paths see
    it as a :class:`MeshGroup`)."""

    #: every collective's descriptor (op, dtype, count, root) is checked in-band on every rank
    checks_calls = True
    #: results go straight into the caller's ``out=`` (in place too: every path copies or
    #: reads its own input before it writes the same memory, and over TCP a block is only
    #: received after every send of it has left, because its final value depends on them)
    direct_out = True
    #: survivors of a failure agree and go on in a smaller world (:mod:`.recovery`)
    survives_failures = True
    #: the world's means of recovery (None on a split, and once handed to the next world)
    recovery: Recovery | None = None

    def __init__(
        self,
        fabric: Fabric,
        members: list[int],
        *,
        group_id: int = 0,
        label: str = "world",
        chunk_bytes: int = 4 << 20,
        owner: bool = False,
        seq_start: int = 0,
    ) -> None:
        self.fabric = fabric
        self.members = members
        self.gid = group_id
        self.label = label
        self.chunk_bytes = chunk_bytes
        self.timeout = fabric.timeout
        self._owner = owner
        self._rank = members.index(fabric.rank)
        self._seq_start = seq_start & wire.SEQ_MASK
        #: the number of this group's last collective (every rank numbers them alike)
        self.call_seq = self._seq_start
        self._sent: defaultdict[int, int] = defaultdict(lambda: self._seq_start)
        self._received: defaultdict[int, int] = defaultdict(lambda: self._seq_start)
        self._splits = 0
        self._call: Call | None = None
        self._outer, self._nested = _Op(self, True), _Op(self, False)
        #: how collectives travel: TCP; the world group's is chosen at start-up (topology.py)
        self.path: Path = TcpPath(self)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.members)

    def link(self, r: int) -> Link:
        """The TCP link to group rank ``r``."""
        return self.fabric.link_to(self.members[r])

    def _op(self, name: str, buf: np.ndarray, arg: int = 0) -> _Op:
        """The call ``name`` on ``buf`` (``arg``: its root) for the frames sent inside
        (``with self._op(...) as call``); a collective built from another is one call."""
        if self._call is not None:
            return self._nested
        self._call = self._new_call(wire.OP_CODES[name], buf, arg)
        return self._outer

    def _new_call(self, code: int, buf: np.ndarray, arg: int = 0) -> Call:
        """The next collective's call: operation ``code`` on ``buf``."""
        self.call_seq = seq = (self.call_seq + 1) & wire.SEQ_MASK  # wire.next_seq, inline: the latency path
        key = self.shape_key  # the core's, for this collective (0 for 1-D arrays)
        total = wire.call_total(buf.size, key) if key else buf.size
        return Call(self.gid, seq, code, dtype_code(buf.dtype), total, self.label, arg, self)

    def _p2p(self, counter: defaultdict[int, int], peer: int, buf: np.ndarray) -> Call:
        if self._call is not None:
            return self._call
        counter[peer] = wire.next_seq(counter[peer])
        return Call(
            self.gid, counter[peer], wire.OP_CODES["send"], dtype_code(buf.dtype), buf.size, self.label, 0, self
        )

    # -- point-to-point -------------------------------------------------------------------
    def send(self, buf: np.ndarray, dst: int) -> None:
        self.fabric.exchange(self.link(dst), self._p2p(self._sent, dst, buf), as_bytes(buf), None, None, FRAME_BYTES)

    def recv(self, buf: np.ndarray, src: int) -> None:
        self.fabric.exchange(
            self.link(src), None, None, self._p2p(self._received, src, buf), as_bytes(buf), FRAME_BYTES
        )

    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None:
        out, inc = self.link(dst), self.link(src)
        if out is inc:
            self.fabric.exchange(
                out,
                self._p2p(self._sent, dst, sendbuf),
                as_bytes(sendbuf),
                self._p2p(self._received, src, recvbuf),
                as_bytes(recvbuf),
                FRAME_BYTES,
            )
            return
        self.fabric.post_send(out, self._p2p(self._sent, dst, sendbuf), as_bytes(sendbuf), FRAME_BYTES)
        self.fabric.post_recv(inc, self._p2p(self._received, src, recvbuf), as_bytes(recvbuf), FRAME_BYTES)
        self.fabric.progress([out, inc])

    # -- collectives ----------------------------------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        # the latency path: what ``with self._op(...)`` does, without the context manager's calls
        call = self._call
        if call is not None:  # part of a collective built from this one
            self.path.all_reduce(call, sendbuf, recvbuf, op)
            return
        quick = self.path.quick_sum
        if quick is not None and op == "sum" and quick(self, sendbuf, recvbuf):
            return
        self._call = call = self._new_call(_ALL_CODES[op], sendbuf)
        try:
            self.path.all_reduce(call, sendbuf, recvbuf, op)
        finally:
            self._call = None

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        with self._op("sum_scatter", sendbuf) as call:
            self.path.reduce_scatter(call, sendbuf, recvbuf, op)

    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        with self._op("all_gather", sendbuf) as call:
            self.path.all_gather(call, sendbuf, recvbuf)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        with self._op("broadcast", buf, root) as call:
            self.path.broadcast(call, buf, root)

    def all_to_all(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        with self._op("all_to_all", sendbuf) as call:
            self.path.all_to_all(call, sendbuf, recvbuf)

    def gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> None:
        with self._op("gather", sendbuf, root) as call:
            self.path.gather(call, sendbuf, recvbuf, root)

    def scatter(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> None:
        with self._op("scatter", recvbuf, root) as call:  # recvbuf: the same size on every rank
            self.path.scatter(call, sendbuf, recvbuf, root)

    #: results in shared memory only pay on the direct path (shm.DIRECT_REDUCE_MIN_BYTES, and
    #: from DIRECT_REDUCE_MIN_BYTES_TWO on 2 local ranks)
    EMPTY_MIN_BYTES = min(DIRECT_REDUCE_MIN_BYTES, DIRECT_REDUCE_MIN_BYTES_TWO)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return self.path.empty(shape, dtype)

    def barrier(self) -> None:
        token = np.zeros(0, np.uint8)
        with self._op("barrier", token) as call:
            self.path.barrier(call)

    def split(self, color: int, key: int) -> Backend:
        pair = np.zeros(2, np.int64)
        with self._op("split", pair), self.fabric.sealed():  # membership steers the job: always tagged
            members = algorithms.split_members(self, color, key)
        self._splits += 1
        gid = zlib.crc32(f"{self.gid}/{self._splits}/{color}".encode()) & 0x7FFFFFFF or 1
        sub = SocketsBackend(
            self.fabric,
            [self.members[m] for m in members],
            group_id=gid,
            label=f"{self.label}/split{self._splits}(color={color})",
            chunk_bytes=self.chunk_bytes,
            seq_start=self._seq_start,
        )
        sub.local_key = self.local_key
        return sub

    # -- survivors continue ---------------------------------------------------------------
    def _recovery(self, what: str) -> Recovery:
        dialer = self.fabric.dialer
        if dialer is not None and what == "grow":
            raise NotSupportedError(
                f"rank {self.fabric.rank}: grow() needs newcomers to reach the world's listeners, which this job "
                "keeps for connections between its ranks: it connects ranks only when needed "
                f"(MESHCOMM_SOCKETS_CONNECT=needed, the default above {CONNECT_ALL_UP_TO} ranks). Set "
                "MESHCOMM_SOCKETS_CONNECT=all on every rank to let newcomers join."
            )
        if self.recovery is None:
            raise NotSupportedError(
                f"rank {self.fabric.rank}: {what} works on the world group (split {self.label!r} cannot); "
                f"call it on the world, then split the new world again"
                if not self._owner
                else f"rank {self.fabric.rank}: {what}: this world was already replaced by shrink(); use the new one"
            )
        failure = self.fabric.failure or self.fabric.pending_abort()
        # named by a peer's timeout while this process itself did not run (stopped, starved): the
        # others went on without it (named without that, it may only be blamed for a third
        # rank's silence: the agreement finds out)
        stalled = self.fabric.stalled()
        if isinstance(failure, CommTimeoutError) and failure.peer == self.fabric.rank and stalled:
            raise CommTimeoutError(
                f"rank {self.fabric.rank}: {what}: the other ranks gave up on this rank earlier ({failure}); "
                "they went on without it",
                peer=self.fabric.rank,
            )
        if dialer is not None:  # the survivors' agreement connects them all through the listener
            dialer.pause()
            self.fabric.adopt()
        return self.recovery

    def _suspects(self) -> set[int]:
        """Ranks this world stopped hearing from (a timeout names one): the agreement waits
        for them only briefly (recovery.SUSPECT_GRACE), not MLX_TIMEOUT again."""
        failure = self.fabric.failure
        if isinstance(failure, CommTimeoutError) and failure.peer is not None and failure.peer != self.fabric.rank:
            return {failure.peer}
        return set()

    def agree(self, flag: int) -> tuple[int, frozenset[int]]:
        recovery = self._recovery("agree")
        try:
            agreed = recovery.agree(flag, self._suspects())
        finally:
            if self.fabric.dialer is not None:  # this world goes on: answer first contacts again
                self.fabric.dialer.resume()
        if agreed.lost and self.fabric.failure is None:  # the agreement gave up on them: so does the world
            first = min(agreed.lost)
            self.fabric.failure = PeerLostError(
                f"rank {self.fabric.rank}: the survivors agreed that ranks {sorted(agreed.lost)} are lost; "
                "shrink() the world to go on without them",
                peer=first,
            )
        return agreed.flag, agreed.lost

    def shrink(self) -> Backend:
        recovery = self._recovery("shrink")
        suspects = self._suspects()
        return self._hand_over(recovery, lambda: recovery.next_world(suspects))

    def grow(self) -> Backend | None:
        from .joining import admit_waiting, announce, connect_world, share

        recovery = self._recovery("grow")
        self.fabric.check()  # a world that failed shrinks first
        joiners = admit_waiting(recovery) if self.rank() == 0 else []
        try:
            newcomers = share(self, joiners)
        except BaseException:
            for j in joiners:
                j.conn.sock.close()
            raise
        if not newcomers:
            return None
        nxt = recovery.next([*recovery.peers, *newcomers], self.rank())
        if joiners:
            announce(joiners, nxt)
        return self._hand_over(recovery, lambda: recovery.build(nxt.rank, nxt.peers, connect_world(nxt), nxt))

    def _hand_over(self, recovery: Recovery, make: Callable[[], object]) -> Backend:
        """The next world ``make()`` builds on this world's listener; this one is retired either
        way (and the listener closed when no next world came of it)."""
        self.recovery = None  # the listener goes on with the next world
        self.fabric.dialer = None  # (paused in _recovery: it must not close the listener)
        try:
            return make()  # type: ignore[return-value]
        except BaseException:
            recovery.close()
            raise
        finally:
            self._retire()

    @property
    def epoch(self) -> int:  # type: ignore[override]
        """How many times this job's world was rebuilt (shrink, grow) before this one."""
        return self.recovery.epoch if self.recovery is not None else 0

    def _retire(self) -> None:
        """Drop this world's connections and memory without telling anyone (its survivors
        are in the next world; the lost ones are gone)."""
        if self.fabric.failure is None:
            self.fabric.failure = DistributedError(
                f"rank {self.fabric.rank}: this world was replaced by shrink(); use the world it returned"
            )
        self.path.close()
        for link in self.fabric.links.values():
            try:
                link.sock.close()
            except OSError:
                pass
        self.fabric.links.clear()

    def abort(self, code: int, reason: str) -> None:
        """This rank's program failed (``reason``, exit ``code``): tell every peer with an
        ABORT frame, so each raises PeerLostError naming this rank instead of waiting (or
        blaming whichever rank it happens to read from first). Does nothing when an earlier
        failure was already reported (that one names the rank that failed first)."""
        if self.fabric.dialer is not None:
            self.fabric.dialer.close()
        if self.recovery is not None:  # survivors that try to reach this rank learn at once that it is gone
            self.recovery.close()
        self.fabric.abort(code, reason)

    def close(self) -> None:
        if self._owner:
            if self.recovery is not None:
                self.recovery.close()
            self.path.close()
            self.fabric.close()
