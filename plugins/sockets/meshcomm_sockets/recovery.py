"""Survivors continue: the ranks still alive agree on who is left, then form a new world.

Every rank keeps its listening socket for the life of its world. When a rank asks to
agree (``Group.agree``) or to shrink (``Group.shrink``), it opens a *channel*: one
authenticated connection to every other rank not known lost (the usual handshake, under
the job secret, marked with the recovery's epoch so no old connection can be mistaken for
one), on which it sends, and accepts one from each, on which it reads. A rank that is gone
refuses the connection at once; a stopped one lets it open but never completes the
handshake, and is suspected after ``MLX_TIMEOUT``.

The agreement is flooding consensus for crash failures: in each round every rank sends
the set of ranks it knows lost and its flag to every rank it believes alive, and reads the
same from each (a closed connection or ``MLX_TIMEOUT`` of silence adds that rank to the
set). A rank decides when a round brought no new loss and every set it received equals
its own; it then sends DECIDED with the set and the AND of the flags, and a rank that
reads a DECIDED adopts it and sends it on, so that every survivor decides the same even
when one dies halfway through telling the others. A rank that finds itself in the agreed
set (the others gave up on it: it was stopped, or cut off) raises instead of going on
alone, and is told so with EXCLUDED when a peer gives up on it. A rank that reached no
other rank at all (each one timed out) raises too: it may be the one that was cut off.

To shrink, the members are the ranks outside the agreed set, renumbered in their old
order, and each pair keeps the connection the lower rank opened: the new world starts on
connections the agreement already proved, without another round of handshakes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from meshcomm.plugin import CommTimeoutError, DistributedError, PeerLostError

from .connect import Connection, _admit, _connect, _Greeters, _Hello, phase_version, tune
from .hostfile import Peer
from .sockio import recv_exact

__all__ = ["Recovery", "Channel", "Agreement", "seal_message", "read_message"]

log = logging.getLogger("meshcomm.sockets")

_LEN = struct.Struct("<I")
_TAG = 32
_MAX_MESSAGE = 1 << 20  # bytes of one agreement message (a lost set of ~100 000 ranks)
_EXCLUDE_WAIT = 0.2  # seconds an EXCLUDED notice may take to leave (the peer may be stopped)
#: seconds a recovery waits for a rank this one timed out on (it is stopped, cut off, or was
#: only blamed for a third rank's silence: then it is in its own recovery within milliseconds)
SUSPECT_GRACE = 0.5


@dataclass(frozen=True)
class Agreement:
    """What the survivors agreed: the AND of their flags and every rank known lost."""

    flag: int
    lost: frozenset[int]


def _agree_key(key: bytes) -> bytes:
    """The key of one direction's agreement messages (apart from its frame key)."""
    return hmac.new(key, b"meshcomm sockets recovery agreement", hashlib.sha256).digest()


def _tag(key: bytes, ctr: int, body: bytes) -> bytes:
    return hmac.new(key, ctr.to_bytes(8, "little") + body, hashlib.sha256).digest()


def seal_message(key: bytes, ctr: int, msg: dict) -> bytes:
    """One message of a recovery or join connection: length, JSON, HMAC(key, counter || JSON)."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body + _tag(key, ctr, body)


def _length(head: bytes | bytearray, who: str) -> int:
    """The body length a message's head announces (DistributedError beyond _MAX_MESSAGE)."""
    (n,) = _LEN.unpack_from(head)
    if n > _MAX_MESSAGE:
        raise DistributedError(f"{who} announced a {n}-byte message")
    return int(n)


def _opened(key: bytes, ctr: int, body: bytes, tag: bytes, who: str) -> dict:
    """The message ``body`` if ``tag`` is its tag (DistributedError otherwise)."""
    if not hmac.compare_digest(tag, _tag(key, ctr, body)):
        raise DistributedError(f"a message from {who} failed its authentication (changed on the way?)")
    return json.loads(body)


def read_message(sock: socket.socket, key: bytes, ctr: int, deadline: float, who: str) -> dict:
    """The message :func:`seal_message` made, read whole by ``deadline`` (TimeoutError,
    ConnectionError; DistributedError when it fails its authentication)."""
    n = _length(recv_exact(sock, _LEN.size, deadline, during=f"a message from {who}"), who)
    rest = recv_exact(sock, n + _TAG, deadline, during=f"a message from {who}")
    return _opened(key, ctr, rest[:n], rest[n:], who)


