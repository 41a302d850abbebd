"""The gloo transport: meshcomm's Backend protocol on a torch ProcessGroupGloo.

Buffers are handed to gloo as CPU tensors that view the NumPy memory
(``torch.from_numpy``), so no data is copied except where the contract needs a
fresh output (all-reduce is in place in gloo) or a dtype needs re-encoding
(:mod:`meshcomm_gloo.codecs`). Imports torch; imported only by the factory.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from meshcomm.plugin import (
    Backend,
    CallsDiffer,
    CollectiveMismatchError,
    CommTimeoutError,
    DistributedError,
    NotSupportedError,
    PeerLostError,
    algorithms,
    in_place,
)

from . import pairsum
from .calls import BIG, Call, conflicts, dtype_code, p2p_tag
from .checkline import CheckLine, PeerClosed
from .codecs import Plan, plan_for
from .errors import first_line, translate
from .joining import Admission, Joins, admit_waiting, write_admission
from .liveness import RankProcess, owner, suspects
from .records import Records
from .rendezvous import connect
from .smallreduce import line_key, on_line, reduce_rows
from .survivors import agree_in_store
from .tensors import tensor

__all__ = ["GlooBackend"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
#: seconds a rank whose operation timed out waits for the others' failure records
_RECORD_WAIT = 2.0


#: the status a rank leaves when it closes its world group normally (its program ended, or
#: it called meshcomm.shutdown()); peers still waiting on it say so in the common words
_ENDED_STATUS = (
    "it closed its group: its program ended or called meshcomm.shutdown() while this rank still waited for it"
)


class GlooBackend(Backend):
    """One meshcomm group = one ProcessGroupGloo; ``split`` makes a new one for each colour.

    Failures: the first error of a group is kept and raised again by every later call
    (the ProcessGroupGloo is dropped at once, which closes its connections, so peers still
    waiting on this rank fail now rather than at their timeout). Before raising, the rank
    publishes the call it failed in and reads the others' (:mod:`.records`), which names
    the rank that left, stopped or called something else.
    """

    #: results go straight into callers' out= arrays (gloo reduces in place there)
    direct_out = True
    #: survivors agree through the rendezvous store and make a new process group (:mod:`.survivors`)
    survives_failures = True
    #: how many times the world was rebuilt by shrink before this one
    epoch = 0

    def __init__(
        self,
        pg: Any,
        store: Any,
        prefix: str,
        rank: int,
        size: int,
        timeout: float,
        ifname: str | None = None,
        label: str = "world",
        peers: list[RankProcess] | None = None,
        members: list[int] | None = None,
        ends: list[set[str]] | None = None,
        line: CheckLine | None = None,
        spin: float = 0.0,
    ) -> None:
        self._pg = pg
        #: the call check's own channel (:mod:`.checkline`), polling ``spin`` s before it sleeps
        self._line = line
        self._spin = spin
        if line is not None:
            line.spin = spin
        #: the core's call key goes with each collective (checked on the channel first, or
        #: carried with a small all-reduce's data there)
        self.pipelines_calls = line is not None
        self._seen = np.empty(2, np.int64)
        self._ends = ends or []
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._size = size
        self._ifname = ifname
        self._label = label
        self._splits = 0
        self._seq = 0
        self._children: list[weakref.ref[GlooBackend]] = []
        self._peers = peers or []
        self._members = members if members is not None else list(range(size))
        self._records = Records(store, prefix, timeout)
        self._failed: DistributedError | None = None
        self._status_sent = False
        self._agreements = 0
        #: this rank's "connecting" mark (:func:`_connecting_key`) is still in the store
        self._marked = False
        #: rank 0's book of newcomers (:mod:`.joining`), handed from world to world
        self._joins = Joins()
        self.timeout = timeout

    # -- identity -------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"GlooBackend({self._label}, rank={self._rank}, size={self._size})"

    # -- plumbing -------------------------------------------------------------------
    def _where(self) -> str:
        return f"rank {self._rank} of the {self._label} group (size {self._size})"

    def _named(self, call: Call) -> Call:
        """``call`` naming the user's call it is part of (only built when a message needs it)."""
        return call._replace(shown=self.call_text(call.name)) if self.user_op else call

    def _usable(self, call: Call) -> Any:
        """The process group, or the error that broke this group (raised again, same class and peer)."""
        if self._pg is not None:
            return self._pg
        op = self._named(call).describe()
        if self._failed is not None:
            first = self._failed
            said = f"{op} called on a group that failed earlier; the first error was: {first}"
            raise _twin(first, f"[gloo] {self._where()}: {said}")
        raise DistributedError(f"[gloo] {self._where()}: {op} called after the group was closed")

    def _drop(self, gave_up: bool = False) -> None:
        """Let go of the process group and close the call-check channel (peers waiting on this
        rank in either learn now; when this rank ``gave_up`` on a call, also those that already
        have every frame they need from it)."""
        self._pg = None
        if self._line is not None:
            if gave_up:
                self._line.give_up()
            else:
                self._line.close()
            self._line = None

    def check_key(self, key: np.ndarray, out: np.ndarray) -> None:
        """The call check on this group's own channel (:mod:`.checkline`): a few microseconds of
        socket exchange instead of a gloo work item, which costs as much as a small collective."""
        if self._line is None:
            super().check_key(key, out)
            return
        call = self._coll("all_max", key)
        self._usable(call)
        try:
            self._line.reduce_max(key, out, self.timeout)
        except RuntimeError as exc:
            raise self._fail(exc, call, None) from None

    def _coll(self, name: str, buf: np.ndarray | None = None, root: int = -1) -> Call:
        self._seq += 1
        if buf is None:
            return Call("coll", name, seq=self._seq, root=root)
        return Call("coll", name, buf.dtype, buf.size, self._seq, root)

    def _checked(self, call: Call) -> None:
        """The call check of the collective ``call`` is part of, on the channel, when the core
        handed its key over (:attr:`pipelines_calls`): before any gloo work starts, so a
        mismatch leaves nothing of gloo's waiting."""
        key = self.call_key
        if key is None:
            return
        self.call_key = None
        self._usable(call)  # a failed group raises its first error again
        seen = self._seen
        line = cast(CheckLine, self._line)  # a usable group has its channel
        self.user_step = "the call check"  # messages name the user's call and its check
        try:
            line.reduce_max(key, seen, self.timeout)
        except RuntimeError as exc:  # recorded as the call itself: a rank already in it does not conflict
            raise self._fail(exc, call, None) from None
        finally:
            self.user_step = ""
        if seen[0] != key[0] or seen[1] != key[1]:
            raise self._differ(call)

    def _differ(self, call: Call) -> CallsDiffer:
        """The ranks' keys differ: every rank raises this at the same call, and the group
        stays in step (nothing of the call was started), so the core names the calls on it."""
        return CallsDiffer(
            f"[gloo] rank {self._rank}: the call check of {call.name} on the {self._label} group found "
            "that the ranks' calls differ",
            details=self,
        )

    def _run(self, call: Call, start: Callable[[Any], Any], peer: int | None = None) -> None:
        """Start a gloo work item on the process group and wait for it, translating failures."""
        pg = self._usable(call)
        if self.call_key is not None:
            self._checked(call)
        try:
            start(pg).wait()
        except RuntimeError as exc:
            raise self._fail(exc, call, peer) from None

    def _fail(self, exc: BaseException | DistributedError, call: Call, peer: int | None) -> DistributedError:
        """The error to raise for ``exc`` in ``call``; breaks this group (see the class docstring).

        Raised ``from None``: its message already quotes gloo's first line, and torch's chained
        traceback above meshcomm's error only buried it; gloo's exception stays reachable as
        ``err.gloo_error``."""
        call = Call.parse(self._named(call).text())  # dtype names, as the other ranks publish them
        if isinstance(exc, DistributedError):
            err = exc
        else:
            err = self._explain(exc, call, peer)
            err.gloo_error = exc  # type: ignore[attr-defined]
        self._failed = _twin(err)
        self._records.publish(self._rank, call, type(err).__name__, getattr(err, "peer", None), str(err))
        self._drop(gave_up=True)  # closes this group's connections: peers waiting on this rank learn now
        return err

    def _explain(self, exc: BaseException, call: Call, peer: int | None) -> DistributedError:
        """Name the rank behind a gloo failure: mismatched call, left, stopped/dead, or silent."""
        base = translate(exc, where=self._where(), op=call.describe(), timeout=self.timeout, peer=peer)
        said = f" gloo said: {first_line(exc)}."
        others = [q for q in range(self._size) if q != self._rank and call.involves(q)]
        timed_out = isinstance(base, CommTimeoutError)
        local: list[tuple[int, str]] = []
        for _ in range(1 if timed_out else 10):  # a killed peer's socket may close just before it is reaped
            local = [(q, text) for q, text in suspects(self._peers, self._members, self._rank) if q in others]
            if local:
                break
            time.sleep(0.05)
        down = {q for q, _ in local}
        # publish this rank's call first, so that ranks that time out with it can compare
        self._records.publish(self._rank, call, "pending", None, "")
        records = self._records.collect(
            others, min(_RECORD_WAIT, self.timeout) if timed_out else 0.0, skip=lambda q: q in down
        )
        what = f"[gloo] {self._where()}: {call.describe()}"
        # 1. a rank called something this call cannot meet, or already found a mismatch
        odd = [q for q, rec in records.items() if conflicts(self._rank, call, q, rec.call)]
        if odd:
            calls = "; ".join(f"rank {q} called {records[q].call.describe()}" for q in odd)
            return CollectiveMismatchError(
                f"{what} cannot complete: the ranks called different operations: this rank called "
                f"{call.describe()}; {calls}. Every rank of a group must call the same collectives in the "
                f"same order with the same shapes, dtypes, ops and roots, and each recv must match its "
                f"send's shape and dtype.{said}"
            )
        seen = [q for q, rec in records.items() if rec.error == "CollectiveMismatchError"]
        if seen:
            return CollectiveMismatchError(
                f"{what} failed: rank {seen[0]} found mismatched calls: {records[seen[0]].why}"
            )
        # 2. the others gave up waiting for this rank (it was stopped, e.g. SIGSTOP, or too slow)
        given_up = [q for q, rec in records.items() if rec.peer == self._rank and rec.error == "CommTimeoutError"]
        if given_up:
            q = given_up[0]
            return PeerLostError(
                f"{what} failed: rank {q} gave up waiting for this rank after {self.timeout:g} s (MLX_TIMEOUT) "
                f"and left the group: this rank was stopped or too slow. Raise MLX_TIMEOUT if it is only slow; "
                f"this group cannot be used any more.{said}",
                peer=q,
            )
        # 3. a rank left the job (closed its group, or its program failed) without failing here first
        statuses = self._records.statuses(self._members[q] for q in others)
        gone = [
            q
            for q in others
            if self._members[q] in statuses and q not in records and not statuses[self._members[q]].startswith("after")
        ]
        if gone:
            q = gone[0]
            if statuses[self._members[q]] == _ENDED_STATUS:  # the same words as every backend
                return PeerLostError(
                    f"[gloo] rank {self._rank}: rank {q} exited (its program ended) while rank {self._rank} waits "
                    f"in {call.describe()} on the {self._label} group, an operation rank {q} never reached; make every "
                    "rank run the same sequence of collectives (and matching sends and receives) before it ends."
                    f"{said}",
                    peer=q,
                )
            return PeerLostError(
                f"{what} failed: rank {q} (world rank {self._members[q]}) left the job: "
                f"{statuses[self._members[q]]}. Check that rank's output; this group cannot be used any more."
                f"{said}",
                peer=q,
            )
        # 4. a rank on this host is dead or stopped (a stopped rank closes nothing: when gloo
        #    reports a closed connection, a peer that timed out on it has dropped its group)
        stopped = [(q, text) for q, text in local if text.endswith("is stopped")]
        if stopped and len(stopped) == len(local):
            q, text = stopped[0]
            return CommTimeoutError(
                f"{what} failed: rank {q} does not answer: on this host {text}. Its peers give up after "
                f"{self.timeout:g} s (MLX_TIMEOUT); resume it (SIGCONT) or end the job.{said}",
                peer=q,
            )
        if local:
            return translate(
                exc, where=self._where(), op=call.describe(), timeout=self.timeout, peer=peer, suspects=local
            )
        # 5. another rank already knows whom to blame
        blamed = [
            (q, rec)
            for q, rec in records.items()
            if rec.error in ("PeerLostError", "CommTimeoutError") and rec.peer is not None and rec.peer != self._rank
        ]
        if blamed:
            q, rec = blamed[0]
            cls = PeerLostError if rec.error == "PeerLostError" else CommTimeoutError
            return cls(f"{what} failed: rank {q} reported that rank {rec.peer} failed: {rec.why}", peer=rec.peer)
        # 6. the address in gloo's message belongs to a member (also one on another host)
        if timed_out:
            lost = None
        elif isinstance(exc, PeerClosed):  # the call check's own channel knows whose connection it was
            lost = exc.peer
        else:
            lost = owner(str(exc), self._ends, self._rank)
        if lost is not None and lost in others:
            host = self._peers[self._members[lost]].host if self._members[lost] < len(self._peers) else "?"
            return PeerLostError(
                f"{what} failed: lost the connection to rank {lost} (world rank {self._members[lost]} on host "
                f"{host}), which crashed, was killed or exited without a word. Check that rank's output; "
                f"this group cannot be used any more.{said}",
                peer=lost,
            )
        # 7. a timeout: the ranks that published nothing are the silent ones
        if timed_out:
            silent = [q for q in others if q not in records]
            if silent:
                names = ", ".join(f"rank {q} (world rank {self._members[q]})" for q in silent)
                return CommTimeoutError(
                    f"{what} timed out after {self.timeout:g} s (MLX_TIMEOUT): no answer from {names}, "
                    f"which is stuck, stopped, on another host and dead, or skipped this call; the other "
                    f"ranks were waiting in the same call. Raise MLX_TIMEOUT if it is only slow.{said}",
                    peer=silent[0] if len(silent) == 1 else peer,
                )
        return base

    # -- point-to-point -------------------------------------------------------------
    def _post_send(self, pg: Any, buf: np.ndarray, dst: int) -> list[Any]:
        """Start sending ``buf`` (tagged with its dtype and count); the works to wait for."""
        n = buf.size
        works = []
        if n >= BIG:
            head = np.array([dtype_code(buf.dtype), n], dtype=np.int64)
            works.append(pg.send([tensor(head)], dst, p2p_tag(buf.dtype, n, 0)))
        works.append(pg.send([tensor(buf)], dst, p2p_tag(buf.dtype, n, 1)))
        return works

    def _recv_into(self, pg: Any, buf: np.ndarray, src: int, call: Call) -> None:
        """Receive into ``buf``; a big message's header is checked before its payload is posted."""
        n = buf.size
        if n >= BIG:
            head = np.zeros(2, dtype=np.int64)
            pg.recv([tensor(head)], src, p2p_tag(buf.dtype, n, 0)).wait()
            if int(head[1]) != n or int(head[0]) != dtype_code(buf.dtype):
                raise CollectiveMismatchError(
                    f"[gloo] {self._where()}: {self._named(call).describe()}: rank {src} sent {int(head[1])} elements "
                    f"({buf.dtype.name} on both ranks) but this rank expects {n}; a recv must match its "
                    "send's shape and dtype"
                )
        pg.recv([tensor(buf)], src, p2p_tag(buf.dtype, n, 1)).wait()

    def send(self, buf: np.ndarray, dst: int) -> None:
        if not buf.nbytes:
            return
        call = Call("send", "send", buf.dtype, buf.size, peer=dst)
        pg = self._usable(call)
        try:
            for w in self._post_send(pg, buf, dst):
                w.wait()
        except RuntimeError as exc:
            raise self._fail(exc, call, dst) from None

    def recv(self, buf: np.ndarray, src: int) -> None:
        if not buf.nbytes:
            return
        call = Call("recv", "recv", buf.dtype, buf.size, peer=src)
        pg = self._usable(call)
        try:
            self._recv_into(pg, buf, src, call)
        except (RuntimeError, CollectiveMismatchError) as exc:
            raise self._fail(exc, call, src) from None

    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None:
        """Both directions posted before waiting: gloo's send/recv are asynchronous."""
        call = Call(
            "sendrecv",
            "sendrecv",
            sendbuf.dtype,
            sendbuf.size if sendbuf.nbytes else 0,
            peer=dst if sendbuf.nbytes else -1,
            peer2=src if recvbuf.nbytes else -1,
            dtype2=recvbuf.dtype,
            count2=recvbuf.size if recvbuf.nbytes else 0,
        )
        pg = self._usable(call)
        try:
            works = self._post_send(pg, sendbuf, dst) if sendbuf.nbytes else []
            if recvbuf.nbytes:
                self._recv_into(pg, recvbuf, src, call)
            for w in works:
                w.wait()
        except (RuntimeError, CollectiveMismatchError) as exc:
            raise self._fail(exc, call, src if dst == src else None) from None

    # -- collectives ----------------------------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        plan = plan_for(sendbuf.dtype, op)
        if self._line is not None and on_line(sendbuf, op, self._size):
            self._line_all_reduce(sendbuf, recvbuf, op)
            return
        if plan.generic:  # the core's algorithm over send/recv, which take no key: check first
            if self.call_key is not None:
                self._checked(self._coll(f"all_{op}", sendbuf))
            algorithms.all_reduce(self, sendbuf, recvbuf, op)
            return
        call = self._coll(f"all_{op}", sendbuf)
        if pairsum.fits(self._size, sendbuf.nbytes, plan):  # also in place: ranks may differ in out=
            self._pair_reduce(sendbuf, recvbuf, plan, call)
            return
        if plan.codec is None:  # reduce in place in the output, viewed as the wire dtype
            if not in_place(sendbuf, recvbuf):
                recvbuf[...] = sendbuf
            self._allreduce(tensor(recvbuf, plan.wire, plan.torch), plan, call)
            return
        encode, decode = plan.codec
        wire = encode(sendbuf)
        self._allreduce(tensor(wire, plan.wire, plan.torch), plan, call)
        decode(wire, recvbuf)

    def _line_all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """A small all-reduce with its call check on the channel (:mod:`.smallreduce`)."""
        call = self._coll(f"all_{op}", sendbuf)
        self._usable(call)
        line = cast(CheckLine, self._line)  # on_line was asked because the group has one
        key, self.call_key = self.call_key, None
        mine = line_key(key, sendbuf, op)
        table = np.empty((self._size, sendbuf.nbytes), np.uint8)
        table[0] = sendbuf.reshape(-1).view(np.uint8)
        try:
            seen = line.gather(mine, table, self.timeout)
        except RuntimeError as exc:
            raise self._fail(exc, call, None) from None
        if seen[0] != mine[0] or seen[1] != mine[1]:
            if key is not None:
                raise self._differ(call)
            raise CollectiveMismatchError(
                f"[gloo] {self._where()}: {self._named(call).describe()}: the ranks' calls differ (operation, "
                "dtype or size); every rank of a group must make the same collective calls in the same order"
            )
        reduce_rows(table, sendbuf.dtype, op, self._rank, recvbuf)

    def _pair_reduce(
        self, sendbuf: np.ndarray, recvbuf: np.ndarray, plan: Plan, call: Call, *, scatter: bool = False
    ) -> None:
        """A two-rank all-reduce (into a separate result or in place) or reduce-scatter without
        copying the input (:mod:`.pairsum`)."""
        pg = self._usable(call)
        if self.call_key is not None:
            self._checked(call)
        x, out = sendbuf.reshape(-1).view(plan.wire), recvbuf.reshape(-1).view(plan.wire)
        try:
            pairsum.pair_reduce(pg, self._rank, x, out, plan.op, scatter=scatter)
        except RuntimeError as exc:
            raise self._fail(exc, call, None) from None

    def _allreduce(self, t: torch.Tensor, plan: Plan, call: Call) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[plan.op]  # type: ignore[assignment]  # torch's stubs: RedOpType vs ReduceOp
        self._run(call, lambda pg: pg.allreduce([t], opts))

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """An all-reduce of a copy, then this rank's block; on two ranks, above what the
        channel reduces, an exchange of halves straight into the block (:mod:`.pairsum`).

        torch 2.13's gloo ``reduce_scatter_tensor`` works but is several times slower than
        its all-reduce of the whole buffer (docs/backends/gloo.md has the numbers), so the
        all-reduce, which moves at most twice the bytes, is the faster native path.
        """
        plan = plan_for(sendbuf.dtype, op)
        if pairsum.exact(self._size, plan) and not (self._line is not None and on_line(sendbuf, op, self._size)):
            # recorded as the all-reduce it stands for, as the other paths record it
            self._pair_reduce(sendbuf, recvbuf, plan, self._coll(f"all_{op}", sendbuf), scatter=True)
            return
        algorithms.reduce_scatter_by_all_reduce(self, sendbuf, recvbuf, op)

    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        src, out = tensor(sendbuf), tensor(recvbuf)
        self._run(self._coll("all_gather", sendbuf), lambda pg: pg._allgather_base(out, src))

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        t = tensor(buf)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._run(
            self._coll("broadcast", buf, root),
            lambda pg: pg.broadcast([t], opts),
            peer=root if self._rank != root else None,
        )

    def all_to_all(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        src, out = tensor(sendbuf), tensor(recvbuf)
        self._run(
            self._coll("all_to_all", sendbuf), lambda pg: pg.alltoall_base(out, src, [], [], dist.AllToAllOptions())
        )

    def gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> None:
        src = tensor(sendbuf)
        opts = dist.GatherOptions()
        opts.rootRank = root
        outs = [] if recvbuf is None else [list(tensor(recvbuf).tensor_split(self._size))]
        self._run(
            self._coll("gather", sendbuf, root),
            lambda pg: pg.gather(outs, [src], opts),
            peer=root if self._rank != root else None,
        )

    def scatter(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> None:
        out = tensor(recvbuf)
        opts = dist.ScatterOptions()
        opts.rootRank = root
        ins = [] if sendbuf is None else [list(tensor(sendbuf).tensor_split(self._size))]
        self._run(
            self._coll("scatter", recvbuf, root),
            lambda pg: pg.scatter([out], ins, opts),
            peer=root if self._rank != root else None,
        )

    def barrier(self) -> None:
        call = self._coll("barrier")
        if self.call_key is not None:  # the check on the channel waits for every rank: a barrier
            self._usable(call)
            self._checked(call)
            return
        self._run(call, lambda pg: pg.barrier())

    # -- groups ---------------------------------------------------------------------
    def split(self, color: int, key: int) -> Backend:
        """A new ProcessGroupGloo for this colour, after every rank learnt every (colour, key)."""
        plan = algorithms.split_plan(self, color, key)
        members = plan.members
        self._splits += 1  # same count on every rank: split is collective
        prefix = f"{self._prefix}/split{self._splits}/color{color}"
        label = f"split {self._splits} (color {color}) of the {self._label}"
        sub_rank, sub_size = plan.rank, len(members)
        world = [self._members[q] for q in members]
        try:
            pg, ends, line = connect(
                self._store, prefix, sub_rank, sub_size, self.timeout, self._ifname, self._peers, world
            )
        except DistributedError:  # e.g. a forged address in the store (StoreAuthError): keep it as it is
            raise
        except RuntimeError as exc:
            raise translate(
                exc,
                where=self._where(),
                op=f"split(color={color}) connecting to ranks {members}",
                timeout=self.timeout,
                suspects=suspects(self._peers, self._members, self._rank),
            ) from exc
        child = GlooBackend(
            pg,
            self._store,
            prefix,
            sub_rank,
            sub_size,
            self.timeout,
            self._ifname,
            label,
            self._peers,
            world,
            ends,
            line,
            self._spin,
        )
        self._children.append(weakref.ref(child))
        return child

    # -- survivors continue ------------------------------------------------------------
    def _survivors(self, what: str) -> tuple[int, set[int]]:
        """This rank's world rank and the world ranks it timed out on; only on a world."""
        if self._label != "world" or self._store is None:
            raise NotSupportedError(f"[gloo] {self._where()}: {what} works on the world group; call it there")
        failed = self._failed
        peer = getattr(failed, "peer", None)
        if isinstance(failed, CommTimeoutError) and isinstance(peer, int) and 0 <= peer < self._size:
            return self._members[self._rank], {self._members[peer]}
        return self._members[self._rank], set()

    def _gone(self, world_ranks: Iterable[int]) -> set[int]:
        """Which of ``world_ranks`` are known gone: a status record (its program failed or
        ended), or on this host a process that is gone or a zombie."""
        ranks = list(world_ranks)
        dead = suspects(self._peers, ranks, -1, dead_only=True)  # -1: this rank is not among them
        return set(self._records.statuses(ranks)) | {ranks[i] for i, _ in dead}

    def _arrived(self) -> None:
        """This rank wrote that it is here in this world's agreement: it is no longer connecting."""
        if self._marked:
            self._marked = False
            with contextlib.suppress(Exception):
                self._store.delete_key(_connecting_key(self._prefix, self._members[self._rank]))

    def _connecting(self, world_rank: int) -> bool:
        """Whether ``world_rank`` is still connecting to this world (its rebuild's connect has not returned)."""
        return bool(self._store.check([_connecting_key(self._prefix, world_rank)]))

    def agree(self, flag: int) -> tuple[int, frozenset[int]]:
        me, timed_out = self._survivors("agree")
        self._agreements += 1
        key = f"{self._prefix}/agree{self._agreements}"
        value, members = agree_in_store(
            self._store, key, me, self._members, flag, self.timeout, self._gone, timed_out, self._connecting
        )
        self._arrived()
        lost = frozenset(i for i, w in enumerate(self._members) if w not in members)
        if lost and self._failed is None:  # the agreement gave up on them: so does this world
            self._failed = PeerLostError(
                f"[gloo] {self._where()}: the survivors agreed that ranks {sorted(lost)} are lost; shrink() the "
                "world to go on without them",
                peer=min(lost),
            )
            self._drop(gave_up=True)
        return value, lost

    def shrink(self) -> Backend:
        me, timed_out = self._survivors("shrink")
        self._agreements += 1  # a shrink that failed (a member died meanwhile) is called again: a new key
        key = f"{self._prefix}/shrink{self._agreements}"
        _flag, members = agree_in_store(
            self._store, key, me, self._members, 1, self.timeout, self._gone, timed_out, self._connecting
        )
        prefix = f"{self._prefix}/shrunk{self._agreements}"
        return self._rebuild("shrink", prefix, members.index(me), members, self._peers)

    def grow(self) -> Backend | None:
        """Admit the newcomers waiting in the store (:mod:`.joining`): rank 0 (the store's host)
        decides who, every rank reads the decision, and the larger world forms under a new prefix."""
        self._survivors("grow")
        store = self._store
        self._agreements += 1
        key = f"{self._prefix}/grow{self._agreements}"
        try:
            if self._rank == 0:
                ready = admit_waiting(store, self._joins, self.timeout)
                store.set(key, json.dumps([[n, p.encode()] for n, p in ready]))
            decided = json.loads(bytes(store.get(key)).decode())
        except DistributedError:
            raise
        except Exception as exc:  # rank 0, and with it the store, is gone or unreachable
            raise DistributedError(
                f"[gloo] {self._where()}: grow() cannot read rank 0's decision: the rendezvous store does not answer "
                f"({type(exc).__name__}: {first_line(exc)}); it is served by world rank 0"
            ) from None
        if not decided:
            return None
        joiners = [(int(n), RankProcess.decode(p)) for n, p in decided]
        peers = self._peers + [p for _, p in joiners]
        members = self._members + [len(self._peers) + i for i in range(len(joiners))]
        prefix = f"{self._prefix}/grown{self._agreements}"
        if self._rank == 0:
            for i, (n, _) in enumerate(joiners):
                place = Admission(prefix, self._size + i, len(members), self.epoch + 1, members, peers)
                write_admission(store, n, place)
                self._joins.admitted.add(n)
        return self._rebuild("grow", prefix, self._rank, members, peers)

    def _rebuild(self, op: str, prefix: str, rank: int, members: list[int], peers: list[RankProcess]) -> GlooBackend:
        """The next world (after shrink or grow): a ProcessGroupGloo of ``members`` under ``prefix``;
        this world is spent. A member lost while they connect leaves the new world failed (its
        next operation raises), and the survivors shrink it in turn."""
        pg: Any = None
        ends: list[set[str]] = []
        line: CheckLine | None = None
        failed: DistributedError | None = None
        marker = _connecting_key(prefix, members[rank])
        try:
            self._store.set(marker, "1")  # the next agreement waits longer for a rank still connecting
            size = len(members)
            pg, ends, line = connect(self._store, prefix, rank, size, self.timeout, self._ifname, peers, members)
        except RuntimeError as exc:
            # the mark stays until this rank is in the new world's agreement: taken off now, the
            # others could look between its connect and its arrival and give up on it
            failed = translate(exc, where=self._where(), op=f"{op}() connecting to the new world", timeout=self.timeout)
        else:
            with contextlib.suppress(Exception):  # the store's server may be gone: the next agreement says so
                self._store.delete_key(marker)
        world = GlooBackend(
            pg,
            self._store,
            prefix,
            rank,
            len(members),
            self.timeout,
            self._ifname,
            "world",
            peers,
            members,
            ends,
            line,
            self._spin,
        )
        world._failed = failed
        world._marked = failed is not None
        world.epoch = self.epoch + 1
        world._joins = self._joins
        self._drop()
        if self._failed is None:
            self._failed = DistributedError(f"[gloo] {self._where()}: this world was replaced by {op}()")
        self._store = None  # the new world speaks for this process from now on (its status records)
        return world

    def abort(self, code: int, reason: str) -> None:
        """This rank's program failed: tell the peers why (a status record in the store), then
        close every group so that peers waiting on this rank raise PeerLostError naming it now.
        The launcher ends the job with ``code``; gloo needs nothing more."""
        self._set_status(f"its program failed: {reason} (exit code {code})")
        self.close()

    def _set_status(self, text: str) -> None:
        if self._status_sent or self._store is None or self._label != "world":
            return
        self._status_sent = True
        if self._failed is not None:  # this rank is not the cause: it is leaving because of a failure
            text = f"after its own failure ({type(self._failed).__name__}): {text}"
        self._records.set_status(self._members[self._rank], text)

    def close(self) -> None:
        """Drop this group's and its splits' process groups (gloo closes connections on free).

        Done at ``meshcomm.shutdown()`` (atexit) so that no ProcessGroupGloo is left for
        interpreter finalisation, where freeing one intermittently aborted the process. The
        world group first leaves a status record, so that a peer still waiting on this rank
        (which exits early) names it and says it left.
        """
        if self._pg is not None or self._failed is not None:
            self._set_status(_ENDED_STATUS)
        if self._failed is not None and self._label == "world" and self._store is not None:
            self._linger()
        for ref in self._children:
            child = ref()
            if child is not None:
                child.close()
        self._children.clear()
        self._drop()
        self._store = None

    def _linger(self) -> None:
        """World rank 0, leaving a failed world, serves the store the others read the failure's
        records from while they explain it: it waits (at most ``_RECORD_WAIT`` seconds) until each
        other rank has left its status record or is gone."""
        me = self._members[self._rank]
        if me != 0:
            return
        waiting = {w for w in self._members if w != me}
        end = time.monotonic() + _RECORD_WAIT
        while waiting:
            waiting -= self._gone(waiting)  # only those not yet seen leaving are looked up again
            if not waiting or time.monotonic() >= end:
                return
            time.sleep(0.02)


def _connecting_key(prefix: str, world_rank: int) -> str:
    """The store key that says ``world_rank`` is still connecting to the world under ``prefix``."""
    return f"{prefix}/meshcomm-connecting/{world_rank}"


def _twin(err: DistributedError, message: str | None = None) -> DistributedError:
    """A new error of ``err``'s class and peer (with ``message``, or ``err``'s own) that holds no traceback.

    A group keeps the error that broke it this way, not the raised one: that one's traceback
    holds the frames of the failed call and with them its ProcessGroupGloo, which would then
    live until interpreter exit, where freeing a process group can abort the process
    ("terminate called without an active exception")."""
    text = str(err) if message is None else message
    try:
        twin = type(err)(text)
    except TypeError:  # a class that needs more to be made (StoreAuthError: its key)
        twin = DistributedError(text)
    if hasattr(err, "peer"):
        twin.peer = err.peer  # type: ignore[attr-defined]
    return twin
