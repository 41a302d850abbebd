"""Connections made when needed: a rank holds sockets to the peers its algorithms talk to,
not to every rank of the world.

At start-up a rank connects to its :func:`overlay` peers only: ``r ± 2**k`` (the ring, the
dissemination barrier, Bruck's all-gather) and recursive doubling's partners, about
``2 log2 n`` of them (23 at 4096 ranks), each pair by the higher rank dialling the lower
one, several at once. Every other pair connects the first time an operation needs it (an all-to-all, a root's
scatter, a send): whichever side needs it first dials, and a thread that serves this rank's
listener for the whole job answers (challenge, proof of the job secret, keys: the start-up
handshake of :mod:`.connect`). Two ranks that dial each other at once keep the lower rank's
connection: the lower rank answers the higher one's dial with ``STATUS_CROSSING`` and the
higher one waits for the dial that is on its way. A peer that no longer listens is lost at
once; one that does not answer within MLX_TIMEOUT is named in a CommTimeoutError. The
survivors of a failure agree through the same listener (:mod:`.recovery`): the thread
pauses for them, and hands the recovery any of its HELLOs that arrive before.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import socket
import threading
import time

from meshcomm.plugin import DistributedError

from . import wire
from .connect import Connection, Crossed, _admit, _connect, _Greeters, _Hello, _later, _never_connected, tune
from .hostfile import Peer

__all__ = ["CONNECT_ALL_UP_TO", "Dialer", "overlay", "connects_all"]

log = logging.getLogger("meshcomm.sockets")

#: MESHCOMM_SOCKETS_CONNECT=auto connects every pair of ranks at start-up up to this world
#: size (a full mesh: newcomers can join with grow()), and only the needed pairs above it
CONNECT_ALL_UP_TO = 64

#: start-up dials of one rank in flight at once
_PARALLEL_DIALS = 8


def overlay(rank: int, n: int) -> set[int]:
    """The peers ``rank`` connects to at start-up: ``rank ± 2**k`` (mod ``n``) and the
    partners of recursive doubling (its fold of the first ``2 (n - p)`` ranks, then
    ``vrank ^ 2**k``); symmetric, so each pair is in both ranks' sets."""
    peers: set[int] = set()
    d = 1
    while d < n:
        peers.update(((rank + d) % n, (rank - d) % n))
        d <<= 1
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if rank < 2 * rem:
        peers.add(rank + 1 if rank % 2 == 0 else rank - 1)
    if rank >= 2 * rem or rank % 2 == 0:
        vrank = rank // 2 if rank < 2 * rem else rank - rem
        mask = 1
        while mask < p:
            v = vrank ^ mask
            peers.add(v * 2 if v < rem else v + rem)
            mask <<= 1
    peers.discard(rank)
    return peers


