"""The data plane: framed, checked, non-blocking transfers over the mesh of connections.

One thread per rank drives every transfer: it queues frames to send and frames it
expects, then writes and reads whatever the sockets accept; when no socket can make
progress it polls without sleeping for at most ``MESHCOMM_SOCKETS_SPIN_US``, then waits in
``poll`` in the kernel. A callback runs as soon
as an expected frame has fully arrived, so a ring can reduce one chunk while the kernel
is still moving the next ones.

Every received header is authenticated first (its tag under the connection's key and
the frame's counter, see wire.py; a frame that fails is :class:`FrameAuthError`, and
whatever it said is not used), then compared with what this rank expects (group,
sequence number, operation, dtype, sizes); any difference raises
:class:`CollectiveMismatchError` naming both ranks and both calls. Payload tags, where the
frame has one, are checked before the payload is handed on (a callback, or the caller).
The first failure (peer lost, timeout, mismatch, a forged frame) is reported to every
other rank with an ABORT frame (itself authenticated, message included), so all
survivors raise instead of waiting.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import select
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
from meshcomm.plugin import (
    CollectiveMismatchError,
    CommTimeoutError,
    DistributedError,
    PeerLostError,
    dtype_from_code,
)

from . import wire

if TYPE_CHECKING:
    from .dialing import Dialer

__all__ = ["Call", "Fabric", "Link", "FrameAuthError"]

_POLLIN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
_POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP
_IOV = 64  # buffers handed to one sendmsg
_MAX_ABORT = 4096
_ABORT_CLASS: dict[int, type[DistributedError]] = {
    1: PeerLostError,
    2: CommTimeoutError,
    3: CollectiveMismatchError,
    4: DistributedError,
}
_KIND_OF = {PeerLostError: 1, CommTimeoutError: 2, CollectiveMismatchError: 3}
#: longest single wait in the kernel: any MLX_TIMEOUT (even inf) is waited for in slices,
#: since poll() takes an int of milliseconds and socket timeouts a time_t
WAIT_SLICE = 3600.0
#: a wait that returned this much later than asked means this rank did not run (SIGSTOP,
#: a debugger, a starved machine): its peers may have given up on it meanwhile
_STALL = 1.0
#: seconds to finish a half-sent frame (so an ABORT after it is read as one) when failing
_FINISH_FRAME = 2.0
# after a failure, how long close() reads what peers still send before closing: closing with
# unread data makes the kernel send a reset, which can destroy the ABORT still in flight
_LINGER = 0.5
#: monotonic time this process was last resumed after a stop (SIGCONT), 0 if never
_resumed = [0.0]
#: ``Link.starts`` entry of a buffer that continues a frame (frame starts hold their counter)
_CONT = -1
#: largest frame of :meth:`Fabric.exchange`'s short path (above it the general loop was
#: measured faster: a 16 MiB send/recv on 2 ranks 3.7-4.1 ms against 5.0 ms)
SHORT_BYTES = 256 * 1024


class FrameAuthError(DistributedError):
    """A frame failed authentication: its bytes were changed on the way, or it was not sent
    by the peer this connection was opened with. Its contents were not used."""


def _on_sigcont(signum: int, frame: object) -> None:
    _resumed[0] = time.monotonic()


def watch_resume() -> None:
    """Note when this process is resumed after SIGSTOP/Ctrl-Z (a SIGCONT handler), so a rank
    whose peers gave up on it while it was stopped can be told so; left alone when the
    program handles SIGCONT itself or this is not the main thread."""
    try:
        if signal.getsignal(signal.SIGCONT) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGCONT, _on_sigcont)
    except (ValueError, OSError, AttributeError):
        pass


class Call:
    """The operation a frame belongs to; identical on every rank taking part in it.

    ``arg`` is the call's argument every rank must agree on: the root of a rooted
    operation, else 0. ``owner`` is the backend that made it: messages name the user's call
    it tells (:meth:`meshcomm.plugin.Backend.call_text`), not the wire's own ``seq``, which
    counts meshcomm's internal calls too. Never changed once made (a plain class, not a
    frozen dataclass: one is made per call, and this is the latency path)."""

    __slots__ = ("group", "seq", "op", "dtype", "total", "label", "arg", "owner")

    def __init__(
        self, group: int, seq: int, op: int, dtype: int, total: int, label: str, arg: int = 0, owner: Any = None
    ) -> None:
        self.group, self.seq, self.op, self.dtype, self.total, self.label, self.arg, self.owner = (
            group,
            seq,
            op,
            dtype,
            total,
            label,
            arg,
            owner,
        )

    def __repr__(self) -> str:
        return f"Call({self.label} {self.describe()}, group {self.group})"

    def named(self) -> bool:
        """True when messages name this call by the user's call (not by the wire's number)."""
        return self.owner is not None and bool(self.owner.user_op)

    def describe(self) -> str:
        """``all_sum #2 (4 x float32)``: the user's call and number when known (see ``owner``)."""
        name = self.owner.call_text(_op_name(self.op)) if self.named() else None
        return _describe(self.op, self.seq, self.dtype, self.total, self.arg, name)

    def theirs(self, op: int, seq: int, dtype: int, total: int, arg: int) -> str:
        """What a peer's header or descriptor for (``op``, ``seq``, ...) is, next to this call:
        by the wire's number only when this call is named that way too (the peer's own call
        number is not on the wire), else whether it belongs to an earlier or later call."""
        if not self.named():
            return _describe(op, seq, dtype, total, arg)
        when = "" if seq == self.seq else " of an earlier call" if _before(seq, self.seq) else " of a later call"
        return _describe(op, None, dtype, total, arg) + when


#: operations whose argument is a root (named in messages)
_ROOTED = {wire.OP_CODES["broadcast"]}


