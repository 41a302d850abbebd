"""The control channel: every wait runs under a deadline and hears about failed peers.

MPI has no timeout and no failure notification in its standard, so the backend builds
both from non-blocking calls and a private control communicator (a duplicate of the
world, shared by the world and all its splits):

* every operation starts a non-blocking MPI call and completes it in :meth:`Control.wait`:
  a short spin, then sleeps that grow with the time already waited (so waiting ranks do
  not burn a core), checking the control communicator for notices as it goes;
* a rank whose program fails calls ``abort``: it sends FAIL (its rank, the reason) to every
  peer, and each peer waiting in any operation raises :class:`PeerLostError` naming it;
* a rank whose program ends sends EXIT with its operation counts per communicator; a peer
  waiting in an operation that rank never reached raises :class:`PeerLostError`;
* at the deadline, the waiting rank asks the peers of its operation what they are doing
  (QUERY); ranks waiting in meshcomm answer from their poll loop (ANSWER) with their
  operation and counts. Silent peers are named in :class:`CommTimeoutError` (with what
  ``/proc`` shows for a peer on this host: stopped, dead); a peer inside a different
  operation of the same communicator is a :class:`CollectiveMismatchError`;
* a rank that gives up because of such an error sends DOWN to its peers before ending the
  job, so that peers still waiting raise the same error instead of being killed silently.

Notices carry the sender's counts on every communicator as plain data (small, rare messages;
:mod:`.notices`: bytes that cannot carry code).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from meshcomm.plugin import (
    CollectiveMismatchError,
    CommTimeoutError,
    DistributedError,
    PeerLostError,
    crowded,
)
from mpi4py import MPI

from .notices import NoticeError, decode, encode
from .ops import Counts, Desc
from .peers import PeerTable
from .teardown import TermWatch

#: seconds an operation may still complete after a peer's failure notice arrives
_GRACE = 0.5

__all__ = ["Control", "QUERY", "ANSWER", "FAIL", "ACK", "EXIT", "DOWN"]

QUERY, ANSWER, FAIL, ACK, EXIT, DOWN = 1, 2, 3, 4, 5, 6

_ERRORS: dict[str, type[DistributedError]] = {
    "PeerLostError": PeerLostError,
    "CommTimeoutError": CommTimeoutError,
    "CollectiveMismatchError": CollectiveMismatchError,
}


def _make(cls: type[DistributedError], msg: str, peer: int | None) -> DistributedError:
    if cls in (PeerLostError, CommTimeoutError):
        return cls(msg, peer=peer)
    return cls(msg)


class Control:
    """The control side of one world (and its splits).

    Args:
        ctl: the private control communicator (a duplicate of the world).
        peers: pid and host of every world rank, or None (then ``/proc`` is not consulted).
        spin: seconds a wait spins before it starts to sleep.
        answer_wait: seconds a timed-out rank waits for peers' answers to its query.
        ft: the job runs under MPI's fault tolerance (:mod:`.survivors`): a failing rank tells
            its peers and exits instead of ending the job with MPI_Abort.
    """

    def __init__(
        self, ctl: Any, peers: PeerTable | None, *, spin: float = 1e-4, answer_wait: float = 1.0, ft: bool = False
    ) -> None:
        self.ctl = ctl
        self.ft = ft
        #: world ranks an operation of this rank timed out on (shrink ends them if they are stopped here)
        self.suspects: set[int] = set()
        self.rank = ctl.Get_rank()
        self.size = ctl.Get_size()
        self.peers = peers  # sets oversubscribed too
        self.spin = spin
        self.answer_wait = answer_wait
        self.comms: dict[str, Any] = {}  #: cid -> MPIBackend, for counts in answers and notices
        self.failed: dict[int, dict[str, Any]] = {}
        self.down: dict[int, dict[str, Any]] = {}
        self.exited: dict[int, dict[str, Any]] = {}
        self.acks: set[int] = set()
        self.current: Desc | None = None
        self.last: dict[str, Any] | None = None  #: the operation that last raised, for answers
        self.last_error: DistributedError | None = None
        self.peer_died = False  #: a peer's process is gone: its launcher ends the job itself
        self.lost = False  #: a peer is known lost or a communicator broken: MPI_Finalize could hang
        self.aborting = False
        self._status = MPI.Status()
        self._sends: list[Any] = []
        self._qid = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._diagnosing = False
        self._acked: set[int] = set()
        #: mpiexec's SIGTERM after a rank died: a waiting rank looks at its peers at once
        self.term = TermWatch()

    # -- bookkeeping ------------------------------------------------------------------------

    @property
    def peers(self) -> PeerTable | None:
        """pid and host of every world rank, or None (then ``/proc`` is not consulted)."""
        return self._peers

    @peers.setter
    def peers(self, table: PeerTable | None) -> None:
        # whether this host runs more ranks than it has cores follows from the table
        self._peers = table
        self.oversubscribed = table is not None and crowded(table.local_count)

    def register(self, backend: Any) -> None:
        self.comms[backend.cid] = backend

    def _all_counts(self) -> dict[str, tuple[int, dict[int, int], dict[int, int], str | None]]:
        out = {}
        for cid, b in self.comms.items():
            m = b.members
            out[cid] = (
                b.coll_count,
                {m[q]: n for q, n in enumerate(b.sent) if n},
                {m[q]: n for q, n in enumerate(b.recvd) if n},
                b.tail_text(),
            )
        return out

    def _counts_in(self, notice: dict[str, Any], desc: Desc) -> Counts | None:
        c = notice.get("counts", {}).get(desc.cid)
        if c is None:
            return None
        return Counts(c[0], c[1].get(desc.me_world, 0), c[2].get(desc.me_world, 0))

    def _post(self, dest: int, tag: int, obj: Any) -> None:
        try:
            data = encode(obj)
            self._sends.append((self.ctl.Isend([data, MPI.BYTE], dest=dest, tag=tag), data))
        except MPI.Exception:
            return
        if len(self._sends) > 64:
            self._sends = [s for s in self._sends if not _done(s[0])]

    def _flush_sends(self, limit: float) -> None:
        end = time.monotonic() + limit
        while self._sends and time.monotonic() < end:
            self._sends = [s for s in self._sends if not _done(s[0])]
            if self._sends:
                time.sleep(1e-3)

    def _state(self) -> dict[str, Any] | None:
        if self.current is not None:
            return {**self.current.public(), "phase": "waiting"}
        return self.last

    def _notice(self, **fields: Any) -> dict[str, Any]:
        return {"rank": self.rank, "counts": self._all_counts(), "state": self._state(), **fields}

    def probe(self) -> bool:
        """Whether a control message has arrived (its envelope in ``self._status``).

        Under MPI's fault tolerance a probe from any source fails while a peer's failure is
        not acknowledged: acknowledge it and report no message (the operations that involve
        that peer report it themselves; this one may not)."""
        try:
            return bool(self.ctl.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, self._status))
        except MPI.Exception:
            if not self.ft:
                raise
            try:
                self.ctl.Ack_failed()
            except MPI.Exception:
                pass
            return False

    # -- the wait loop ----------------------------------------------------------------------
    def wait(
        self, backend: Any, reqs: list[Any], what: tuple[Any, ...], statuses: list[Any] | None, nbytes: int = 0
    ) -> None:
        """Complete ``reqs`` (already tested once) under ``backend.timeout``, or raise.

        First a spin on the requests alone (the base spin plus what the transfer takes at
        about 1 GB/s: MPI progresses a non-blocking operation only while it is tested), with
        a look at the control communicator every 64 tests; then the watched loop.
        Raises PeerLostError, CommTimeoutError or CollectiveMismatchError naming the peer;
        the communicator is then marked broken (its collective cannot be cancelled).
        """
        test = _tester(reqs, statuses)
        start = time.monotonic()
        spin_end = start + self.spin + min(nbytes * 1e-9, 0.25)
        probe = self.probe
        yield_ = os.sched_yield if self.oversubscribed else None
        i = 0
        while True:
            if test():
                return
            i += 1
            if not i & 63 and (probe() or time.monotonic() >= spin_end or self.term.heard):
                break
            if yield_ is not None and not i & 3:  # every test: 1.1-1.25x slower (docs/backends/mpi.md)
                yield_()
        desc = Desc(backend, what)
        self.current = desc
        try:
            self._check_known(desc)
            self._loop(backend, desc, test, start)
            self.last_error = None
        except DistributedError as exc:
            self._failed_op(backend, desc, reqs, exc)
            raise
        finally:
            self.current = None

    def _loop(self, backend: Any, desc: Desc, test: Any, start: float) -> None:
        deadline = start + backend.timeout
        next_look = time.monotonic() + 0.05
        relevant = desc.asked()
        nap = 5e-5
        while True:
            if test():
                return
            if self.probe():
                try:
                    self._drain(desc)
                except DistributedError:
                    # a peer that failed *after* its part of this operation (e.g. the core's call
                    # check raised on it once the fingerprints were gathered) may have sent all
                    # this rank needs: finish the operation then, the notice is kept for the next
                    if self._completes(test, _GRACE):
                        return
                    raise
            now = time.monotonic()
            if now >= deadline:
                if self._diagnose(backend, desc, test):
                    return
                continue  # not reached: _diagnose raises unless the operation completed
            time.sleep(nap)
            nap = min(1e-3, nap * 1.25, max(5e-5, (now - start) / 8))
            if (now >= next_look or self.term.heard) and self.peers is not None:
                next_look = now + 0.1
                w = self.peers.first_dead(relevant)
                if w is not None:
                    self.peer_died = True
                    raise PeerLostError(
                        f"[mpi] rank {desc.me} waits in {desc.where}, but {desc.who(desc.local[w])} "
                        f"{self.peers.describe(w)}; the job cannot continue",
                        peer=desc.local[w],
                    )
                if self.term.heard:  # ended from outside, with every peer of this wait alive
                    self.term.pass_on()

    def _completes(self, test: Any, seconds: float) -> bool:
        """Whether the operation completes within ``seconds``; False at once when mpiexec's
        teardown has begun (its SIGTERM: the job is ending, and its SIGKILL follows in 0.25 s,
        so the error must be raised now, not after the grace)."""
        end = time.monotonic() + seconds
        while True:
            if test():
                return True
            if time.monotonic() >= end or self.term.heard:
                return False
            time.sleep(1e-3)

    def _failed_op(self, backend: Any, desc: Desc, reqs: list[Any], exc: DistributedError) -> None:
        """After an operation raised: remember it for answers, and cancel or break the communicator."""
        self.last = {**desc.public(), "phase": f"raised {type(exc).__name__}"}
        self.last_error = exc
        peer = getattr(exc, "peer", None)
        if isinstance(exc, CommTimeoutError) and peer is not None and 0 <= peer < len(backend.members):
            self.suspects.add(backend.members[peer])
        if desc.kind == "recv" and isinstance(exc, CommTimeoutError):
            try:
                reqs[0].Cancel()
                reqs[0].Wait()
                return  # the receive is withdrawn: the communicator stays usable
            except MPI.Exception:
                pass
        if desc.kind != "recv" or not isinstance(exc, CollectiveMismatchError):
            backend.broken = f"{desc.where} raised {type(exc).__name__}: {exc}"
            self.lost = True

    # -- notices ------------------------------------------------------------------------------
    def poll(self, desc: Desc | None = None) -> None:
        """Handle control messages that have arrived (answers queries while not waiting too)."""
        if self.probe():
            self._drain(desc)

    def _drain(self, desc: Desc | None) -> None:
        st = self._status
        while self.probe():
            src, tag = st.Get_source(), st.Get_tag()
            buf = bytearray(st.Get_count(MPI.BYTE))
            self.ctl.Recv([buf, MPI.BYTE], source=src, tag=tag)
            try:
                msg = decode(buf)
            except NoticeError as exc:  # only someone writing into MPI's traffic sends that
                raise DistributedError(
                    f"[mpi] rank {self.ctl.Get_rank()}: a control message from rank {src} is not plain data "
                    f"({exc}); it was not sent by meshcomm: MPI's traffic was changed on the way. The job stops."
                ) from None
            if tag == QUERY:
                b = self.comms.get(msg["cid"])
                counts = b.counts_for(src) if b is not None else None
                self._post(
                    src,
                    ANSWER,
                    {"qid": msg["qid"], "state": self._state(), "counts": None if counts is None else tuple(counts)},
                )
            elif tag == ANSWER:
                if msg["qid"] == self._qid:
                    self._answers[src] = msg
            elif tag == ACK:
                self.acks.add(src)
            elif tag == FAIL:
                self.failed.setdefault(src, msg)
                self.lost = True  # acknowledged from abort/close, once this rank's error is printed
                if desc is not None:
                    raise self._fail_error(desc, src, msg)
            elif tag == DOWN:
                self.down.setdefault(src, msg)
                self.lost = True
                if desc is not None and not self._diagnosing:
                    raise self._down_error(desc, src, msg)
            elif tag == EXIT:
                self.exited.setdefault(src, msg)
                if desc is not None and not self._diagnosing:
                    self._check_exit(desc, src, msg)

    def check_notices(self, backend: Any, what: tuple[Any, ...]) -> None:
        """After collective ``what`` completed: raise if a peer gave up on it (its DOWN
        notice), failed inside it (its FAIL notice names this operation), or exited before it.

        A collective started beside its call check can complete on a rank that resumes after
        its peers gave up on it (their requests were posted before they timed out): such a
        rank must raise as they did, not return the result (one Iprobe when nothing is known).
        A peer that failed *after* its part of this collective (its program raised once the
        collective returned there) makes the next operation raise instead: this one's result
        is whole."""
        if self.failed or self.down or self.probe():
            desc = Desc(backend, what)
            self._drain(None)  # collect; judged below against this completed operation
            self._check_known(desc, completed=True)

    @staticmethod
    def _failed_inside(desc: Desc, w: int, msg: dict[str, Any]) -> bool:
        """Whether the FAIL notice of world rank ``w`` places it inside operation ``desc``."""
        if w not in desc.asked():
            return False
        state = msg.get("state") or {}
        return state.get("kind") == desc.kind and state.get("cid") == desc.cid and state.get("seq") == desc.seq

    def _check_known(self, desc: Desc, completed: bool = False) -> None:
        """Raise at once for a peer already known to have failed, given up, or exited; after
        a ``completed`` operation, a failure counts only if it happened inside it."""
        for w, msg in self.failed.items():
            if not completed or self._failed_inside(desc, w, msg):
                raise self._fail_error(desc, w, msg)
        for w, msg in self.down.items():
            raise self._down_error(desc, w, msg)
        for w, msg in self.exited.items():
            self._check_exit(desc, w, msg)

    def _peer_name(self, desc: Desc, w: int) -> tuple[str, int]:
        q = desc.local.get(w)
        return (desc.who(q), q) if q is not None else (f"world rank {w}", w)

    def _fail_error(self, desc: Desc, w: int, msg: dict[str, Any]) -> PeerLostError:
        name, peer = self._peer_name(desc, w)
        reason = str(msg.get("reason"))
        code = "" if "exit code" in reason else f" (exit code {msg.get('code')})"
        return PeerLostError(
            f"[mpi] {name} failed while rank {desc.me} waits in {desc.where}: {reason}{code}; "
            f"the job is ending. Fix the error on {name} (its own output shows the traceback)",
            peer=peer,
        )

    def _down_error(self, desc: Desc, w: int, msg: dict[str, Any]) -> DistributedError:
        name, _ = self._peer_name(desc, w)
        culprit = msg.get("peer")
        peer = desc.local.get(culprit, culprit) if culprit is not None else None
        cls = _ERRORS.get(msg.get("cls", ""), PeerLostError)
        text = (
            f"[mpi] rank {desc.me} waits in {desc.where}, but {name} gave up and is ending the job "
            f"because: {msg.get('msg')}"
        )
        return _make(cls, text, peer)

    def _check_exit(self, desc: Desc, w: int, msg: dict[str, Any]) -> None:
        if w not in desc.asked():
            return
        counts = self._counts_in(msg, desc)
        if counts is not None and desc.joined(w, counts):
            return
        name, peer = self._peer_name(desc, w)
        self.lost = True
        entry = msg.get("counts", {}).get(desc.cid)
        tail = entry[3] if entry is not None and len(entry) > 3 else None
        if desc.kind == "coll" and tail is not None:
            raise CollectiveMismatchError(
                f"[mpi] {name} called {tail} on {desc.label} where rank {desc.me} calls {desc.text}, "
                f"and then its program ended: the ranks called different operations; make every rank "
                "call the same collectives in the same order, and match each send with a recv"
            )
        raise PeerLostError(
            f"[mpi] {name} exited (its program ended) while rank {desc.me} waits in {desc.where}, "
            f"an operation {name} never reached; make every rank run the same sequence of "
            "collectives (and matching sends and receives) before it ends",
            peer=peer,
        )

    # -- the deadline ------------------------------------------------------------------------
    def _diagnose(self, backend: Any, desc: Desc, test: Any) -> bool:
        """Ask the operation's peers what they do; True if the operation completed meanwhile."""
        self._qid += 1
        self._answers = {}
        asked = desc.asked()
        query = {"qid": self._qid, "cid": desc.cid, "state": desc.public()}
        for w in asked:
            self._post(w, QUERY, query)
        self._diagnosing = True
        try:
            end = time.monotonic() + self.answer_wait
            while time.monotonic() < end:
                if test():
                    return True
                self.poll(desc)
                if all(w in self._answers or w in self.down or w in self.exited for w in asked):
                    break
                time.sleep(1e-3)
        finally:
            self._diagnosing = False
        raise self._verdict(backend, desc, asked)

    def _verdict(self, backend: Any, desc: Desc, asked: list[int]) -> DistributedError:
        dead: list[tuple[int, str]] = []
        missing: list[tuple[int, str]] = []
        mismatch: list[tuple[int, str]] = []
        blocked: list[tuple[int, str]] = []
        for w in asked:
            name, _ = self._peer_name(desc, w)
            a = self._answers.get(w) or self.down.get(w) or self.exited.get(w)
            if a is None:
                state = self.peers.state(w) if self.peers is not None else None
                why = self.peers.describe(w) if self.peers is not None else "did not answer"
                (dead if state == "dead" else missing).append((w, f"{name} {why}"))
                continue
            if w in self.exited and a is self.exited[w]:
                counts = self._counts_in(a, desc)
                if counts is None or not desc.joined(w, counts):
                    dead.append((w, f"{name} exited (its program ended) before it reached this operation"))
                continue
            if w in self._answers:
                counts = Counts(*a["counts"]) if a.get("counts") is not None else None
            else:  # a DOWN notice: the peer's counts on every communicator
                counts = self._counts_in(a, desc)
            if counts is not None and desc.joined(w, counts):
                continue
            st = a.get("state")
            if st is None:
                missing.append((w, f"{name} answered but is not inside a meshcomm operation"))
            elif st["cid"] == desc.cid:
                mismatch.append((w, f"{name} is in {st['text']} ({st.get('phase', 'waiting')})"))
            else:
                blocked.append((w, f"{name} waits in {st['text']} on {st['label']}"))
        head = f"[mpi] rank {desc.me} waited {backend.timeout:g} s (MLX_TIMEOUT) in {desc.where}"
        fix = "; raise MLX_TIMEOUT if the peer is only slow, otherwise fix or restart it"
        if dead:
            self.peer_died = any("died" in t for _, t in dead)
            return PeerLostError(
                f"{head}: {'; '.join(t for _, t in dead)}; the job cannot continue",
                peer=self._peer_name(desc, dead[0][0])[1],
            )
        if missing:
            return CommTimeoutError(
                f"{head}: {'; '.join(t for _, t in missing)}{fix}", peer=self._peer_name(desc, missing[0][0])[1]
            )
        if mismatch:
            return CollectiveMismatchError(
                f"{head}, but {'; '.join(t for _, t in mismatch)}: the ranks called different operations "
                f"on {desc.label} (rank {desc.me}'s {desc.text} against "
                f"{', '.join(self._peer_name(desc, w)[0] for w, _ in mismatch)}); make every rank call the "
                "same collectives in the same order, and match each send with a recv"
            )
        if blocked:
            return CommTimeoutError(
                f"{head}: {'; '.join(t for _, t in blocked)}: the ranks wait on each "
                "other in a different order (a deadlock)",
                peer=self._peer_name(desc, blocked[0][0])[1],
            )
        return CommTimeoutError(
            f"{head}: every peer has joined it but it did not complete (MPI is "
            "stalled or the network is too slow for this timeout){fix}",
            peer=None,
        )

    # -- ending -------------------------------------------------------------------------------
    def linger(self, seconds: float, done: Any) -> None:
        """Answer queries and acknowledge notices for up to ``seconds`` or until ``done()``."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not done():
            try:
                self.poll(None)
            except (MPI.Exception, DistributedError):  # DistributedError: a notice that is not plain data
                return
            time.sleep(2e-3)

    def abort(self, code: int, reason: str) -> None:
        """End the job with ``code`` after telling the peers (see module docstring)."""
        if self.aborting or self.size == 1 or MPI.Is_finalized():
            return
        self.aborting = True
        others = [w for w in range(self.size) if w != self.rank]
        first_hand = False
        if self.ft:
            self._leave(code, reason, others)

        def everyone_knows() -> bool:
            return all(w in self.acks or w in self.down or w in self.exited or w in self.failed for w in others)

        try:
            self.poll(None)
        except (MPI.Exception, DistributedError):  # the job ends anyway: never skip the abort
            pass
        if not self.failed and self.last_error is not None:
            exc = self.last_error
            peer = getattr(exc, "peer", None)
            cur = self.last or {}
            b = self.comms.get(cur.get("cid", "world"))
            world_peer = b.members[peer] if (b is not None and peer is not None and peer < len(b.members)) else peer
            notice = self._notice(code=code, cls=type(exc).__name__, peer=world_peer, msg=str(exc))
            for w in others:
                self._post(w, DOWN, notice)
            if self.peer_died:
                # mpiexec ends a job whose process died, with that process's status: let it
                self.linger(5.0, lambda: bool(self.failed))
            self.linger(1.5, lambda: everyone_knows() or bool(self.failed))
            if not self.failed:
                self.linger(0.3, lambda: bool(self.failed))  # the peers' last output is on its way
        elif not self.failed:
            notice = self._notice(code=code, reason=reason)
            for w in others:
                self._post(w, FAIL, notice)
            self.linger(2.0, everyone_knows)
            self.linger(0.3, lambda: False)  # the peers' last output is on its way to mpiexec
            # peers that failed at the same moment (a mismatch every rank sees): the lowest
            # of them ends the job at once, the others let it (below)
            first_hand = bool(self.failed) and self.rank < min(self.failed)
        if first_hand:
            self.acknowledge()
        elif self.failed:
            # another rank failed first and ends the job with its own exit code: let it,
            # and only end the job here if it has not done so in a few seconds
            _flush_std()
            self.acknowledge()
            first = min(self.failed.items(), key=lambda kv: kv[0])[1]
            code = int(first.get("code") or code)
            self.linger(4.0, lambda: False)
        _flush_std()
        _unlink_shared_memory()
        _exit_if_abort_hangs(code)
        MPI.COMM_WORLD.Abort(code)

    def _leave(self, code: int, reason: str, others: list[int]) -> None:
        """Under MPI's fault tolerance the survivors go on: tell them why this rank fails (each
        raises PeerLostError naming it), then end only this process (MPI_Abort would end them too)."""
        notice = self._notice(code=code, reason=reason)
        for w in others:
            self._post(w, FAIL, notice)
        self._flush_sends(0.5)
        _flush_std()
        _unlink_shared_memory()
        os._exit(code)

    def acknowledge(self) -> None:
        """Tell every rank whose FAIL notice arrived that this rank has printed its error."""
        for w in self.failed:
            if w not in self._acked:
                self._acked.add(w)
                self._post(w, ACK, None)
        self._flush_sends(0.2)

    def watch_teardown(self) -> None:
        """Under mpiexec (without fault tolerance): a SIGTERM while this rank waits makes the
        wait look at its peers at once (:mod:`.teardown`)."""
        if not self.ft and self.peers is not None:
            self.term.install(lambda: self.current is not None, self._lost_now)

    def _lost_now(self) -> DistributedError | None:
        """A dead local peer, as the error to raise outside a wait, if this rank has not
        reported a failure yet (then mpiexec's SIGTERM ends it as before)."""
        if self.peers is None or self.peer_died or self.aborting or self.last_error is not None:
            return None
        w = self.peers.first_dead(q for q in range(self.size) if q != self.rank)
        if w is None:
            return None
        self.peer_died = True
        return PeerLostError(
            f"[mpi] rank {self.rank}: rank {w} {self.peers.describe(w)}; mpiexec is ending the job", peer=w
        )

    def exit_notice(self) -> None:
        """Tell every peer this rank's program ended, with its counts (called by ``close``)."""
        if self.size == 1 or MPI.Is_finalized():
            return
        notice = self._notice()
        for w in range(self.size):
            if w != self.rank:
                self._post(w, EXIT, notice)
        self._flush_sends(0.5)


def _done(req: Any) -> bool:
    try:
        return bool(req.Test())
    except MPI.Exception:
        return True


def _tester(reqs: list[Any], statuses: list[Any] | None) -> Any:
    if len(reqs) == 1:
        req = reqs[0]
        st = statuses[0] if statuses else None
        return (lambda: req.Test(st)) if st is not None else req.Test
    return lambda: MPI.Request.Testall(reqs, statuses)


def _flush_std() -> None:
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass


def _exit_if_abort_hangs(code: int, after: float = 5.0) -> None:
    """MPI_Abort should end the job at once; once in many runs Open MPI's did not return or
    kill this process (a peer already in MPI_Finalize). End the process ourselves then: with
    ``code`` from a thread, and by SIGALRM's default action if the thread cannot run."""

    def _exit() -> None:
        time.sleep(after)
        os._exit(code)

    threading.Thread(target=_exit, name="meshcomm-abort-watchdog", daemon=True).start()
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, after + 3.0)
    except ValueError:  # not the main thread: the thread above is the only guard
        pass


#: the MPI libraries' shared-memory files (Open MPI 5, Open MPI 4, MPICH)
_MPI_SHM = ("sm_segment.", "vader_segment.", "mpich_shm_")


def _unlink_shared_memory() -> None:
    """Remove the names of the MPI library's shared-memory files this process maps: they are
    unlinked only by MPI_Finalize, so every aborted job would leave them in /dev/shm. The
    job is ending; peers keep their mappings, only the names go."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return
    for line in lines:
        i = line.find("/dev/shm/")
        if i < 0 or line.endswith("(deleted)"):
            continue
        name = line[i + len("/dev/shm/") :].strip()
        if name.startswith(_MPI_SHM) and "/" not in name:
            try:
                os.unlink("/dev/shm/" + name)
            except OSError:
                pass