class _Excluded(Exception):
    """A peer said it gave up on this rank."""

    def __init__(self, peer: int) -> None:
        super().__init__(peer)
        self.peer = peer


@dataclass
class _Side:
    """This rank's two connections with one peer: the one it opened (it sends on it) and
    the one it accepted (it reads from it), with their message counters."""

    out: Connection
    inc: Connection
    send_key: bytes = b""
    recv_key: bytes = b""
    sent: int = 0
    read: int = 0
    buf: bytearray = field(default_factory=bytearray)

    def __post_init__(self) -> None:
        self.send_key = _agree_key(self.out.send_key)
        self.recv_key = _agree_key(self.inc.recv_key)

    def close(self) -> None:
        for c in (self.out, self.inc):
            try:
                c.sock.close()
            except OSError:
                pass


class Channel:
    """The agreement's connections to every other live rank of one world (old rank numbers)."""

    def __init__(self, rank: int, world: int, timeout: float, sides: dict[int, _Side], lost: set[int]) -> None:
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.sides = sides
        #: ranks this rank knows lost (closed, refused, silent past the deadline)
        self.lost = set(lost)
        #: ranks given up on for silence (not seen to close): they may still be running
        self.silent: set[int] = set()
        self.instance = 0

    # -- messages -----------------------------------------------------------------------
    def _send(self, q: int, msg: dict) -> None:
        side = self.sides.get(q)
        if side is None:
            return
        data = seal_message(side.send_key, side.sent, msg)
        side.sent += 1
        try:
            side.out.sock.settimeout(self.timeout)
            side.out.sock.sendall(data)
        except OSError:
            self._lose(q, silent=False)

    def _read(self, q: int, deadline: float) -> dict | None:
        """The next message from ``q``, or None once ``q`` is lost (closed, or silent until
        ``deadline``: then this rank gives up on it)."""
        side = self.sides.get(q)
        if side is None:
            return None
        sock = side.inc.sock
        while True:
            if len(side.buf) >= _LEN.size:
                who = f"rank {q} (to rank {self.rank}, in its recovery)"
                n = _length(side.buf, who)
                if len(side.buf) >= _LEN.size + n + _TAG:
                    body = bytes(side.buf[_LEN.size : _LEN.size + n])
                    tag = bytes(side.buf[_LEN.size + n : _LEN.size + n + _TAG])
                    del side.buf[: _LEN.size + n + _TAG]
                    msg = _opened(side.recv_key, side.read, body, tag, who)
                    side.read += 1
                    if msg.get("t") == "excluded":
                        raise _Excluded(q)
                    return msg
            left = deadline - time.monotonic()
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            if not poller.poll(max(0.0, left) * 1000):
                self._lose(q, silent=True)
                return None
            # never past this message: what follows a DECIDED may be the next world's first frame
            need = _LEN.size + (_LEN.unpack_from(side.buf)[0] + _TAG if len(side.buf) >= _LEN.size else 0)
            try:
                chunk = sock.recv(need - len(side.buf))
            except OSError:
                chunk = b""
            if not chunk:
                self._lose(q, silent=False)
                return None
            side.buf += chunk

    def _lose(self, q: int, *, silent: bool) -> None:
        """Stop talking to ``q``; one given up on for silence is told so (it may be stopped,
        and read it when it resumes)."""
        side = self.sides.pop(q, None)
        self.lost.add(q)
        if silent:
            self.silent.add(q)
        if side is None:
            return
        if silent:
            try:
                side.out.sock.settimeout(_EXCLUDE_WAIT)
                side.out.sock.sendall(seal_message(side.send_key, side.sent, {"t": "excluded"}))
            except OSError:
                pass
        side.close()

    # -- the agreement ------------------------------------------------------------------
    def agree(self, flag: int) -> Agreement:
        """Flooding consensus on (AND of flags, lost ranks) among the ranks still here."""
        self.instance += 1
        inst = self.instance
        decided: Agreement | None = None
        said_decided: set[int] = set()  # peers whose DECIDED of this instance was read
        heard: set[int] = set()  # peers that sent anything in this instance (alive then)
        rnd = 0
        try:
            while decided is None:
                rnd += 1
                before = set(self.lost)
                for q in list(self.sides):
                    self._send(q, {"t": "round", "i": inst, "r": rnd, "lost": sorted(self.lost), "flag": flag})
                deadline = time.monotonic() + self.timeout
                sets: list[set[int]] = []
                for q in sorted(self.sides):
                    msg = self._read(q, deadline)
                    if msg is None:
                        continue
                    heard.add(q)
                    theirs = set(msg["lost"])
                    if self.rank in theirs:
                        raise _Excluded(q)
                    if msg["t"] == "decided":
                        said_decided.add(q)
                        decided = Agreement(int(msg["flag"]), frozenset(theirs))
                        break
                    sets.append(theirs)
                    flag &= int(msg["flag"])
                if decided is not None:
                    break
                merged = set(self.lost).union(*sets)
                if merged == before and all(s == before for s in sets):
                    decided = Agreement(flag, frozenset(before))
                self.lost = merged
            self.lost |= decided.lost
            for q in list(self.sides):
                if q in decided.lost:
                    self._lose(q, silent=True)  # they agreed to give up on q: tell it
                else:
                    self._send(q, {"t": "decided", "i": inst, "lost": sorted(decided.lost), "flag": decided.flag})
            # read up to each peer's DECIDED, so every stream ends where this instance ends
            deadline = time.monotonic() + self.timeout
            for q in sorted(self.sides):
                while q in self.sides and q not in said_decided:
                    msg = self._read(q, deadline)
                    if msg is None:
                        break
                    heard.add(q)
                    if msg["t"] == "decided":
                        said_decided.add(q)
        except _Excluded as exc:
            self.close()
            raise CommTimeoutError(
                f"rank {self.rank}: the other survivors gave up on this rank (rank {exc.peer} said so): it was "
                f"stopped, too slow or cut off for MLX_TIMEOUT={self.timeout:g} s, and they went on without it. "
                "Resume stopped ranks within MLX_TIMEOUT, or raise it.",
                peer=self.rank,
            ) from None
        if not heard and self.silent and len(self.lost) == self.world - 1:
            self.close()
            raise CommTimeoutError(
                f"rank {self.rank}: no other rank answered within MLX_TIMEOUT={self.timeout:g} s (silent: ranks "
                f"{_ranks(self.silent)}); this rank may be the one that was cut off or stopped, so it does not go "
                "on alone",
                peer=min(self.silent),
            )
        return decided

    def members(self, agreed: Agreement) -> list[int]:
        """The old ranks of the next world: everyone outside the agreed lost set."""
        return [q for q in range(self.world) if q not in agreed.lost]

    def hand_over(self, members: list[int]) -> dict[int, Connection]:
        """The connections of the next world (old rank -> connection): for each pair, the one
        the lower rank opened; the rest are closed. The channel is spent."""
        conns: dict[int, Connection] = {}
        for q, side in list(self.sides.items()):
            if q not in members:
                side.close()
                continue
            keep, drop = (side.out, side.inc) if self.rank < q else (side.inc, side.out)
            try:
                drop.sock.close()
            except OSError:
                pass
            if side.buf:  # nothing may follow the DECIDED on a stream the next world reads
                keep.sock.close()
                continue
            tune(keep.sock)
            keep.sock.setblocking(False)
            conns[q] = keep
        self.sides.clear()
        return conns

    def close(self) -> None:
        for side in self.sides.values():
            side.close()
        self.sides.clear()


