"""Start-up: every pair of ranks gets one authenticated TCP connection, within a deadline.

Rank r connects to every lower rank (retrying with backoff while that rank is not yet
listening) and then accepts every higher rank. A rank that never starts makes the
others fail with its rank and address once ``timeout`` expires, never wait forever.
Connections that fail the handshake (garbage, wrong secret, wrong protocol, silence) are
closed and logged and the rank goes on waiting for its real peers: each accepted
connection is challenged on its own thread, so strangers cannot hold up the real ones.
At most :data:`MAX_PENDING` handshakes run at once: further connections are closed at
once (a real peer retries), so a flood of connections cannot exhaust this rank's file
descriptors; running out of them anyway (EMFILE and the like) is a DistributedError that
names the limit and the fix, not a raw OSError.

Without a job secret anybody can complete the handshake, so a HELLO's claims (another
meshcomm version, another world size) then do not stop start-up: they are logged and
named in the timeout error if the real peer never comes, and the WELCOME does not tell
such a peer this rank's versions.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from meshcomm.plugin import CommTimeoutError, ConfigError, DistributedError, PeerLostError

from . import wire
from .hostfile import Peer
from .sockio import recv_exact

__all__ = ["establish", "open_listener", "tune", "phase_version", "Connection", "Crossed", "MAX_PENDING"]

log = logging.getLogger("meshcomm.sockets")

_HANDSHAKE_LIMIT = 5.0  # seconds a connecting stranger gets to complete the handshake
#: what recv_exact's errors say they interrupted
_HANDSHAKE = "the handshake"
#: handshakes in progress at once on a listening rank; more connections are closed at once
MAX_PENDING = 64
# the kernel queues this many connections before dropping SYNs (a dropped SYN costs its sender
# a 1 s retry): enough for every rank of a large job connecting at once
_BACKLOG = 512
#: errors of a process or system out of descriptors or memory for sockets
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class Connection(NamedTuple):
    """One authenticated connection to a peer and its two frame keys (see wire.derive_keys);
    ``direct``: both ends saw the same addresses and ports (nothing between them)."""

    sock: socket.socket
    send_key: bytes
    recv_key: bytes
    direct: bool = False


class Crossed(Exception):
    """The dialled rank dials this one at the same time and keeps its own connection
    (``STATUS_CROSSING``, :mod:`.dialing`): wait for that one instead."""


def _direct(rank: int, q: int, mine: str, theirs: str) -> bool:
    """Whether this rank and rank ``q`` saw the same connection (the views of both ends,
    exchanged in the authenticated handshake); logs the two views when they differ."""
    if mine == theirs and mine != "?":
        return True
    log.info(
        "meshcomm sockets rank %d: the connection to rank %d is not direct (this rank sees %s, rank %d sees "
        "%s: a relay, proxy or NAT between them); its payloads are authenticated under "
        "MESHCOMM_SOCKETS_INTEGRITY=auto",
        rank,
        q,
        mine,
        q,
        theirs or "nothing",
    )
    return False


def _exhausted(rank: int, what: str, exc: OSError) -> DistributedError:
    """The error for running out of descriptors (EMFILE...): the cause, the limit, the fix."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return DistributedError(
        f"rank {rank}: {what} failed: {exc.strerror or exc} (errno {errno.errorcode.get(exc.errno or 0, exc.errno)}; "
        f"open-file limit of this process: {soft}, hard limit {hard}). Raise the limit (ulimit -n) or close "
        "descriptors the program holds; a flood of connections to this rank's port is capped at "
        f"{MAX_PENDING} pending handshakes and does not cause this by itself."
    )