class Dialer:
    """This rank's listener for the whole job, and the connections made through it."""

    def __init__(
        self,
        peers: list[Peer],
        rank: int,
        listener: socket.socket,
        *,
        secret: bytes,
        version: str,
        timeout: float,
    ) -> None:
        self.peers, self.rank, self.world = peers, rank, len(peers)
        self.secret, self.version, self.timeout = secret, version, timeout
        self.listener = listener
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        #: connections the listener accepted that nobody took yet
        self._accepted: dict[int, Connection] = {}
        #: peers this rank dials now, and peers it holds a connection to (made or taken)
        self._dialing: set[int] = set()
        self._linked: set[int] = set()
        self._refused: list[str] = []
        self._closed = threading.Event()
        #: after this rank's failure: every dial is turned away after its HELLO (a lost peer)
        self._refusing = False
        #: where HELLOs of the survivors' recoveries go (Recovery.hellos): they are not ours
        self.later: queue.Queue[_Hello] | None = None
        self._thread = self._serving()

    def _serving(self) -> threading.Thread:
        self._paused = False
        thread = threading.Thread(target=self._serve, name="meshcomm-listener", daemon=True)
        thread.start()
        return thread

    # -- the listener's thread ------------------------------------------------------------
    def _serve(self) -> None:
        """Accept until :meth:`close` (which shuts the listener down: accept then fails); each
        connection is challenged on a thread of its own, which answers its HELLO."""
        greeters = _Greeters()
        self.listener.settimeout(None)
        while not self._closed.is_set():
            try:
                sock, addr = self.listener.accept()
            except OSError as exc:
                if self._closed.is_set() or self.listener.fileno() < 0:
                    return
                log.warning("meshcomm sockets rank %d: accepting a connection failed: %s", self.rank, exc)
                time.sleep(0.05)  # out of descriptors: pending handshakes free theirs
                continue
            if self._paused:  # the wake-up of pause(): the listener is the recovery's now
                sock.close()
                return
            if not greeters.greet(sock, addr, self.rank, self.secret, time.monotonic() + self.timeout, self._answer):
                log.warning(
                    "meshcomm sockets rank %d: closed a connection from %s at once: handshakes pending",
                    self.rank,
                    addr[:2],
                )

    def _answer(self, got: _Hello) -> None:
        """Admit a proven HELLO unless this rank holds or (being the lower rank) dials that peer."""
        q = got.hello.rank
        with self._lock:
            if self.later is not None and not self._closed.is_set() and _later(got.hello.version):
                self.later.put(got)  # a survivor's recovery, begun before this rank's: it answers
                return
            if self._closed.is_set() or self._refusing or self._paused:  # ended, failed or recovering
                got.sock.close()  # after the HELLO: the dialling rank takes this rank as lost
                return
            if q in self._linked or q in self._accepted or (q > self.rank and q in self._dialing):
                self._cross(got)
                return
            try:
                conn = _admit(
                    got,
                    self.rank,
                    self.world,
                    {q} if 0 <= q < self.world else set(),
                    self.secret,
                    self.version,
                    self._refused,
                )
            except DistributedError as exc:  # a peer of another version or world: said in its timeout
                self._refused.append(str(exc))
                return
            if conn is not None:
                tune(conn.sock)
                conn.sock.setblocking(False)
                self._accepted[q] = conn
                self._arrived.notify_all()

    def _cross(self, got: _Hello) -> None:
        """Turn down a dial that crossed this rank's own (it keeps the connection it dials)."""
        view = wire.connection_view(got.sock, connector=False)
        try:
            got.sock.sendall(
                wire.welcome(self.secret, got.hello.nonce, wire.Welcome(wire.STATUS_CROSSING, self.rank, "", view))
            )
        except OSError:
            pass
        got.sock.close()

    # -- the rank's own thread ------------------------------------------------------------
    def connection(self, q: int, *, dial: bool = True, patient: bool = False) -> Connection:
        """The connection to rank ``q``: one the listener accepted, else dialled now (``dial``),
        else the one ``q`` dials, awaited until MLX_TIMEOUT. ``patient``: retry while ``q``
        does not listen yet (start-up); otherwise a refused connection means ``q`` is gone."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            conn = self._take(q)
            if conn is not None:
                return conn
            if dial:
                self._dialing.add(q)
        if dial:
            conn = None
            try:
                conn = _connect(
                    self.rank,
                    self.world,
                    q,
                    self.peers[q],
                    self.secret,
                    self.version,
                    deadline,
                    self.timeout,
                    patient=patient,
                )
            except Crossed:  # q dials this rank at the same time: its connection is kept
                pass
            finally:
                with self._lock:  # from dialing to linked in one step: the listener never sees q as neither
                    self._dialing.discard(q)
                    if conn is not None:
                        self._linked.add(q)
            if conn is not None:
                tune(conn.sock)
                conn.sock.setblocking(False)
                return conn
        return self._await(q, deadline)

    def _take(self, q: int) -> Connection | None:
        conn = self._accepted.pop(q, None)
        if conn is not None:
            self._linked.add(q)
        return conn

    def _await(self, q: int, deadline: float) -> Connection:
        with self._lock:
            while True:
                conn = self._take(q)
                if conn is not None:
                    return conn
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    break
                self._arrived.wait(min(left, 0.05))
        raise _never_connected(self.rank, self.timeout, {q}, self.peers, self._refused)

    def arrived(self) -> dict[int, Connection]:
        """Every connection the listener accepted since the last call (taken: the caller holds them)."""
        with self._lock:
            got = dict(self._accepted)
            self._accepted.clear()
            self._linked.update(got)
            return got

    def start(self, peers: set[int]) -> dict[int, Connection]:
        """Connect to ``peers``, which connect to this rank at the same time (start-up, or a
        host's ranks setting up shared memory): dial the lower ones (several at once, retrying
        while one does not listen yet), await the higher ones."""
        conns: dict[int, Connection] = {}
        lower = sorted(q for q in peers if q < self.rank)
        try:
            with concurrent.futures.ThreadPoolExecutor(min(_PARALLEL_DIALS, max(len(lower), 1))) as pool:
                futures = {q: pool.submit(self.connection, q, patient=True) for q in lower}
                for q, fut in futures.items():
                    conns[q] = fut.result()
            for q in sorted(q for q in peers if q > self.rank):
                conns[q] = self.connection(q, dial=False)
        except BaseException:
            for c in conns.values():
                c.sock.close()
            raise
        return conns

    def refuse(self) -> None:
        """This rank failed: turn every dial away after its HELLO, so the dialling rank takes
        this one as lost at once; the listener stays open for the survivors' recovery."""
        self._refusing = True

    def pause(self) -> None:
        """Stop answering and leave the listener to the survivors' recovery (:mod:`.recovery`)."""
        if self._paused or self._closed.is_set():
            return
        self._paused = True
        host, port = self.listener.getsockname()[:2]
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1" if host == "0.0.0.0" else "::1"
        try:  # wake the thread's accept
            socket.create_connection((host, port), timeout=1.0).close()
        except OSError:
            pass
        self._thread.join(2.0)

    def resume(self) -> None:
        """Answer dials again after :meth:`pause` (an agreement that did not end this world)."""
        if self._paused and not self._closed.is_set():
            self._thread = self._serving()

    def close(self) -> None:
        """Stop answering: peers that dial this rank from now on learn that it is gone."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept
        except OSError:
            pass
        self.listener.close()
        self._thread.join(1.0)  # what it accepted meanwhile is left for arrived()


def connects_all(setting: str, world: int) -> bool:
    """Whether a world of ``world`` ranks connects every pair at start-up under ``setting``
    (MESHCOMM_SOCKETS_CONNECT: all, needed, or auto)."""
    return setting == "all" or (setting == "auto" and world <= CONNECT_ALL_UP_TO)