def _ranks(ranks: set[int] | frozenset[int]) -> str:
    return ", ".join(map(str, sorted(ranks))) or "none"


@dataclass
class Recovery:
    """What a world keeps so that its survivors can agree and start the next world:
    everyone's address, this rank's listening socket, the key, and how to build a world."""

    peers: list[Peer]
    rank: int
    secret: bytes
    version: str
    timeout: float
    listener: socket.socket
    #: builds the next world from its connections: (rank, peers, new rank -> connection, recovery)
    build: Callable[[int, list[Peer], dict[int, Connection], Recovery], object]
    epoch: int = 0
    channel: Channel | None = None
    #: HELLOs of the survivors' recoveries: challenged by this rank's listener thread while
    #: the job connected its ranks as needed (:mod:`.dialing`), or by :meth:`_accept` itself
    hellos: queue.Queue[_Hello] = field(default_factory=queue.Queue)

    def open_channel(self, suspects: set[int]) -> Channel:
        """Connect to every other rank both ways (see the module's docstring). ``suspects``
        (ranks this one timed out on) are waited for only :data:`SUSPECT_GRACE` seconds: a
        live one (blamed for a third rank's silence) is in its recovery by then too."""
        if self.channel is not None:
            return self.channel
        me, world = self.rank, len(self.peers)
        version = phase_version(self.version, "recovery", self.epoch)
        start = time.monotonic()
        deadline = start + self.timeout
        grace = start + min(SUSPECT_GRACE, self.timeout)
        wanted = {q for q in range(world) if q != me}
        out: dict[int, Connection] = {}
        gone: dict[int, bool] = {}  # rank -> silent (True) or closed/refused (False)
        lock = threading.Lock()

        def dial(q: int) -> None:
            until = grace if q in suspects else deadline
            try:
                c = _connect(me, world, q, self.peers[q], self.secret, version, until, self.timeout, patient=False)
            except PeerLostError:
                with lock:
                    gone[q] = False
            except (CommTimeoutError, DistributedError, OSError) as exc:
                log.info("meshcomm sockets rank %d: recovery: rank %d: %s", me, q, exc)
                with lock:
                    gone[q] = True
            else:
                with lock:
                    out[q] = c

        dialers = [threading.Thread(target=dial, args=(q,), name="meshcomm-recovery", daemon=True) for q in wanted]
        for t in dialers:
            t.start()
        inc = self._accept(wanted, version, deadline, gone, lock, suspects, grace)
        for t in dialers:
            t.join()
        sides: dict[int, _Side] = {}
        lost: set[int] = set()
        silent: set[int] = set()
        for q in sorted(wanted):
            if q in out and q in inc:
                sides[q] = _Side(out[q], inc[q])
                continue
            lost.add(q)
            if gone.get(q, True):
                silent.add(q)
            for c in (out.get(q), inc.get(q)):
                if c is not None:
                    c.sock.close()
        channel = Channel(me, world, self.timeout, sides, lost)
        channel.silent = silent
        self.channel = channel
        return channel

    def _accept(
        self,
        wanted: set[int],
        version: str,
        deadline: float,
        gone: dict[int, bool],
        lock: threading.Lock,
        suspects: set[int],
        grace: float,
    ) -> dict[int, Connection]:
        """Accept the connection of every rank in ``wanted`` that is not found gone, until
        ``deadline`` (``suspects`` until ``grace``); strangers are challenged on their own
        threads and turned away."""
        me, world = self.rank, len(self.peers)
        pending = set(wanted)
        conns: dict[int, Connection] = {}
        hellos = self.hellos
        greeters = _Greeters()
        refused: list[str] = []
        self.listener.settimeout(0.01)
        while True:
            while not hellos.empty():
                got = hellos.get_nowait()
                if got.hello.version != version or got.hello.world != world:
                    # a rank of another recovery (one given up on, late): not an error here
                    log.info("meshcomm sockets rank %d: turned away %s of another recovery", me, got.addr[:2])
                    got.sock.close()
                    continue
                c = _admit(got, me, world, pending, self.secret, version, refused)
                if c is not None:
                    pending.discard(got.hello.rank)
                    conns[got.hello.rank] = c
            now = time.monotonic()
            with lock:
                waiting = {q for q in pending if gone.get(q) is not False and (q not in suspects or now < grace)}
            if not waiting or now >= deadline:
                return conns
            try:
                sock, addr = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                raise DistributedError(f"rank {me}: accepting recovery connections failed: {exc}") from None
            greeters.greet(sock, addr, me, self.secret, deadline, hellos.put)

    def agree(self, flag: int, suspects: set[int]) -> Agreement:
        """Agree with the other survivors (``suspects``: see :meth:`open_channel`)."""
        return self.open_channel(suspects).agree(flag)

    def next_world(self, suspects: set[int]) -> object:
        """Agree on the survivors and build their world (this rank's new number, its
        peers' addresses, the connections the agreement opened)."""
        channel = self.open_channel(suspects)
        agreed = channel.agree(1)
        members = channel.members(agreed)
        conns = channel.hand_over(members)
        self.channel = None
        renumber = {old: new for new, old in enumerate(members)}
        nxt = self.next([self.peers[q] for q in members], renumber[self.rank])
        return self.build(nxt.rank, nxt.peers, {renumber[q]: c for q, c in conns.items()}, nxt)

    def next(self, peers: list[Peer], rank: int) -> Recovery:
        """The recovery of the next world: ``peers`` (everyone's address), this rank's ``rank``
        in it, the same listener and key, the next epoch."""
        return replace(self, peers=peers, rank=rank, epoch=self.epoch + 1, channel=None)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        try:
            self.listener.close()
        except OSError:
            pass