def tune(sock: socket.socket) -> None:
    """Options of every data connection: no Nagle delay, keepalive to notice dead hosts."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


def open_listener(rank: int, me: Peer, bind: str | None, backlog: int) -> socket.socket:
    """Listen on this rank's port; a clear error when the address is unusable or taken."""
    host = bind or me.bind_host
    where = f"{host}:{me.port}" if ":" not in host else f"[{host}]:{me.port}"
    try:
        infos = socket.getaddrinfo(host, me.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"rank {rank}: cannot resolve listen address {host!r}: {exc.strerror}") from None
    family, stype, proto, _, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise DistributedError(
                f"rank {rank}: cannot listen on {where}: the port is already in use by another "
                "process. Stop that process or give this rank another port in MLX_HOSTFILE "
                "(meshcomm launch picks free ports itself)."
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise DistributedError(
                f"rank {rank}: cannot listen on {where}: the address is not on this machine. "
                'Set "bind" in its hostfile entry (or MESHCOMM_SOCKETS_BIND=0.0.0.0) to listen '
                "on a local address while peers use the advertised one."
            ) from None
        raise DistributedError(f"rank {rank}: cannot listen on {where}: {exc.strerror}") from None
    sock.listen(max(backlog, _BACKLOG))
    return sock


def _address(peer: Peer) -> tuple:
    """The one address to reach ``peer`` at: the first its name resolves to (as its listener
    binds the first), of the family it listens on when its entry names another ``bind``.
    Never the others: a rank that falls back to 127.0.0.1 while its peer listens on ::1
    could meet whoever listens there instead."""
    infos = socket.getaddrinfo(peer.ip, peer.port, type=socket.SOCK_STREAM)
    if peer.bind and peer.bind != peer.ip:
        try:
            family = socket.getaddrinfo(peer.bind, peer.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        except socket.gaierror:
            family = None
        infos = [i for i in infos if i[0] == family] or infos
    return infos[0]


def _connect_once(peer: Peer, deadline: float) -> socket.socket:
    left = max(0.05, deadline - time.monotonic())
    family, kind, proto, _, addr = _address(peer)
    sock = socket.socket(family, kind, proto)
    sock.settimeout(min(left, 10.0))
    try:
        sock.connect(addr)
    except OSError:
        sock.close()
        raise
    return sock


def _connect(
    rank: int,
    world: int,
    q: int,
    peer: Peer,
    secret: bytes,
    version: str,
    deadline: float,
    timeout: float,
    *,
    patient: bool = True,
) -> Connection:
    """Connect to rank ``q`` and complete the handshake by ``deadline``. ``patient``: retry
    while ``q`` does not listen yet (start-up); otherwise (``q`` listened before, as in a
    recovery) a refused connection, or one closed after this rank's HELLO, means ``q`` is
    gone: PeerLostError at once."""
    delay, last, refused, refusal = 0.02, "no attempt", 0, ""
    while True:
        try:
            sock = _connect_once(peer, deadline)
        except OSError as exc:
            if exc.errno in _EXHAUSTED:
                raise _exhausted(rank, f"opening a connection to rank {q} at {peer}", exc) from None
            if not patient and isinstance(exc, ConnectionError):
                raise PeerLostError(
                    f"rank {rank}: rank {q} at {peer} no longer listens ({exc.strerror or exc})", peer=q
                ) from None
            last = exc.strerror or str(exc)
        else:
            said_hello = False
            try:
                nonce_a = wire.parse_challenge(recv_exact(sock, wire.CHALLENGE_SIZE, deadline, during=_HANDSHAKE))
                nonce_c = os.urandom(16)
                view = wire.connection_view(sock, connector=True)
                sock.sendall(wire.hello(secret, nonce_a, wire.Hello(world, rank, q, nonce_c, version, view)))
                said_hello = True
                head = recv_exact(sock, wire.WELCOME_FIXED, deadline, during=_HANDSHAKE)
                rest = recv_exact(sock, wire.welcome_size(head) - len(head), deadline, during=_HANDSHAKE)
                w = wire.parse_welcome(secret, nonce_c, head + rest)
            except (OSError, wire.HandshakeError) as exc:
                sock.close()
                if isinstance(exc, wire.HandshakeError):
                    raise DistributedError(
                        f"rank {rank}: the process at {peer} (rank {q} in MLX_HOSTFILE) failed the handshake: {exc}"
                    ) from None
                last = str(exc)
                # closed before this rank's HELLO: turned away while MAX_PENDING handshakes ran
                # (a live rank: try again; a gone one refuses the next connection)
                if not patient and isinstance(exc, ConnectionError) and said_hello:
                    raise PeerLostError(
                        f"rank {rank}: rank {q} at {peer} closed the connection ({exc})", peer=q
                    ) from None
                if said_hello and isinstance(exc, ConnectionError):
                    # a listener closes only a HELLO whose proof of the secret fails
                    refused += 1
                    # kept apart from `last`: a later attempt's error (rank q gave up and stopped
                    # listening: "Connection refused") must not hide why this rank was turned away
                    refusal = (
                        f"rank {q} closed the connection right after this rank's HELLO, {refused} time(s): "
                        "it did not accept this rank's proof of MESHCOMM_JOB_SECRET"
                    )
            else:
                if w.status == wire.STATUS_CROSSING:
                    sock.close()
                    raise Crossed(q)
                if w.status != wire.STATUS_OK:
                    sock.close()
                    theirs = (
                        f"rank {q} runs {w.version!r}"
                        if w.version
                        else f"rank {q} names its versions only to peers that prove MESHCOMM_JOB_SECRET"
                    )
                    raise DistributedError(
                        f"rank {rank}: rank {q} at {peer} refused the connection: "
                        f"{wire.STATUS_TEXT.get(w.status, w.status)} ({theirs}, "
                        f"rank {rank} runs {version!r}). Use the same hostfile, the same settings and the same "
                        "meshcomm versions on every host."
                    )
                if w.rank != q:
                    sock.close()
                    raise DistributedError(
                        f"rank {rank}: {peer} answered as rank {w.rank}, but MLX_HOSTFILE says "
                        f"rank {q} listens there. Every rank must use the same hostfile."
                    )
                c2a, a2c = wire.derive_keys(secret, nonce_a, nonce_c)
                return Connection(sock, c2a, a2c, _direct(rank, q, view, w.view))
        if time.monotonic() + delay > deadline:
            if refused:
                raise DistributedError(
                    f"rank {rank}: rank {q} at {peer} refused this rank's MESHCOMM_JOB_SECRET ({refusal}): the "
                    "two ranks were given different secrets, or this process is not part of that job. Give "
                    "every rank of a job the same MESHCOMM_JOB_SECRET (meshcomm launch does it for you)."
                )
            raise CommTimeoutError(
                f"rank {rank}: could not connect to rank {q} at {peer} within {timeout:g} s "
                f"(last error: {last}). Is rank {q} running, and does it listen on {peer}?",
                peer=q,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


class _Hello(NamedTuple):
    hello: wire.Hello
    sock: socket.socket
    addr: tuple
    nonce_a: bytes


class _Greeters:
    """How many handshakes are in progress (each on its own thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    def enter(self) -> None:
        with self.lock:
            self.count += 1

    def leave(self) -> None:
        with self.lock:
            self.count -= 1

    def greet(
        self, sock: socket.socket, addr: tuple, rank: int, secret: bytes, deadline: float, out: Callable[[_Hello], None]
    ) -> bool:
        """Challenge ``sock`` on a thread of its own (:func:`_greet`), handing a valid HELLO to
        ``out`` on that thread; False, and the socket
        closed at once, when :data:`MAX_PENDING` handshakes already run."""
        if self.count >= MAX_PENDING:
            sock.close()
            return False
        self.enter()
        threading.Thread(
            target=_greet, args=(sock, addr, rank, secret, deadline, out, self), name="meshcomm-handshake", daemon=True
        ).start()
        return True


def _greet(
    sock: socket.socket,
    addr: tuple,
    rank: int,
    secret: bytes,
    deadline: float,
    out: Callable[[_Hello], None],
    greeters: _Greeters,
) -> None:
    """Challenge one accepted connection and queue its valid HELLO (runs on its own thread,
    so a silent or slow stranger delays nobody); strangers are closed and logged."""
    limit = min(deadline, time.monotonic() + _HANDSHAKE_LIMIT)
    try:
        nonce_a = os.urandom(16)
        sock.settimeout(max(0.01, limit - time.monotonic()))
        sock.sendall(wire.challenge(nonce_a))
        head = recv_exact(sock, wire.HELLO_FIXED, limit, during=_HANDSHAKE)
        rest = recv_exact(sock, wire.hello_size(head) - len(head), limit, during=_HANDSHAKE)
        out(_Hello(wire.parse_hello(secret, nonce_a, head + rest), sock, addr, nonce_a))
    except (OSError, wire.HandshakeError) as exc:
        log.warning("meshcomm sockets rank %d: rejected a connection from %s: %s", rank, addr[:2], exc)
        sock.close()
    finally:
        greeters.leave()


def _admit(
    got: _Hello, rank: int, world: int, pending: set[int], secret: bytes, version: str, refused: list[str]
) -> Connection | None:
    """Answer a valid HELLO: the connection when it is a peer we wait for, else None (or an
    error for a version or world-size skew, which no waiting can fix, when the HELLO proved
    the job secret; without a secret anybody can claim anything, so a claim is only noted
    in ``refused``, for the timeout error)."""
    h, sock, addr = got.hello, got.sock, got.addr
    status = wire.STATUS_OK
    if h.version != version:
        status = wire.STATUS_VERSION
    elif h.world != world:
        status = wire.STATUS_WORLD
    elif h.target != rank or h.rank not in pending:
        status = wire.STATUS_RANK
    view = wire.connection_view(sock, connector=False)
    try:  # versions only to a peer that proved the secret
        sock.sendall(wire.welcome(secret, h.nonce, wire.Welcome(status, rank, version if secret else "", view)))
    except OSError:
        pass
    if status == wire.STATUS_OK:
        c2a, a2c = wire.derive_keys(secret, got.nonce_a, h.nonce)
        return Connection(sock, a2c, c2a, _direct(rank, h.rank, view, h.view))
    sock.close()
    what = {
        wire.STATUS_VERSION: f"it runs {h.version!r} but rank {rank} runs {version!r}; install the same "
        "meshcomm versions and use the same settings on every host",
        wire.STATUS_WORLD: f"it thinks the job has {h.world} ranks, this rank has {world}; every rank must use "
        "the same hostfile",
    }.get(status, wire.STATUS_TEXT[status])
    log.log(
        logging.INFO if _later(h.version) or _later(version) else logging.WARNING,
        "meshcomm sockets rank %d: rejected %s claiming rank %d of %d (target %d): %s",
        rank,
        addr[:2],
        h.rank,
        h.world,
        h.target,
        what,
    )
    if status in (wire.STATUS_VERSION, wire.STATUS_WORLD) and not (_later(h.version) or _later(version)):
        if secret:
            raise DistributedError(f"rank {rank}: rank {h.rank} (at {addr[0]}) cannot join: {what}.")
        refused.append(f"{addr[0]} claiming rank {h.rank} was refused: {what}")
    return None


#: what marks the handshakes of a job's later phases (a newcomer's join, a recovery, a rebuilt
#: world) in their version text, so that no phase's connection is taken for another's
_PHASES = ("join", "recovery", "world")


def phase_version(version: str, phase: str, number: int | None = None) -> str:
    """The handshake version of ``phase`` (one of :data:`_PHASES`; ``number``: its epoch)."""
    assert phase in _PHASES
    return f"{version}; {phase}" if number is None else f"{version}; {phase} {number}"


def _never_connected(
    rank: int, timeout: float, missing: set[int], peers: list[Peer], refused: list[str]
) -> CommTimeoutError:
    """The error of a rank that waited ``timeout`` s for ranks ``missing`` to connect to it
    (``refused``: the connections it turned away meanwhile, the last three named)."""
    one = len(missing) == 1
    who = ", ".join(f"{q} ({peers[q]})" for q in sorted(missing))
    why = f" Meanwhile: {'; '.join(refused[-3:])}." if refused else ""
    return CommTimeoutError(
        f"rank {rank}: waited {timeout:g} s for {'rank' if one else 'ranks'} {who} to connect; "
        f"{'it' if one else 'they'} never did. Did {'it' if one else 'they'} start, and "
        f"{'does it' if one else 'do they'} use the same MLX_HOSTFILE?{why}",
        peer=min(missing),
    )


def _later(version: str) -> bool:
    """A handshake of a job's later phases (:func:`phase_version`): one of them meeting
    another is a straggler of the job, turned away, not a version skew."""
    return any(f"; {phase}" in version for phase in _PHASES)


def _accept_all(
    listener: socket.socket, peers: list[Peer], rank: int, secret: bytes, version: str, deadline: float, timeout: float
) -> dict[int, Connection]:
    """Accept every higher rank; each connection is challenged on its own thread, at most
    MAX_PENDING at once (more are closed at once and counted in one warning per burst)."""
    world = len(peers)
    pending = set(range(rank + 1, world))
    conns: dict[int, Connection] = {}
    hellos: queue.Queue[_Hello] = queue.Queue()
    greeters = _Greeters()
    refused: list[str] = []
    turned_away = 0
    listener.settimeout(0.01)
    try:
        while pending:
            while not hellos.empty():
                got = hellos.get_nowait()
                c = _admit(got, rank, world, pending, secret, version, refused)
                if c is not None:
                    pending.discard(got.hello.rank)
                    conns[got.hello.rank] = c
            if not pending:
                break
            if time.monotonic() >= deadline:
                raise _never_connected(rank, timeout, pending, peers, refused)
            try:
                sock, addr = listener.accept()
            except TimeoutError:
                if turned_away:
                    log.warning(
                        "meshcomm sockets rank %d: closed %d connections at once: %d handshakes were "
                        "already pending (a flood of connections to this rank's port?)",
                        rank,
                        turned_away,
                        MAX_PENDING,
                    )
                    turned_away = 0
                continue
            except OSError as exc:
                if exc.errno not in _EXHAUSTED:
                    raise DistributedError(
                        f"rank {rank}: accepting connections failed: {exc.strerror or exc}"
                    ) from None
                if greeters.count == 0:  # nothing of ours will free a descriptor
                    raise _exhausted(rank, "accepting a connection from a peer", exc) from None
                time.sleep(0.01)  # pending handshakes end within their limit and free theirs
                continue
            if not greeters.greet(sock, addr, rank, secret, deadline, hellos.put):
                turned_away += 1
    except BaseException:
        for c in conns.values():
            c.sock.close()
        raise
    if turned_away:
        log.warning(
            "meshcomm sockets rank %d: closed %d connections at once: %d handshakes were already pending "
            "(a flood of connections to this rank's port?)",
            rank,
            turned_away,
            MAX_PENDING,
        )
    return conns


def establish(
    peers: list[Peer],
    rank: int,
    *,
    secret: bytes,
    version: str,
    timeout: float,
    bind: str | None = None,
    listener: socket.socket | None = None,
    keep_listener: bool = False,
) -> dict[int, Connection]:
    """Connect this rank to every other rank; returns world rank -> connection (socket and keys).

    ``listener`` is an already listening socket (inherited from the launcher); without
    one this rank opens its own on its hostfile port. ``keep_listener``: leave it open (the
    caller keeps it for a recovery, :mod:`.recovery`).
    """
    world = len(peers)
    if world == 1:
        if listener is not None and not keep_listener:
            listener.close()
        return {}
    deadline = time.monotonic() + timeout
    if listener is None:
        listener = open_listener(rank, peers[rank], bind, world)
    listener.setblocking(True)
    conns: dict[int, Connection] = {}
    try:
        for q in range(rank):
            conns[q] = _connect(rank, world, q, peers[q], secret, version, deadline, timeout)
        conns.update(_accept_all(listener, peers, rank, secret, version, deadline, timeout))
    except BaseException:
        for c in conns.values():
            c.sock.close()
        raise
    finally:
        if not keep_listener:
            listener.close()
    for c in conns.values():
        tune(c.sock)
        c.sock.setblocking(False)
    return conns