def _op_name(op: int) -> str:
    return wire.OPS[op] if 0 <= op < len(wire.OPS) else f"op#{op}"


def _before(seq: int, other: int) -> bool:
    """Whether wire number ``seq`` came before ``other`` (numbers wrap at wire.SEQ_MASK)."""
    return 0 < (other - seq) & wire.SEQ_MASK < (wire.SEQ_MASK + 1) // 2


def _describe(op: int, seq: int | None, dtype: int, total: int, arg: int = 0, name: str | None = None) -> str:
    """``all_sum #5 (4 x float32)``; ``name`` replaces ``all_sum #5``, ``seq`` None drops the number."""
    if name is None:
        name = _op_name(op) if seq is None else f"{_op_name(op)} #{seq}"
    dt = dtype_from_code(dtype)
    root = f", root {arg}" if op in _ROOTED or arg else ""
    count = total & wire.COUNT_MASK
    what = f"{count} x {dt if dt is not None else 'bytes' if dtype == 0 else dtype}{root}"
    return f"{name[:-1]}: {what})" if name.endswith(")") else f"{name} ({what})"


def shape_differs(mine: int, theirs: int) -> str:
    """What to add to a mismatch message when two totals differ only in the shape key."""
    if mine != theirs and (mine ^ theirs) & wire.COUNT_MASK == 0:
        return (
            " with the same number of elements in another shape (arrays are never reinterpreted: "
            "reshape them alike on every rank)"
        )
    return ""


class _Expect:
    __slots__ = ("call", "target", "done", "sealed")

    def __init__(self, call: Call, target: memoryview, done: Callable[[], None] | None, sealed: bool = False) -> None:
        self.call, self.target, self.done, self.sealed = call, target, done, sealed


def is_loopback(sock: socket.socket) -> bool:
    """True when the connection cannot leave this host (its peer address is loopback): no
    one off the host can be on its path."""
    try:
        return ipaddress.ip_address(sock.getpeername()[0]).is_loopback
    except (OSError, ValueError, IndexError, TypeError):
        return False


class Link:
    """The connection to one peer, with its send queue, its expected frames, and the keys
    and frame counters of both directions."""

    __slots__ = (
        "peer",
        "sock",
        "fd",
        "where",
        "out",
        "starts",
        "expect",
        "cur",
        "hdr",
        "hdr_mv",
        "hdr_got",
        "got",
        "checked",
        "send_blocked",
        "recv_blocked",
        "closed",
        "send_mac",
        "recv_mac",
        "send_ctr",
        "recv_ctr",
        "tail",
        "tail_mv",
        "tail_got",
        "seal_payload",
        "ended",
        "heard",
    )

    def __init__(self, peer: int, sock: socket.socket, send_key: bytes = b"", recv_key: bytes = b"") -> None:
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        try:
            self.where = "{}:{}".format(*sock.getpeername()[:2])
        except OSError:
            self.where = "?"
        self.out: deque[memoryview] = deque()
        #: per entry of ``out``: the frame counter where it begins a frame, else _CONT
        self.starts: deque[int] = deque()
        self.expect: deque[_Expect] = deque()
        self.cur: _Expect | None = None
        self.hdr = bytearray(wire.FRAME_HEAD)
        self.hdr_mv = memoryview(self.hdr)
        self.hdr_got = 0
        self.tail = bytearray(wire.TAG)
        self.tail_mv = memoryview(self.tail)
        self.tail_got = 0
        #: every data frame's payload carries a tag (decided by the Fabric)
        self.seal_payload = True
        #: the peer said its program ended normally (an ABORT frame of kind wire.ENDED)
        self.ended = False
        #: when this rank began to wait for the peer's data, or last received a whole frame of it
        #: (monotonic; set by post_recv, _short and _recv)
        self.heard = 0.0
        self.send_mac = wire.Mac(send_key)
        self.recv_mac = wire.Mac(recv_key)
        #: frames queued to send so far (the next one's counter); frames received so far
        self.send_ctr = 0
        self.recv_ctr = 0
        self.got = 0
        self.checked = False
        self.send_blocked = False
        self.recv_blocked = False
        self.closed = False


