"""``MPIBackend``: meshcomm's Backend protocol on an MPI communicator.

Every operation is one native non-blocking MPI call on the caller's NumPy buffers
(zero-copy, never pickled): Iallreduce, Iallgather, Ireduce_scatter_block, Ibcast,
Isend/Irecv, Ibarrier, and Comm.Split for ``split``. The request is tested once; if it
has not completed, :meth:`meshcomm_mpi.control.Control.wait` completes it under
``timeout`` while listening for failure notices from peers, so that a peer that fails,
exits, stops or calls something else makes this rank raise a DistributedError naming
it instead of waiting for ever (docs/backends/mpi.md, "Failure behaviour").

The backend works on its own duplicate of ``MPI.COMM_WORLD`` (meshcomm's messages never
match a user's own mpi4py messages) with the ``ERRORS_RETURN`` error handler, so MPI
errors become :class:`meshcomm.DistributedError` instead of aborting the job.
Point-to-point tags carry the message's dtype and count (:mod:`meshcomm_mpi.tags`), so a
send met by a recv of another dtype or size is a CollectiveMismatchError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from meshcomm.plugin import (
    DEFAULT_TIMEOUT,
    Backend,
    CallsDiffer,
    CollectiveMismatchError,
    DistributedError,
    NotSupportedError,
    in_place,
    split_plan,
)
from mpi4py import MPI

from . import survivors
from .algorithms import AllreduceStarter, ring_threshold
from .compiled import Carried, compiled_entries
from .control import Control
from .errors import mpi_error
from .ops import Counts
from .reduce_ops import OpTable
from .tags import TagCodec

__all__ = ["MPIBackend"]

_REDUCE_NAMES = {"sum": "all_sum", "max": "all_max", "min": "all_min"}
_ANY_TAG = MPI.ANY_TAG
_ALL_GATHER, _BARRIER = ("coll", "all_gather"), ("coll", "barrier")
_INT64, _MAX = MPI.INT64_T, MPI.MAX
#: all-reduces up to this many bytes (below 64 KiB) run as persistent operations (one per
#: dtype, op and count, made after its first call): a start costs less than a new Iallreduce
#: (Open MPI, 2 ranks: 0.9 against 1.9 µs at 8 B) and skips the per-call choice of algorithm
#: (meshcomm_mpi.algorithms); through meshcomm, 2 ranks, 4-32 KiB: 11-23 us against 21-31 us
#: as ring Iallreduce, 4 ranks 4-64 KiB: 73-167 us against 109-260 us. Each plan keeps its
#: own send and receive arrays (at most PLANS_MAX x 2 x 64 KiB per communicator)
PLANNED_MAX = (64 << 10) - 1
#: at most this many persistent all-reduces per communicator (more shapes: Iallreduce)
PLANS_MAX = 32
#: one persistent all-reduce: its request, send array and receive array
Plan = tuple[Any, np.ndarray, np.ndarray]
#: a small all_sum of one dtype and shape in the call check's records (a carried sum): the
#: data of the send and of the receive record as arrays of that dtype and shape, the data's
#: bytes and its code
Carry = tuple[np.ndarray, np.ndarray, int, int]
#: a (dtype, op, count) whose plan is not made yet (its first call has not run)
_UNMADE: Any = object()


def _reduce_name(op: str, sendbuf: np.ndarray) -> str:
    """How errors name an all-reduce: the user's operation, or the core's call check."""
    if op == "max" and sendbuf.size == 2 and sendbuf.dtype == np.int64:
        return "all_max (meshcomm's call check before a collective)"
    return _REDUCE_NAMES.get(op, op)


class MPIBackend(Backend):
    """A meshcomm transport over the MPI communicator ``comm``.

    Args:
        comm: the communicator (the backend takes ownership and frees it in ``close``).
        ops: the (dtype, op) -> (MPI datatype, MPI op) table shared by a world and its splits.
        control: the world's control channel (shared by its splits).
        timeout: seconds an operation waits for its peers before it raises.
        cid: this communicator's id, equal on all its members ("world", "world/1:0", ...).
        members: world rank of each rank of ``comm``.
        label: how messages name the communicator.
        spare: a duplicate of ``comm`` the backend owns, for comparing the ranks' calls after
            a mismatch (None: the mismatch error names no calls).
        ring_from: MESHCOMM_MPI_RING_FROM, from which size all-reduces run Open MPI's ring
            algorithm (:mod:`meshcomm_mpi.algorithms`).
    """

    #: the core need not run its own cross-rank call check: a mismatched collective
    #: is found here at the deadline (CollectiveMismatchError), point-to-point at once
    checks_calls = False
    #: the core's call check travels beside each collective: one more non-blocking
    #: all-reduce (max) of the core's call key, started with the operation and compared
    #: before its data is waited for (no extra round trip; see _start_key)
    pipelines_calls = True
    #: results go straight into callers' out= arrays (out=x: MPI_IN_PLACE)
    direct_out = True
    #: why agree/shrink raise NotSupportedError when the job runs without MPI's fault tolerance
    survival_hint = (
        "this MPI job was not started with MPI's fault tolerance (ULFM), so a lost rank ends it; start "
        "it with `meshcomm launch --keep-going --backend mpi` (which runs mpiexec --with-ft ulfm, or "
        "MPICH's -disable-auto-cleanup), with an MPI that has ULFM (Open MPI 5, MPICH 4)"
    )

    def __init__(
        self,
        comm: Any,
        ops: OpTable,
        control: Control,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        cid: str = "world",
        members: list[int] | None = None,
        label: str = "the world",
        spare: Any = None,
        ring_from: str | int = "off",
        plans: dict[tuple[Any, ...], Plan | None] | None = None,
    ) -> None:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm = comm
        self.timeout = timeout
        self._ops = ops
        self._reduce = ops.table
        self._move = ops.move
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._ring_from = ring_from
        self._iallreduce = AllreduceStarter(self._size, ring_threshold(self._size, ring_from))
        self._ctl = control
        self.cid = cid
        self.label = label
        self.members: list[int] = list(range(self._size)) if members is None else members
        self.local_of: dict[int, int] = {w: q for q, w in enumerate(self.members)}
        self.coll_count = 0
        self.sent = [0] * self._size
        self.recvd = [0] * self._size
        self.broken: str | None = None
        #: the last point-to-point call after the last collective (for exit notices)
        self.tail: tuple[Any, ...] | None = None
        self._splits = 0
        self._tags = TagCodec(comm.Get_attr(MPI.TAG_UB) or 32767)
        self._closed = False
        #: a duplicate of ``comm`` (same members) kept for naming a mismatch: after the call
        #: keys differ, ``comm`` has collectives that met different ones and cannot be used
        self._spare = spare
        #: the call check as one persistent all-reduce (MPI-4) of this rank's key into the ranks'
        #: max: a start costs less than a new Iallreduce (2 ranks: 1.0 against 1.8 µs; 4: 8.5
        #: against 13.3). Its arrays are [h, -h], or records of the carried sum (compiled.Carried),
        #: which also carry every small all_sum's data: then it is made here, as those need no
        #: check first; else at the first check. Either way at the same point on every rank.
        self._key: np.ndarray
        self._seen: np.ndarray
        self._key, self._seen = (
            (np.zeros(2, np.int64), np.zeros(2, np.int64)) if ops.carried is None else ops.carried.records()
        )
        self._key_req: Any = None
        #: (dtype, shape) -> how an all_sum of them rides in the check's records (_carry)
        self._carries: dict[tuple[np.dtype, tuple[int, ...]], Carry] = {}
        if ops.carried is not None:
            self._make_key_req()
        #: (dtype, op, count) -> the persistent all-reduce of that call (request, its send and
        #: receive arrays), or None when PLANS_MAX were made first; made after the first call
        #: of its key, at the same point on every rank, as MPI requires of collective calls
        self._plans: dict[tuple[Any, ...], Plan | None] = {} if plans is None else plans
        self._plans_max = PLANS_MAX
        #: all-reduces up to this many bytes run as persistent operations: PLANNED_MAX, less
        #: where MESHCOMM_MPI_RING_FROM asks for the ring algorithm from a smaller size (a
        #: persistent operation takes the library's choice when it is made)
        ring = self._iallreduce.ring_from
        self.planned_max = PLANNED_MAX if ring is None else min(PLANNED_MAX, ring - 1)
        #: the buffers of operations abandoned on a mismatch (MPI may still write into them:
        #: they must outlive the job)
        self._abandoned: list[tuple[Any, ...]] = []
        #: under MPI's fault tolerance (survivors.fault_tolerant): agree and shrink work
        self.survives_failures = control.ft
        self.epoch = 0
        #: the same small all_sum, and the barrier, in one C call each, when every rank runs the
        #: extension (the world's ops then have its carried sum; compiled.compiled_entries)
        entries = None if ops.carried is None else compiled_entries(self, self.planned_max)
        self.sum_now = None if entries is None else entries.run
        self.barrier_now: Callable[[], bool] | None = None if entries is None else entries.barrier
        control.register(self)

    # -- identity -----------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @property
    def control(self) -> Control:
        return self._ctl

    @property
    def carried(self) -> Carried | None:
        """The carried sum this communicator's call checks and small all_sums use, if any."""
        return self._ops.carried

    def tail_text(self) -> str | None:
        """``send #2 to rank 0``: the last point-to-point call, if one came after the last collective."""
        t = self.tail
        if t is None:
            return None
        if t[0] == "send":
            return f"send #{self.sent[t[1]]} to rank {t[1]}"
        if t[0] == "recv":
            return f"recv #{self.recvd[t[1]]} from rank {t[1]}"
        return f"sendrecv (to rank {t[1]}, from rank {t[2]})"

    def counts_for(self, world_peer: int) -> Counts | None:
        """This rank's counts on this communicator as ``world_peer`` sees them (for queries)."""
        q = self.local_of.get(world_peer)
        if q is None:
            return None
        return Counts(self.coll_count, self.sent[q], self.recvd[q])

    def _fail(self, op: str, exc: Any, peer: int | None = None) -> DistributedError:
        if self._ctl.ft:
            lost = survivors.lost_error(exc, self, op)
            if lost is not None:
                self.broken = f"{op} raised PeerLostError: {lost}"
                return lost
        return mpi_error(exc, rank=self._rank, size=self._size, op=op, peer=peer)

    def _usable(self, op: str) -> None:
        if self.broken is not None:
            raise DistributedError(
                f"[mpi] rank {self._rank}: {op} on {self.label} refused: an earlier operation failed "
                f"({self.broken}), and MPI cannot cancel a collective, so this communicator is unusable; "
                "end the job (or start a new one)"
            )

    def _finish(
        self,
        reqs: list[Any],
        what: tuple[Any, ...],
        peer: int | None = None,
        statuses: list[Any] | None = None,
        nbytes: int = 0,
    ) -> None:
        """Complete ``reqs``: one test, then the control channel's deadline wait.

        ``nbytes`` (the size of the transfer) lengthens the initial spin: MPI progresses a
        non-blocking operation only while it is tested, so sleeping between tests would
        stretch every round of a large transfer.
        """
        try:
            if len(reqs) == 1:
                if reqs[0].Test(statuses[0] if statuses else None):
                    return
            elif MPI.Request.Testall(reqs, statuses):
                return
            self._ctl.wait(self, reqs, what, statuses, nbytes)
        except MPI.Exception as exc:
            op = what[1] if what[0] == "coll" else what[0]
            if what[0] == "sendrecv":
                op = f"sendrecv (to {what[1]}, from {what[2]})"
            raise self._fail(op, exc, peer) from None

    # -- the carried call check ---------------------------------------------------------------
    def _start_key(self) -> Any:
        """Start the all-reduce (max) of the core's call key for this collective, if the
        core gave one; it runs beside the operation started right after it."""
        key = self.call_key
        if key is None:
            return None
        self.call_key = None
        req = self._key_req
        if req is None:
            req = self._make_key_req()
        rec = self._key
        rec[0], rec[1] = key[0], key[1]
        if self._ops.carried is not None:
            rec[2] = rec[3] = 0  # no data in this record
        req.Start()
        return req, key

    def _make_key_req(self) -> Any:
        """Make the call check's persistent all-reduce: max of [h, -h], or the carried sum of
        its records (every small all_sum is then a start of it, with its data)."""
        c = self._ops.carried
        if c is None:
            send, recv, op = [self._key, _INT64], [self._seen, _INT64], _MAX
        else:
            send, recv, op = [self._key, 1, c.record], [self._seen, 1, c.record], c.op
        try:
            self._key_req = self._iallreduce.persistent(self.comm, send, recv, op)
        except MPI.Exception as exc:
            raise self._fail("all_max (meshcomm's call check before a collective)", exc) from None
        return self._key_req

    def _agree(self, started: tuple[Any, np.ndarray], what: tuple[Any, ...], op: Any, bufs: tuple[Any, ...]) -> None:
        """Wait for the call check started with operation ``op``; if the ranks' keys differ
        (every rank sees the same max), abandon ``op`` and raise CallsDiffer."""
        kreq, key = started
        self._finish([kreq], what)
        seen = self._seen
        if seen[0] == key[0] and seen[1] == key[1]:
            self._peers_still_here(what, op, bufs)
            return
        self._calls_differ(what, op, bufs)

    def _calls_differ(self, what: tuple[Any, ...], op: Any, bufs: tuple[Any, ...]) -> None:
        """Raise CallsDiffer for ``what``, whose call check found the ranks' calls differ,
        abandoning ``op`` (every rank raises it at this call)."""
        name = what[1] if what[0] == "coll" else what[0]
        # the collective met a different one on some rank: MPI cannot cancel it, so this
        # communicator is done, and MPI_Finalize could wait for it (the control channel ends
        # the job instead at close)
        self._abandon(op, bufs, f"{name} met a different call on another rank")
        self._ctl.lost = True
        details = None
        if self._spare is not None:
            details = MPIBackend(
                self._spare,
                self._ops,
                self._ctl,
                timeout=self.timeout,
                cid=f"{self.cid}/calls",
                members=self.members,
                label=self.label,
                ring_from=self._ring_from,
            )
            details._plans_max = 0  # a one-off communicator: nothing persistent to free
            self._spare = None
        raise CallsDiffer(
            f"[mpi] rank {self._rank}: the call check of {name} on {self.label} found that the ranks' calls differ",
            details=details,
        )

    def _peers_still_here(self, what: tuple[Any, ...], op: Any, bufs: tuple[Any, ...]) -> None:
        """After a carried collective completed: raise, abandoning ``op``, if a peer has failed
        or given up meanwhile (Control.check_notices), as that peer did."""
        try:
            self._ctl.check_notices(self, what)
        except DistributedError as exc:
            self._abandon(op, bufs, f"{what[1]}: {exc}")
            raise

    def _abandon(self, op: Any, bufs: tuple[Any, ...], why: str) -> None:
        """Mark this communicator unusable (``why``), keeping ``op``'s buffers alive for MPI."""
        self._abandoned.append((op, *bufs))
        self.broken = why

    # -- point-to-point -------------------------------------------------------------------
    def send(self, buf: np.ndarray, dst: int) -> None:
        if self.broken is not None:
            self._usable("send")
        try:
            req = self.comm.Isend([buf, self._move[buf.dtype]], dst, self._tags.tag(buf.dtype, buf.size))
        except MPI.Exception as exc:
            raise self._fail("send", exc, dst) from None
        self.sent[dst] += 1
        self.tail = ("send", dst)
        self._finish([req], ("send", dst), dst, None, buf.nbytes)

    def recv(self, buf: np.ndarray, src: int) -> None:
        if self.broken is not None:
            self._usable("recv")
        status = MPI.Status()
        try:
            req = self.comm.Irecv([buf, self._move[buf.dtype]], src, _ANY_TAG)
        except MPI.Exception as exc:
            raise self._fail("recv", exc, src) from None
        self.recvd[src] += 1
        self.tail = ("recv", src)
        try:
            self._finish([req], ("recv", src), src, [status], buf.nbytes)
        except DistributedError as exc:
            if "TRUNCATE" in str(exc).upper():
                raise self._mismatch(buf, src, status.Get_tag(), str(exc)) from None
            raise
        self._check_message(buf, src, status)

    def _check_message(self, buf: np.ndarray, src: int, status: Any) -> None:
        tag = status.Get_tag()
        got = status.Get_count(self._move[buf.dtype])
        if tag != self._tags.tag(buf.dtype, buf.size):
            raise self._mismatch(buf, src, tag, f"got {got} elements, {got * buf.dtype.itemsize} bytes")
        if got != buf.size:  # same tag, different count: only when counts differ by 2**count_bits
            raise DistributedError(
                f"[mpi] rank {self._rank}: recv from rank {src} got {got} elements of {buf.dtype}, "
                f"expected {buf.size}; the sender's send and this recv disagree in shape or dtype "
                "(run with MLX_DEBUG=1 to find the mismatched call)"
            )

    def _mismatch(self, buf: np.ndarray, src: int, tag: int, mpi_text: str | None) -> CollectiveMismatchError:
        sent = self._tags.describe(tag)
        extra = f" ({mpi_text})" if mpi_text else ""
        err = CollectiveMismatchError(
            f"[mpi] rank {self._rank} on {self.label}: recv #{self.recvd[src]} from rank {src} expects "
            f"{buf.size} elements of {buf.dtype}, but rank {src}'s send carries {sent}{extra}; the "
            f"received bytes are discarded. Make rank {src}'s send and rank {self._rank}'s recv use the "
            "same shape and dtype (recv_like(x, src) avoids restating them)"
        )
        self._ctl.last_error = err
        self._ctl.last = {
            "cid": self.cid,
            "label": self.label,
            "text": f"recv #{self.recvd[src]} from rank {src}",
            "kind": "recv",
            "name": "recv",
            "seq": self.coll_count,
            "phase": "raised mismatch",
        }
        return err

    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None:
        if self.broken is not None:
            self._usable("sendrecv")
        status = MPI.Status()
        try:
            rreq = self.comm.Irecv([recvbuf, self._move[recvbuf.dtype]], src, _ANY_TAG)
            sreq = self.comm.Isend(
                [sendbuf, self._move[sendbuf.dtype]], dst, self._tags.tag(sendbuf.dtype, sendbuf.size)
            )
        except MPI.Exception as exc:
            raise self._fail(f"sendrecv (to {dst}, from {src})", exc) from None
        self.sent[dst] += 1
        self.recvd[src] += 1
        self.tail = ("sendrecv", dst, src)
        statuses = [status, MPI.Status()]
        try:
            self._finish([rreq, sreq], ("sendrecv", dst, src), None, statuses, sendbuf.nbytes + recvbuf.nbytes)
        except DistributedError as exc:
            if "TRUNCATE" in str(exc).upper():
                raise self._mismatch(recvbuf, src, status.Get_tag(), str(exc)) from None
            raise
        self._check_message(recvbuf, src, status)

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        if self.broken is not None:
            self._usable(_REDUCE_NAMES.get(op, op))
        c = self._ops.carried
        if c is not None and op == "sum" and sendbuf.nbytes <= c.data:
            carry = self._carries.get((sendbuf.dtype, sendbuf.shape)) or self._carry(c, sendbuf)
            if carry is not None:
                self._carried_sum(carry, sendbuf, recvbuf)
                return
        if sendbuf.nbytes <= self.planned_max:
            key = (sendbuf.dtype, op, sendbuf.size)
            plan = self._plans.get(key, _UNMADE)
            if plan is _UNMADE:  # its first call: an Iallreduce every rank agreed on, then the plan
                self._start_and_wait(sendbuf, recvbuf, op)
                self._plan(*key)
                return
            if plan is not None:
                if sendbuf.ndim != 1:  # the plan's arrays are flat
                    sendbuf, recvbuf = sendbuf.reshape(-1), recvbuf.reshape(-1)
                self._planned(plan, sendbuf, recvbuf, op)
                return
        self._start_and_wait(sendbuf, recvbuf, op)

    def _start_and_wait(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """An all-reduce as one Iallreduce (the call check beside it), waited for under the deadline."""
        dt, mop = self._reduce.get((sendbuf.dtype, op)) or self._ops.resolve(sendbuf.dtype, op)
        self.coll_count += 1
        self.tail = None
        try:
            send: Any
            if not in_place(sendbuf, recvbuf):
                send = [sendbuf, dt]
            elif self._iallreduce.in_place:
                send = MPI.IN_PLACE  # MPI forbids aliasing
            else:  # MPI_IN_PLACE must be all ranks or none (meshcomm_mpi.algorithms)
                sendbuf = sendbuf.copy()
                send = [sendbuf, dt]
            checked = self._start_key() if self.call_key is not None else None
            req = self._iallreduce(self.comm, send, [recvbuf, dt], mop, recvbuf.nbytes)
            if checked is None and req.Test():
                return
        except MPI.Exception as exc:
            raise self._fail(f"all_reduce({op}, {sendbuf.dtype})", exc) from None
        name = _reduce_name(op, sendbuf)
        if checked is not None:
            self._agree(checked, ("coll", name), req, (sendbuf, recvbuf))
            if req.Test():
                return
        self._finish([req], ("coll", name), None, None, sendbuf.nbytes)

    def _plan(self, dtype: np.dtype, op: str, count: int) -> Plan | None:
        """Make the persistent all-reduce of ``count`` elements of ``dtype`` under ``op`` (None
        once PLANS_MAX are made: that call and its repeats run as Iallreduce). Called after the
        first such call completed with the ranks' call checks agreeing, so every rank makes
        it at the same point of the communicator's collectives, as MPI requires."""
        plan = None
        if len(self._plans) < self._plans_max:
            dt, mop = self._reduce.get((dtype, op)) or self._ops.resolve(dtype, op)
            inbuf, outbuf = np.empty(count, dtype), np.empty(count, dtype)
            try:
                req = self._iallreduce.persistent(self.comm, [inbuf, dt], [outbuf, dt], mop)
            except MPI.Exception as exc:
                raise self._fail(f"all_reduce({op}, {dtype})", exc) from None
            plan = (req, inbuf, outbuf)
        self._plans[dtype, op, count] = plan
        return plan

    def _planned(self, plan: Plan, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """A small all-reduce as a start of its persistent operation: the input copied in, the
        result copied out once the call check (if any) agreed and the operation completed."""
        req, inbuf, outbuf = plan
        self.coll_count += 1
        self.tail = None
        np.copyto(inbuf, sendbuf)
        try:
            checked = self._start_key() if self.call_key is not None else None
            req.Start()
            done = checked is None and req.Test()
        except MPI.Exception as exc:
            raise self._fail(f"all_reduce({op}, {sendbuf.dtype})", exc) from None
        if not done:
            self.planned_rest(req, checked, _reduce_name(op, sendbuf), inbuf, outbuf)
        np.copyto(recvbuf, outbuf)

    def planned_error(self, code: int, sendbuf: np.ndarray | None, started: bool) -> None:
        """Raise the error of MPI error ``code`` from the compiled all_sum of ``sendbuf`` (None:
        the barrier): named as :meth:`_planned` names it, for a start (``started`` False) or
        for the wait."""
        if sendbuf is None:
            raise self._fail("barrier", MPI.Exception(code))
        name = "all_sum" if started else f"all_reduce(sum, {sendbuf.dtype})"
        raise self._fail(name, MPI.Exception(code))

    def planned_rest(self, req: Any, checked: Any, name: str, inbuf: np.ndarray, outbuf: np.ndarray) -> None:
        """The rest of a started persistent all-reduce: its call check's answer, then the
        deadline wait (also where the compiled all_sum, ``_planned.PlannedSum``, hands over).
        Interrupted (KeyboardInterrupt, ...), the operation stays started: MPI can neither
        cancel it nor start it again, so the communicator is then unusable."""
        what = ("coll", name)
        try:
            if checked is not None:
                self._agree(checked, what, req, (inbuf, outbuf))
                if req.Test():
                    return
            self._finish([req], what, None, None, inbuf.nbytes)
        except DistributedError:
            raise
        except BaseException as exc:
            self._abandon(req, (inbuf, outbuf), f"{name} was interrupted by {type(exc).__name__}")
            self._ctl.lost = True
            raise

    def _carried_sum(self, carry: Carry, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """A small all_sum as the call check's own operation: its data in the check's record."""
        send, recv, nbytes, code = carry
        self.coll_count += 1
        self.tail = None
        key, self.call_key = self.call_key, None
        rec = self._key
        if key is None:  # 0, 0 without a key: the same on every rank
            rec[0] = rec[1] = 0
        else:
            rec[:2] = key
        rec[2] = nbytes
        rec[3] = code
        send[...] = sendbuf
        try:
            self._key_req.Start()
            done = self._key_req.Test()
        except MPI.Exception as exc:
            raise self._fail(f"all_reduce(sum, {sendbuf.dtype})", exc) from None
        self.carried_rest(done, key is not None)
        recvbuf[...] = recv if recvbuf.shape == recv.shape else recv.reshape(recvbuf.shape)

    def _carry(self, c: Carried, sendbuf: np.ndarray) -> Carry | None:
        """How an all_sum of ``sendbuf``'s dtype and shape rides in the check's records (None:
        it does not, its dtype has no code), kept for the next such call: making the views
        costs more than the copies."""
        code = c.codes.get(sendbuf.dtype)
        if code is None:
            return None
        if len(self._carries) >= 64:
            self._carries.clear()
        data = slice(c.head * 8, c.head * 8 + sendbuf.nbytes)
        send, recv = (
            r.view(np.uint8)[data].view(sendbuf.dtype).reshape(sendbuf.shape) for r in (self._key, self._seen)
        )
        carry = self._carries[sendbuf.dtype, sendbuf.shape] = (send, recv, sendbuf.nbytes, code)
        return carry

    def carried_rest(self, done: bool, keyed: bool, what: tuple[str, str] = ("coll", "all_sum")) -> None:
        """The rest of a started carried all_sum or barrier (``what``; also where the compiled
        one hands over when it did not end agreed): the deadline wait, then the keys' answer:
        keys that are not this rank's are another call on some rank (CallsDiffer, as the call
        check raises it)."""
        req, bufs = self._key_req, (self._key, self._seen)
        if not done:  # the deadline wait, as for any started persistent all-reduce
            self.planned_rest(req, None, what[1], self._key, self._seen)
        if self._seen[0] != self._key[0] or self._seen[1] != self._key[1]:
            self._calls_differ(what, req, bufs)
        if keyed:
            self._peers_still_here(what, req, bufs)

    def all_reduce_init(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> Callable[[], None]:
        """A persistent all-reduce: each start is :meth:`all_reduce` of the same buffers, a
        small sum through the compiled entry (``sum_now``) when there is one."""
        now = self.sum_now if op == "sum" else None

        def start() -> None:
            if now is None or not now(sendbuf, recvbuf):
                self.all_reduce(sendbuf, recvbuf, op)

        return start

    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        if self.broken is not None:
            self._usable("all_gather")
        dt = self._move[sendbuf.dtype]
        self.coll_count += 1
        self.tail = None
        try:
            checked = self._start_key()
            req = self.comm.Iallgather([sendbuf, dt], [recvbuf, dt])
        except MPI.Exception as exc:
            raise self._fail("all_gather", exc) from None
        if checked is not None:
            self._agree(checked, _ALL_GATHER, req, (sendbuf, recvbuf))
        self._finish([req], _ALL_GATHER, None, None, recvbuf.nbytes)

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        if self.broken is not None:
            self._usable("sum_scatter")
        dt, mop = self._reduce.get((sendbuf.dtype, op)) or self._ops.resolve(sendbuf.dtype, op)
        self.coll_count += 1
        self.tail = None
        try:
            checked = self._start_key()
            req = self.comm.Ireduce_scatter_block([sendbuf, dt], [recvbuf, dt], mop)
        except MPI.Exception as exc:
            raise self._fail(f"reduce_scatter({op}, {sendbuf.dtype})", exc) from None
        what = ("coll", "sum_scatter" if op == "sum" else f"reduce_scatter({op})")
        if checked is not None:
            self._agree(checked, what, req, (sendbuf, recvbuf))
        self._finish([req], what, None, None, sendbuf.nbytes)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if self.broken is not None:
            self._usable("broadcast")
        self.coll_count += 1
        self.tail = None
        try:
            checked = self._start_key()
            req = self.comm.Ibcast([buf, self._move[buf.dtype]], root)
        except MPI.Exception as exc:
            raise self._fail(f"broadcast(root={root})", exc) from None
        what = ("coll", f"broadcast(root={root})")
        if checked is not None:
            self._agree(checked, what, req, (buf,))
        self._finish([req], what, None, None, buf.nbytes)

    def all_to_all(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        dt = self._move[sendbuf.dtype]
        start = lambda: self.comm.Ialltoall([sendbuf, dt], [recvbuf, dt])  # noqa: E731
        self._native("all_to_all", start, recvbuf.nbytes, (sendbuf, recvbuf))

    def gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> None:
        dt = self._move[sendbuf.dtype]
        into = None if recvbuf is None else [recvbuf, dt]
        start = lambda: self.comm.Igather([sendbuf, dt], into, root)  # noqa: E731
        self._native(f"gather(root={root})", start, sendbuf.nbytes, (sendbuf, recvbuf))

    def scatter(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> None:
        dt = self._move[recvbuf.dtype]
        src = None if sendbuf is None else [sendbuf, dt]
        start = lambda: self.comm.Iscatter(src, [recvbuf, dt], root)  # noqa: E731
        self._native(f"scatter(root={root})", start, recvbuf.nbytes, (sendbuf, recvbuf))

    def _native(self, name: str, start: Any, nbytes: int, bufs: tuple[Any, ...]) -> None:
        """One of MPI's non-blocking collectives, waited for under the deadline like the rest."""
        if self.broken is not None:
            self._usable(name)
        self.coll_count += 1
        self.tail = None
        try:
            checked = self._start_key()
            req = start()
        except MPI.Exception as exc:
            raise self._fail(name, exc) from None
        if checked is not None:
            self._agree(checked, ("coll", name), req, bufs)
        self._finish([req], ("coll", name), None, None, nbytes)

    def barrier(self) -> None:
        now = self.barrier_now
        if now is not None and now():
            return
        if self.broken is not None:
            self._usable("barrier")
        self.coll_count += 1
        self.tail = None
        try:
            checked = self._start_key()
            if checked is not None:  # an all-reduce synchronises like a barrier: it is the barrier
                self._agree(checked, _BARRIER, None, ())
                return
            req = self.comm.Ibarrier()
        except MPI.Exception as exc:
            raise self._fail("barrier", exc) from None
        self._finish([req], _BARRIER)

    # -- groups -------------------------------------------------------------------------------
    def split(self, color: int, key: int) -> Backend:
        """A new MPIBackend on ``Comm.Split`` of this communicator.

        meshcomm accepts any integer colour and key, MPI only non-negative 32-bit colours,
        so the ranks first exchange (colour, key) under the deadline
        (:func:`meshcomm.plugin.split_plan`, the core's ordering) and each passes MPI its
        colour's index and its position in the subgroup. ``Comm.Split`` itself blocks (MPI
        has no non-blocking split), but every member has just shown it is here.
        """
        plan = split_plan(self, color, key)
        members, index = plan.members, plan.color_index
        self._splits += 1
        try:
            sub = self.comm.Split(index, plan.rank)
            spare = sub.Dup()
        except MPI.Exception as exc:
            raise self._fail(f"split(color={color}, key={key})", exc) from None
        cid = f"{self.cid}/{self._splits}:{index}"
        return MPIBackend(
            sub,
            self._ops,
            self._ctl,
            timeout=self.timeout,
            cid=cid,
            members=[self.members[q] for q in members],
            label=f"split #{self._splits} of {self.label} (color={color})",
            spare=spare,
            ring_from=self._ring_from,
        )

    # -- survivors continue (MPI's fault tolerance) --------------------------------------------
    def agree(self, flag: int) -> tuple[int, frozenset[int]]:
        """ULFM's agreement (:func:`.survivors.agree`); ranks it finds failed make this
        communicator's later operations raise until the world is shrunk."""
        value, lost = survivors.agree(self, flag)
        if lost and self.broken is None:
            self.broken = f"agree() found ranks {sorted(lost)} failed"
        return value, lost

    def shrink(self) -> Backend:
        """The world of the live ranks (:func:`.survivors.shrink`), with its own control channel."""
        comm, old = survivors.shrink(self)
        survivors.bound_finalize()
        old_peers = self._ctl.peers
        peers = old_peers.keep(old, comm.Get_rank()) if old_peers is not None else None
        control = Control(comm.Dup(), peers, spin=self._ctl.spin, answer_wait=self._ctl.answer_wait, ft=True)
        control.ctl.Set_errhandler(MPI.ERRORS_RETURN)
        world = MPIBackend(comm, self._ops, control, timeout=self.timeout, spare=comm.Dup(), ring_from=self._ring_from)
        world.epoch = self.epoch + 1
        self.broken = "this world was replaced by shrink()"
        self._closed = True
        return world

    def grow(self) -> Backend | None:
        raise NotSupportedError(
            f"[mpi] rank {self._rank}: grow() is not available on the mpi backend: a process started later "
            "cannot join a running MPI job's communicator here (that needs MPI_Comm_connect through a name "
            "server both jobs reach); the sockets backend can grow"
        )

    # -- ending -------------------------------------------------------------------------------
    def abort(self, code: int, reason: str) -> None:
        """This rank's program failed: make every peer raise PeerLostError, then MPI_Abort(code).

        Peers waiting in any operation get a FAIL notice with ``reason`` and acknowledge it;
        after every peer acknowledged (or about 2 s) the job ends with ``code``. If this
        rank is failing because of an error the backend raised (a peer failed first, a
        timeout, a mismatch), it does not race the first failure: see Control.abort.
        """
        self._ctl.abort(int(code), str(reason))

    def close(self) -> None:
        """Free the communicator; for the world, first tell the peers this rank has ended.

        If a peer was lost (the job cannot end normally: MPI_Finalize would wait for it for
        ever), the world's close ends the job through :meth:`abort` with code 1.
        """
        if self._closed:
            return
        self._closed = True
        world = self.cid == "world" and self._ctl.comms.get("world") is self
        if world:
            self._ctl.term.uninstall()
        if MPI.Is_finalized():
            return
        if world:
            try:
                self._ctl.exit_notice()
                if self._ctl.lost and not self._ctl.aborting and not self._ctl.ft:
                    self._ctl.abort(1, "closed after a peer was lost")
            except MPI.Exception:
                pass
        if self._spare is not None:
            try:
                self._spare.Free()
            except MPI.Exception:
                pass
        if self.broken is None:
            for req in [self._key_req] + [plan[0] for plan in self._plans.values() if plan is not None]:
                if req is not None:
                    try:
                        req.Free()
                    except MPI.Exception:
                        pass
        if self.broken is None:
            try:
                self.comm.Free()
            except MPI.Exception:
                pass