def as_bytes(buf: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (works for every dtype, bfloat16 included)."""
    return memoryview(buf.view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers


class Fabric:
    """This rank's connections to every other rank of the world, and the transfer loop."""

    def __init__(
        self,
        rank: int,
        size: int,
        socks: dict[int, socket.socket],
        timeout: float,
        keys: dict[int, tuple[bytes, bytes]] | None = None,
        payload_integrity: bool | None = True,
        direct: Container[int] = (),
    ) -> None:
        """``keys``: per peer (send key, receive key) from the handshake (empty keys without);
        ``payload_integrity``: every data frame's payload carries a tag (else only headers,
        ABORT frames and frames sent inside :meth:`sealed`); None decides per link: no tags
        only on a loopback link that is ``direct`` (the peers in it: both ends saw the same
        addresses and ports in the handshake, so no relay sits on it), which both ends
        decide alike."""
        self.rank = rank
        self.size = size
        self.timeout = timeout
        keys = keys or {}
        self._integrity = payload_integrity
        self.links: dict[int, Link] = {}
        for q, sock in socks.items():
            self._add(q, sock, *keys.get(q, (b"", b"")), direct=q in direct)
        #: makes the connections this rank did not make at start-up, when first needed
        #: (:mod:`.dialing`); None: every rank connected to every other at start-up
        self.dialer: Dialer | None = None
        self._sealing = 0
        self.failure: DistributedError | None = None
        #: seconds a waiting rank polls without sleeping (see topology.wait_policy), also in ns
        self.spin, self.spin_ns = 0.0, 0
        #: give the core away on every spin (ranks outnumber this host's cores)
        self.yielding = False
        #: (when it ended, how long) of the last time this rank overslept a wait (see note_stall)
        self.stall = (0.0, 0.0)
        self._scanning = False
        #: the resume (_resumed) that check() last looked after
        self._resume_seen = _resumed[0]
        watch_resume()

    def _add(self, q: int, sock: socket.socket, send_key: bytes, recv_key: bytes, *, direct: bool) -> Link:
        if q in self.links:  # one connection per pair (dialing.Dialer keeps it so): a second is a bug
            sock.close()
            raise DistributedError(f"rank {self.rank}: a second connection to rank {q} (a meshcomm bug: report it)")
        link = self.links[q] = Link(q, sock, send_key, recv_key)
        integrity = self._integrity
        link.seal_payload = not (direct and is_loopback(sock)) if integrity is None else integrity
        return link

    def link_to(self, q: int) -> Link:
        """The link to world rank ``q``, connected now if this rank has none yet (the first
        operation that needs it; a failure to connect is this rank's first failure)."""
        link = self.links.get(q)
        if link is not None:
            return link
        if self.dialer is None:  # every link was made with the world: a missing one is a lost member
            raise self.failure or DistributedError(
                f"rank {self.rank}: no connection to rank {q} in this world (a meshcomm bug: report it)"
            )
        self.check()
        try:
            conn = self.dialer.connection(q)
        except DistributedError as exc:
            # q may be gone because of a third rank, whose ABORT names it: that one wins
            mine = self.pending_abort() if isinstance(exc, PeerLostError) else None
            self.fail(mine or exc)
            raise (mine or exc) from None
        self.adopt()
        return self._add(q, conn.sock, conn.send_key, conn.recv_key, direct=conn.direct)

    def link_all(self, peers: list[int]) -> list[Link]:
        """The links to ``peers``, which all connect to each other at this moment (a host's
        ranks setting up shared memory): the missing ones made together, as at start-up
        (the higher rank of each pair dials, several at once), not one by one."""
        if self.dialer is not None:
            self.adopt()
            missing = {q for q in peers if q not in self.links}
            if missing:
                self.check()
                try:
                    conns = self.dialer.start(missing)
                except DistributedError as exc:
                    self.fail(exc)
                    raise
                self.adopt()
                for q, c in conns.items():
                    self._add(q, c.sock, c.send_key, c.recv_key, direct=c.direct)
        return [self.link_to(q) for q in peers]

    def adopt(self) -> None:
        """Take the connections peers made to this rank since the last look (they carry their
        frames, and this rank's failure notices must reach them)."""
        if self.dialer is not None:
            for q, c in self.dialer.arrived().items():
                self._add(q, c.sock, c.send_key, c.recv_key, direct=c.direct)

    # -- queueing -----------------------------------------------------------------------
    @contextmanager
    def sealed(self) -> Iterator[None]:
        """Every frame queued inside carries a payload tag whatever the integrity setting:
        for exchanges that steer the job (shared-memory set-up, group membership). Every
        rank taking part must enter it around the same calls."""
        self._sealing += 1
        try:
            yield
        finally:
            self._sealing -= 1

    def _seals(self, link: Link, nbytes: int) -> bool:
        return nbytes > 0 and (link.seal_payload or self._sealing > 0)

    def post_send(self, link: Link, call: Call, payload: memoryview, frame: int) -> None:
        """Queue ``payload`` to ``link`` as frames of at most ``frame`` bytes (tags computed
        now: the caller does not change a buffer it queued); an empty payload is one frame."""
        n = len(payload)
        seal = self._seals(link, n)
        for lo in range(0, max(n, 1), frame):
            self._queue(link, *self._frame(link, call, payload[lo : lo + frame], seal))

    def _frame(self, link: Link, call: Call, part: memoryview, seal: bool) -> tuple[int, list[bytes | memoryview]]:
        """The next frame to ``link`` carrying ``part``: its counter, and its buffers (the
        header with its tag, the payload, the payload's tag when ``seal``)."""
        ctr, link.send_ctr = link.send_ctr, link.send_ctr + 1
        mac = link.send_mac
        parts: list[bytes | memoryview] = [
            mac.seal(ctr, wire.HEADER.pack(call.group, call.seq, call.op, call.dtype, len(part), call.arg, call.total))
        ]
        if len(part):
            parts.append(part)
            if seal:
                parts.append(mac.tag(b"P", ctr, part))
        return ctr, parts

    @staticmethod
    def _queue(link: Link, ctr: int, parts: list[bytes | memoryview], sent: int = 0) -> None:
        """Queue frame ``ctr``'s buffers on ``link`` but their first ``sent`` bytes (already
        written), marking where the frame starts if none of it was written."""
        for i, part in enumerate(parts):
            if sent >= len(part):
                sent -= len(part)
                continue
            link.starts.append(ctr if i == 0 and not sent else _CONT)
            link.out.append(memoryview(part)[sent:])
            sent = 0

    def post_recv(
        self, link: Link, call: Call, target: memoryview, frame: int, done: Callable[[], None] | None = None
    ) -> None:
        """Expect ``target`` from ``link`` as frames of at most ``frame`` bytes."""
        if link.cur is None and not link.expect:  # the wait for this peer begins
            link.heard = time.monotonic()
        n = len(target)
        if n == 0:
            link.expect.append(_Expect(call, target, done))
            return
        seal = self._seals(link, n)
        for lo in range(0, n, frame):
            last = lo + frame >= n
            link.expect.append(_Expect(call, target[lo : lo + frame], done if last else None, seal))

    def exchange(
        self,
        link: Link,
        out: Call | None,
        payload: memoryview | None,
        inc: Call | None,
        target: memoryview | None,
        frame: int,
    ) -> None:
        """Send ``payload`` (call ``out``) to ``link``'s peer and receive ``target`` (call
        ``inc``) from it, in frames of at most ``frame`` bytes; either may be None (a send
        or a recv alone). This is every point-to-point transfer and every round of a small
        reduction. When each is one frame of at most SHORT_BYTES and the link is idle it
        takes the short path (:meth:`_short`); otherwise both are queued for the general
        loop. Both paths put the same bytes on the wire."""
        limit = min(frame, SHORT_BYTES)
        if (
            link.out
            or link.cur is not None
            or link.expect
            or (payload is not None and len(payload) > limit)
            or (target is not None and len(target) > limit)
        ):
            if out is not None and payload is not None:
                self.post_send(link, out, payload, frame)
            if inc is not None and target is not None:
                self.post_recv(link, inc, target, frame)
            self.progress([link])
            return
        self._guarded(self._short, link, out, payload, inc, target)

    def _short(
        self, link: Link, out: Call | None, payload: memoryview | None, inc: Call | None, target: memoryview | None
    ) -> None:
        """One ``sendmsg`` of the whole frame, then reads spinning on the socket itself for
        the bounded spin; whatever does not move at once (a frame the socket did not take
        whole, a reply later than the spin) goes on in the general loop from the same
        state, its spin spent."""
        if out is not None and payload is not None:
            self._send_frame(link, out, payload)
        start = time.monotonic()
        if inc is not None and target is not None:
            link.cur = _Expect(inc, target, None, self._seals(link, len(target)))
            link.hdr_got = link.got = link.tail_got = 0
            link.checked = False
            link.heard = start  # the wait for this peer begins
        until, yielding = start + self.spin, self.yielding
        while True:
            if link.cur is not None:
                self._recv(link)
            if link.out:
                self._send(link)
            elif link.cur is None:
                return
            if time.monotonic() >= until:
                break
            if yielding:
                os.sched_yield()
        self._progress([link], start, spun=True)

    def _send_frame(self, link: Link, call: Call, payload: memoryview) -> None:
        """One frame written at once when the socket takes it all; the rest of it queued as
        :meth:`post_send` would have queued it."""
        ctr, parts = self._frame(link, call, payload, self._seals(link, len(payload)))
        try:
            sent = link.sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise self._lost(link, f"connection reset ({exc.strerror})") from None
        except OSError as exc:
            raise self._lost(link, f"send failed ({exc.strerror})") from None
        self._queue(link, ctr, parts, sent)

    # -- the loop -----------------------------------------------------------------------
    def progress(self, links: list[Link]) -> None:
        """Move data until every queued frame of ``links`` is sent and every expected one
        received; raise (after telling every peer) on loss, timeout or mismatch.

        One thread does it all (a helper thread that sent while this one received was
        measured slower, see docs/sockets.md)."""
        self._guarded(self._progress, links)

    def _guarded(self, move: Callable[..., None], *args: object) -> None:
        """``move(*args)`` after an earlier failure's check; any failure inside is told to
        every peer before it is raised."""
        self.check()
        try:
            move(*args)
        except DistributedError as exc:
            self.fail(exc)
            raise
        except BaseException as exc:  # KeyboardInterrupt, MemoryError...: streams are now unusable
            self.fail(DistributedError(f"rank {self.rank}: interrupted mid-transfer ({type(exc).__name__})"))
            raise

    def _progress(self, links: list[Link], entered: float | None = None, spun: bool = False) -> None:
        """The loop itself: send what is queued and receive what is expected on ``links``
        (``entered``: when the wait began, if earlier; ``spun``: its spin is spent)."""
        poller: select.poll | None = None
        registered: dict[int, int] = {}
        last = tick = time.monotonic()
        if entered is None:
            entered = last
        spin = 0.0 if spun else self.spin
        asked = 0.0
        while True:
            self.note_stall(tick, asked)  # one round never takes long unless this rank was stopped
            tick, asked = time.monotonic(), 0.0
            pending = False
            moved = False
            for link in links:
                if link.out and not link.send_blocked:
                    moved |= self._send(link)
                if (link.cur is not None or link.expect) and not link.recv_blocked:
                    moved |= self._recv(link)
            wanted: dict[int, int] = {}
            runnable = False
            for link in links:
                ev = 0
                if link.out:
                    pending = True
                    if link.send_blocked:
                        ev |= _POLLOUT
                    else:
                        runnable = True
                if link.cur is not None or link.expect:
                    pending = True
                    if link.recv_blocked:
                        ev |= _POLLIN
                    else:
                        runnable = True
                if ev:
                    wanted[link.fd] = wanted.get(link.fd, 0) | ev
            now = time.monotonic()
            if moved:
                last = now
            if not pending:
                return
            if runnable:
                continue  # a callback queued work on a link already visited: no need to wait
            if poller is None:
                poller = select.poll()
            for fd, ev in wanted.items():
                if registered.get(fd) != ev:
                    if fd in registered:
                        poller.modify(fd, ev)
                    else:
                        poller.register(fd, ev)
                    registered[fd] = ev
            for fd in [fd for fd in registered if fd not in wanted]:
                poller.unregister(fd)
                del registered[fd]
            left = self.timeout - (now - last)
            wait_ms = int(min(left, WAIT_SLICE) * 1000) + 1 if left > 0 else 0
            if now - entered < spin:  # a short bounded spin first: waking up costs more
                if self.yielding:
                    os.sched_yield()
                wait_ms = 0
            asked = wait_ms / 1000
            ready = poller.poll(wait_ms)
            if not ready:
                if time.monotonic() - last >= self.timeout:
                    self._timeout(links)
                continue
            for fd, ev in ready:
                for link in links:
                    if link.fd == fd:
                        if ev & _POLLOUT:
                            link.send_blocked = False
                        if ev & _POLLIN:
                            link.recv_blocked = False

    def note_stall(self, asked_at: float, asked: float) -> None:
        """Remember when a wait of ``asked`` seconds begun at ``asked_at`` returned much later
        than asked: this rank was not running (stopped, or starved of CPU)."""
        now = time.monotonic()
        over = now - asked_at - asked
        if over > _STALL:
            self.stall = (now, over)

    def _stalled_how(self) -> str | None:
        """How this rank itself was not running lately, long enough that its peers may have
        given up on it (stopped and resumed, or starved), or None."""
        ended, took = self.stall
        now = time.monotonic()
        if _resumed[0] and now - _resumed[0] <= 5.0:
            return f"was stopped (SIGSTOP or Ctrl-Z) and resumed {now - _resumed[0]:.1f} s ago"
        if took >= max(_STALL, 0.5 * self.timeout) and now - ended <= 5.0:
            return f"did not run for {took:.1f} s (it was stopped, or starved of CPU)"
        return None

    def stalled(self) -> bool:
        """Whether this rank itself was not running lately (see :meth:`stalled_error`)."""
        return self._stalled_how() is not None

    def stalled_error(self, what: str) -> CommTimeoutError | None:
        """The error to raise instead of blaming a peer when this rank itself was not running
        for long enough that its peers may have given up on it (``what``: what went wrong)."""
        how = self._stalled_how()
        if how is None:
            return None
        return CommTimeoutError(
            f"rank {self.rank}: this rank {how}, and then {what}: the peers gave up waiting for this rank: "
            f"it was stopped or too slow for MLX_TIMEOUT={self.timeout:g}. Resume stopped ranks "
            "within MLX_TIMEOUT, or raise MLX_TIMEOUT.",
            peer=self.rank,
        )

    def pending_abort(self) -> DistributedError | None:
        """The error of an ABORT frame waiting unread at a frame boundary of some link (a
        peer's report of the first failure, which names whom to blame), preferring one that
        names this rank (the peers gave up on it); consumed. None if there is none.

        Asked before blaming a peer for a closed or reset connection: a peer that failed
        because of a third rank sends ABORT and then exits, and its exit can reach this rank
        (a reset while sending to it) before this rank read the ABORT."""
        if self._scanning:  # probing below can end in _lost, which asks again
            return None
        self.adopt()
        found: Link | None = None
        for link in self.links.values():
            if link.closed or link.cur is not None:
                continue
            try:
                head = link.sock.recv(wire.FRAME_HEAD, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except OSError:
                continue
            if len(head) == wire.FRAME_HEAD and self._authentic(link, head):
                group, _seq, op, kind, _nb, _arg, _total = wire.HEADER.unpack(head[: wire.HEADER_SIZE])
                if op == wire.ABORT and kind != wire.ENDED and (found is None or group == self.rank):
                    found = link
                    if group == self.rank:
                        break
        if found is None:
            return None
        self._scanning = True
        try:
            self.probe(found)
        except DistributedError as exc:
            return exc
        finally:
            self._scanning = False
        return None  # pragma: no cover - probe raises on the ABORT it just peeked

    def _timeout(self, links: list[Link]) -> None:
        mine = self.pending_abort() or self.stalled_error("a peer stopped answering")
        if mine is not None:
            raise mine
        # blame the link this loop was actually stuck on: a receive it waited for, or (when
        # nothing was expected) a send the peer did not accept
        waiting = [lk for lk in links if (lk.cur is not None or lk.expect) and lk.recv_blocked]
        stuck = [lk for lk in links if lk.out]
        link = waiting[0] if waiting else stuck[0]
        exp = link.cur or (link.expect[0] if link.expect else None)
        what = f" during {exp.call.describe()} in group {exp.call.label}" if exp else ""
        verb = "sent nothing" if waiting else "accepted no data"
        raise CommTimeoutError(
            f"rank {self.rank}: rank {link.peer} ({link.where}) {verb} for {self.timeout:g} s{what}. "
            f"Rank {link.peer} is stuck, slower than MLX_TIMEOUT={self.timeout:g}, or calling a different operation.",
            peer=link.peer,
        )

    def _lost(self, link: Link, why: str, call: Call | None = None) -> DistributedError:
        """The error for a connection that closed or broke (``call``: the operation this rank
        waits in elsewhere, e.g. in shared memory, when no frame of ``link`` is expected)."""
        exp = link.cur or (link.expect[0] if link.expect else None)
        call = exp.call if exp is not None else call
        what = f" during {call.describe()} in group {call.label}" if call is not None else ""
        mine = self.pending_abort() or self.stalled_error(f"lost rank {link.peer} ({why}){what}")
        link.closed = True
        if mine is not None:
            return mine
        if link.ended:
            return self._ended(link, call)
        return PeerLostError(
            f"rank {self.rank}: lost rank {link.peer} ({link.where}){what}: {why}. "
            f"Rank {link.peer} exited or crashed; check its output.",
            peer=link.peer,
        )

    def _ended(self, link: Link, call: Call | None) -> PeerLostError:
        """The error for a peer whose program ended normally while this rank still needs it."""
        where = f"{call.describe()} in group {call.label}" if call is not None else "an operation"
        return PeerLostError(
            f"rank {self.rank}: rank {link.peer} exited (its program ended) while rank {self.rank} waits in "
            f"{where}, an operation rank {link.peer} never reached; make every rank run the same sequence "
            "of collectives (and matching sends and receives) before it ends",
            peer=link.peer,
        )

    def _send(self, link: Link) -> bool:
        out = link.out
        moved = False
        while out:
            bufs = [out[i] for i in range(min(_IOV, len(out)))]
            try:
                n = link.sock.sendmsg(bufs)
            except BlockingIOError:
                link.send_blocked = True
                return moved
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise self._lost(link, f"connection reset ({exc.strerror})") from None
            except OSError as exc:
                raise self._lost(link, f"send failed ({exc.strerror})") from None
            moved = True
            while n:
                head = out[0]
                if n >= len(head):
                    n -= len(head)
                    out.popleft()
                    link.starts.popleft()
                else:
                    out[0] = head[n:]
                    link.starts[0] = _CONT
                    n = 0
        return moved

    def _recv(self, link: Link) -> bool:
        moved = False
        sock = link.sock
        while True:
            exp = link.cur
            if exp is None:
                if not link.expect:
                    return moved
                exp = link.cur = link.expect.popleft()
                link.hdr_got = link.got = 0
                link.checked = False
                link.tail_got = 0
            target = exp.target
            tail = wire.TAG if exp.sealed else 0
            bufs = []
            if link.hdr_got < wire.FRAME_HEAD:
                bufs.append(link.hdr_mv[link.hdr_got :])
            if link.got < len(target):
                bufs.append(target[link.got :])
            if link.tail_got < tail:
                bufs.append(link.tail_mv[link.tail_got : tail])
            try:
                k = sock.recvmsg_into(bufs)[0] if len(bufs) > 1 else sock.recv_into(bufs[0])
                if k == 0:
                    raise self._lost(link, "connection closed")
                take = min(k, wire.FRAME_HEAD - link.hdr_got)
                link.hdr_got += take
                k -= take
                take = min(k, len(target) - link.got)
                link.got += take
                link.tail_got += k - take
            except BlockingIOError:
                link.recv_blocked = True
                return moved
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise self._lost(link, f"connection reset ({exc.strerror})") from None
            except OSError as exc:
                if isinstance(exc, DistributedError):
                    raise
                raise self._lost(link, f"receive failed ({exc.strerror})") from None
            moved = True
            if link.hdr_got == wire.FRAME_HEAD and not link.checked:
                self._check(link, exp)
                link.checked = True
            if link.hdr_got == wire.FRAME_HEAD and link.got == len(target) and link.tail_got == tail:
                if tail and not hmac.compare_digest(link.recv_mac.tag(b"P", link.recv_ctr, target), link.tail):
                    raise self._forged(link, "payload", exp)
                link.cur = None
                link.recv_ctr += 1
                link.heard = time.monotonic()
                if exp.done is not None:
                    exp.done()

    def _authentic(self, link: Link, head: bytes | bytearray) -> bool:
        """``head`` (a header and its tag) is the next frame ``link``'s peer sent."""
        return hmac.compare_digest(
            link.recv_mac.tag(b"H", link.recv_ctr, bytes(head[: wire.HEADER_SIZE])),
            bytes(head[wire.HEADER_SIZE : wire.FRAME_HEAD]),
        )

    def _forged(self, link: Link, part: str, exp: _Expect | None) -> FrameAuthError:
        """The error for a frame from ``link`` whose ``part`` ("header"/"payload"/"abort
        message") failed its tag."""
        what = f" during {exp.call.describe()} in group {exp.call.label}" if exp else ""
        return FrameAuthError(
            f"rank {self.rank}: a frame from rank {link.peer} ({link.where}){what} failed authentication (its "
            f"{part} does not match its tag under this connection's key): its bytes were changed on the way (an "
            f"on-path attacker or faulty network equipment) or it was not sent by rank {link.peer}. Nothing it "
            "carried was used, and the job stops: this connection can no longer be trusted. Run jobs on a "
            "trusted network or through an encrypted tunnel (WireGuard, ssh), with MESHCOMM_JOB_SECRET set; "
            "see docs/security.md."
        )

    def _check(self, link: Link, exp: _Expect) -> None:
        if not self._authentic(link, link.hdr):
            raise self._forged(link, "header", exp)
        group, seq, op, dtype, nbytes, arg, total = wire.HEADER.unpack_from(link.hdr)
        call = exp.call
        if op == wire.ABORT and dtype == wire.ENDED and nbytes == 0:
            link.ended = True
            link.closed = True
            raise self._ended(link, call)
        if op == wire.ABORT:  # what came after the header so far is the start of its message
            sofar = bytes(exp.target[: link.got]) + bytes(link.tail[: link.tail_got])
            raise self._abort_from(link, dtype, nbytes, sofar, None if group == 0xFFFFFFFF else group)
        if (group, seq, op, dtype, nbytes, arg, total) == (
            call.group,
            call.seq,
            call.op,
            call.dtype,
            len(exp.target),
            call.arg,
            call.total,
        ):
            return
        if group != call.group:
            theirs = f"a message of another group (id {group:#x}): {_describe(op, seq, dtype, total, arg)}"
        else:
            theirs = call.theirs(op, seq, dtype, total, arg) + shape_differs(call.total, total)
            if (op, seq, dtype, arg, total) == (call.op, call.seq, call.dtype, call.arg, call.total):
                theirs += f" in pieces of {nbytes} bytes where {len(exp.target)} were expected"
        raise CollectiveMismatchError(
            f"rank {self.rank} called {call.describe()} in group {call.label} and expected the same "
            f"from rank {link.peer}, but rank {link.peer} sent {theirs}. Every rank must make the "
            "same calls in the same order with the same shapes, dtypes and roots; send/recv pairs must match."
        )

    def _abort_from(self, link: Link, kind: int, nbytes: int, sofar: bytes, lost: int | None) -> DistributedError:
        """The error an authenticated ABORT header announces (its message, ``nbytes`` and a
        tag, follows; ``sofar``: the part already read): shown only if its tag is right."""
        if nbytes > _MAX_ABORT:  # authentic, but no meshcomm rank sends that: read nothing
            link.closed = True
            return DistributedError(
                f"rank {self.rank}: rank {link.peer} stopped the job with an ABORT announcing {nbytes} bytes of "
                f"message (at most {_MAX_ABORT} are sent); its message was not read"
            )
        need = nbytes + wire.TAG
        data = sofar[:need]
        if len(data) < need:
            link.sock.settimeout(1.0)
            try:
                while len(data) < need:
                    chunk = link.sock.recv(need - len(data))
                    if not chunk:
                        break
                    data += chunk
            except OSError:
                pass
        if len(data) < need:
            msg = "(its message did not arrive whole)"
        elif hmac.compare_digest(link.recv_mac.tag(b"P", link.recv_ctr, data[:nbytes]), data[nbytes:]):
            msg = data[:nbytes].decode("utf-8", "replace")
        else:
            link.closed = True
            return self._forged(link, "abort message", None)
        link.recv_ctr += 1
        link.closed = True
        if lost == self.rank and kind in (1, 2):  # the peers gave up on this very rank
            blocker = self._blocker(link)
            if blocker is not None:  # it was running, itself waiting for another peer: name that one
                exp = blocker.cur or blocker.expect[0]
                return CommTimeoutError(
                    f"rank {self.rank}: rank {link.peer} gave up waiting for this rank, which was itself "
                    f"waiting for rank {blocker.peer} ({blocker.where}) during {exp.call.describe()} in group "
                    f"{exp.call.label} (rank {link.peer} reported: {msg}). Rank {blocker.peer} is stuck, "
                    f"stopped, slower than MLX_TIMEOUT={self.timeout:g}, or calling a different operation.",
                    peer=blocker.peer,
                )
            return CommTimeoutError(
                f"rank {self.rank}: the peers gave up waiting for this rank: it was stopped or too slow "
                f"for MLX_TIMEOUT={self.timeout:g} (rank {link.peer} reported: {msg}). Resume stopped "
                "ranks within MLX_TIMEOUT, or raise MLX_TIMEOUT for ranks that compute longer between calls.",
                peer=self.rank,
            )
        cls = _ABORT_CLASS.get(kind, DistributedError)
        if msg.startswith(f"rank {link.peer}: "):  # the peer's own error: its rank is said just before
            msg = msg[len(f"rank {link.peer}: ") :]
        text = f"rank {self.rank}: rank {link.peer} stopped the job: {msg}"
        peer = link.peer if lost is None else lost
        err = cls(text) if cls in (DistributedError, CollectiveMismatchError) else cls(text, peer=peer)  # type: ignore[call-arg]  # PeerLostError/CommTimeoutError take peer=
        link.closed = True
        return err

    def _blocker(self, told: Link) -> Link | None:
        """The peer this rank has been waiting for, with nothing from it, for at least half
        of MLX_TIMEOUT, when a peer (on link ``told``) gave up waiting for this rank while it
        ran: the rank to blame. None when this rank itself was stopped or starved, or came
        late to the operation (it is the one the peers waited for)."""
        if self.stalled():
            return None
        now = time.monotonic()
        for lk in self.links.values():
            waiting = lk.cur is not None or lk.expect
            if lk is not told and not lk.closed and waiting and now - lk.heard >= 0.5 * self.timeout:
                return lk
        return None

    def set_waiting(self, spin: float, yielding: bool) -> None:
        """How a waiting rank waits: ``spin`` seconds of polling (yielding the core each time
        when ``yielding``) before it sleeps."""
        self.spin, self.spin_ns, self.yielding = spin, int(spin * 1e9), yielding

    def check(self) -> None:
        """Raise at once if an earlier operation failed: the streams are no longer in step.
        After this process was stopped and resumed, first look for an ABORT that arrived
        meanwhile (the peers may have given up on this rank: it must not go on as if not)."""
        if self.failure is not None:
            raise _again(self.failure)
        if _resumed[0] != self._resume_seen and not any(lk.cur is not None for lk in self.links.values()):
            # (between frames only: a rank resumed in the middle of one finishes it first)
            self._resume_seen = _resumed[0]
            exc = self.pending_abort()
            if exc is not None:
                self.failure = exc
                raise exc

    def probe(self, link: Link, call: Call | None = None) -> bool:
        """Look at a link that became readable while this rank waited elsewhere (in shared
        memory, in ``call``): raise if the peer closed it or sent an ABORT frame; return True
        if it holds an ordinary frame of a later operation (leave it for that operation)."""
        if link.cur is not None:  # a frame is being read: the stream is not at a boundary
            return True
        try:
            head = link.sock.recv(wire.FRAME_HEAD, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise self._lost(link, f"connection reset ({exc.strerror})", call) from None
        if not head:
            raise self._lost(link, "connection closed", call)
        if len(head) < wire.FRAME_HEAD:
            if _closed_after(link.sock):  # the rest will never come
                raise self._lost(link, "connection closed in the middle of a frame", call)
            return False
        if not self._authentic(link, head):
            link.closed = True
            raise self._forged(link, "header", None)
        group, seq, op, dtype, nbytes, _arg, _total = wire.HEADER.unpack(head[: wire.HEADER_SIZE])
        if op != wire.ABORT:
            return True
        if dtype == wire.ENDED and nbytes == 0:  # the peer's program ended: its close follows
            self._take_ended(link, head)
            return False
        link.sock.recv(wire.FRAME_HEAD)
        link.got = 0
        raise self._abort_from(link, dtype, nbytes, b"", None if group == 0xFFFFFFFF else group)

    # -- failure ------------------------------------------------------------------------
    def fail(self, exc: DistributedError) -> None:
        """Remember the first failure and tell every peer, so that nobody waits forever."""
        if self.failure is not None:
            return
        self.failure = exc
        if self.dialer is not None:
            self.dialer.refuse()  # peers that dial this rank from now on learn that it is gone
            self.adopt()
        kind = next((k for cls, k in _KIND_OF.items() if isinstance(exc, cls)), 4)
        msg = str(exc).encode("utf-8", "replace")[:_MAX_ABORT]
        lost = getattr(exc, "peer", None)
        who = 0xFFFFFFFF if lost is None else lost
        header = wire.HEADER.pack(who, self.rank, wire.ABORT, kind, len(msg), 0, 0)
        for link in self.links.values():
            if link.closed:
                continue
            try:
                if link.out and link.starts[0] == _CONT:
                    # mid-frame: finish it, so the peer reads the ABORT as a frame and blames
                    # whom it names (closing instead would make it blame this live rank)
                    link.sock.settimeout(_FINISH_FRAME)
                    link.starts.popleft()
                    link.sock.sendall(link.out.popleft())
                    while link.out and link.starts[0] == _CONT:
                        link.starts.popleft()
                        link.sock.sendall(link.out.popleft())
                # the ABORT takes the place (and the counter) of the first frame not sent
                ctr = link.starts[0] if link.out else link.send_ctr
                link.send_ctr = ctr + 1
                frame = link.send_mac.seal(ctr, header) + msg + link.send_mac.tag(b"P", ctr, msg)
                link.sock.settimeout(0.5)
                link.sock.sendall(frame)
            except OSError:  # the peer does not read: closing is all that is left to tell it
                try:
                    link.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            link.out.clear()
            link.starts.clear()

    def _take_ended(self, link: Link, head: bytes) -> None:
        """Consume the ENDED frame ``head`` announces (its empty payload's tag follows)."""
        frame = b""
        link.sock.settimeout(1.0)
        try:
            frame = link.sock.recv(wire.FRAME_HEAD + wire.TAG, socket.MSG_WAITALL)
        except OSError:
            pass
        finally:
            link.sock.setblocking(False)
        if len(frame) < wire.FRAME_HEAD + wire.TAG:  # cut short by the peer's close: it ended all the same
            link.ended = True
            return
        if not hmac.compare_digest(link.recv_mac.tag(b"P", link.recv_ctr, b""), frame[wire.FRAME_HEAD :]):
            link.closed = True
            raise self._forged(link, "end notice", None)
        link.recv_ctr += 1
        link.ended = True

    def say_ended(self) -> None:
        """This rank's program ended normally: tell every peer (an ABORT frame of kind
        wire.ENDED, no message), so that one still waiting on this rank says that its program
        ended, not that it crashed. Nothing is sent after a failure (its ABORT said more)."""
        if self.failure is not None:
            return
        if self.dialer is not None:
            self.dialer.close()
            self.adopt()
        header = wire.HEADER.pack(0xFFFFFFFF, self.rank, wire.ABORT, wire.ENDED, 0, 0, 0)
        for link in self.links.values():
            if link.closed or link.out:
                continue  # a frame still unsent: the peer reads a closed connection, as before
            ctr = link.send_ctr
            link.send_ctr = ctr + 1
            try:  # a peer that does not read (stuck, gone) delays this exit by 50 ms at most
                link.sock.settimeout(0.05)
                link.sock.sendall(link.send_mac.seal(ctr, header) + link.send_mac.tag(b"P", ctr, b""))
                link.sock.shutdown(socket.SHUT_WR)
                _discard_unread(link.sock)  # unread data would turn the close into a reset,
            except OSError:  # which can destroy the notice before it is read
                pass

    def abort(self, code: int, reason: str) -> None:
        """This rank's program failed: tell every peer (an ABORT naming this rank, so each
        raises PeerLostError about it at once) unless an earlier failure was reported."""
        if self.failure is not None:
            return
        self.fail(
            PeerLostError(
                f"its program failed: {reason} (exit code {code}); see rank {self.rank}'s output",
                peer=self.rank,
            )
        )

    def close(self) -> None:
        if self.failure is not None:
            self._linger()
        else:
            self.say_ended()
        if self.dialer is not None:
            self.dialer.close()
            self.adopt()
        for link in self.links.values():
            try:
                link.sock.close()
            except OSError:
                pass
        self.links.clear()

    def _linger(self) -> None:
        """Half-close every link and discard what peers still send, until each closes its end
        or _LINGER passes, so that the ABORT this rank sent is read rather than reset away."""
        open_links = {}
        for link in self.links.values():
            try:
                link.sock.shutdown(socket.SHUT_WR)
                link.sock.setblocking(False)
                open_links[link.sock.fileno()] = link.sock
            except OSError:
                pass
        end = time.monotonic() + _LINGER
        poller = select.poll()
        for fd in open_links:
            poller.register(fd, _POLLIN)
        while open_links and (left := end - time.monotonic()) > 0:
            for fd, _ev in poller.poll(left * 1000):
                try:
                    if open_links[fd].recv(1 << 16):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                poller.unregister(fd)
                del open_links[fd]


def _closed_after(sock: socket.socket) -> bool:
    """The peer closed its end (the bytes already queued are all that will come)."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLRDHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP) for _fd, ev in p.poll(0))


def _discard_unread(sock: socket.socket) -> None:
    """Read and drop what the peer sent that is already here (without waiting)."""
    try:
        while sock.recv(1 << 16, socket.MSG_DONTWAIT):
            pass
    except OSError:
        pass


def _again(first: DistributedError) -> DistributedError:
    cls = type(first)
    text = f"this group can no longer be used after an earlier failure: {first}"
    if cls in (PeerLostError, CommTimeoutError):
        return cls(text, peer=getattr(first, "peer", None))
    return cls(text)
