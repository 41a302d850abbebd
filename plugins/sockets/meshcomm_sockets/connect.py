"""Start-up: every pair of ranks gets one authenticated TCP connection, within a deadline.

Rank r connects to every lower rank (retrying with backoff while that rank is not yet
listening) and then accepts every higher rank. A rank that never starts makes the
others fail with its rank and address once ``timeout`` expires, never wait forever.
Connections that fail the handshake (garbage, wrong secret, wrong protocol, silence) are
closed and logged and the rank goes on waiting for its real peers: each accepted
connection is challenged on its own thread, so strangers cannot hold up the real ones.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import socket
import threading
import time

from meshcomm.errors import CommTimeoutError, ConfigError, DistributedError

from . import wire
from .engine import WAIT_SLICE
from .hostfile import Peer

__all__ = ["establish", "open_listener", "tune"]

log = logging.getLogger("meshcomm.sockets")

_HANDSHAKE_LIMIT = 5.0  # seconds a connecting stranger gets to complete the handshake


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
                "Set \"bind\" in its hostfile entry (or MESHCOMM_SOCKETS_BIND=0.0.0.0) to listen "
                "on a local address while peers use the advertised one."
            ) from None
        raise DistributedError(f"rank {rank}: cannot listen on {where}: {exc.strerror}") from None
    sock.listen(max(backlog, 8))
    return sock


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake timed out")
        sock.settimeout(min(left, WAIT_SLICE))  # any MLX_TIMEOUT, even beyond a time_t
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            continue  # a slice ended: the loop checks the deadline
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


def _connect_once(peer: Peer, deadline: float) -> socket.socket:
    left = max(0.05, deadline - time.monotonic())
    return socket.create_connection((peer.ip, peer.port), timeout=min(left, 10.0))


def _connect(rank: int, world: int, q: int, peer: Peer, secret: bytes, version: str,
             deadline: float, timeout: float) -> socket.socket:
    delay, last = 0.02, "no attempt"
    while True:
        try:
            sock = _connect_once(peer, deadline)
        except OSError as exc:
            last = exc.strerror or str(exc)
        else:
            try:
                nonce_a = wire.parse_challenge(_recv_exact(sock, wire.CHALLENGE_SIZE, deadline))
                nonce_c = os.urandom(16)
                sock.sendall(wire.hello(secret, nonce_a, wire.Hello(world, rank, q, nonce_c, version)))
                head = _recv_exact(sock, wire.WELCOME_FIXED, deadline)
                rest = _recv_exact(sock, wire.welcome_size(head) - len(head), deadline)
                w = wire.parse_welcome(secret, nonce_c, head + rest)
            except (OSError, wire.HandshakeError) as exc:
                sock.close()
                if isinstance(exc, wire.HandshakeError):
                    raise DistributedError(
                        f"rank {rank}: the process at {peer} (rank {q} in MLX_HOSTFILE) failed the "
                        f"handshake: {exc}"
                    ) from None
                last = str(exc)
            else:
                if w.status != wire.STATUS_OK:
                    sock.close()
                    raise DistributedError(
                        f"rank {rank}: rank {q} at {peer} refused the connection: "
                        f"{wire.STATUS_TEXT.get(w.status, w.status)} (rank {q} runs {w.version!r}, "
                        f"rank {rank} runs {version!r}). Use the same hostfile and the same "
                        "meshcomm versions on every host."
                    )
                if w.rank != q:
                    sock.close()
                    raise DistributedError(
                        f"rank {rank}: {peer} answered as rank {w.rank}, but MLX_HOSTFILE says "
                        f"rank {q} listens there. Every rank must use the same hostfile."
                    )
                return sock
        if time.monotonic() + delay > deadline:
            raise CommTimeoutError(
                f"rank {rank}: could not connect to rank {q} at {peer} within {timeout:g} s "
                f"(last error: {last}). Is rank {q} running, and does it listen on {peer}?",
                peer=q,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _greet(sock: socket.socket, addr: tuple, rank: int, secret: bytes, deadline: float,
           out: queue.Queue[tuple[wire.Hello, socket.socket, tuple]]) -> None:
    """Challenge one accepted connection and queue its valid HELLO (runs on its own thread,
    so a silent or slow stranger delays nobody); strangers are closed and logged."""
    limit = min(deadline, time.monotonic() + _HANDSHAKE_LIMIT)
    try:
        nonce_a = os.urandom(16)
        sock.settimeout(max(0.01, limit - time.monotonic()))
        sock.sendall(wire.challenge(nonce_a))
        head = _recv_exact(sock, wire.HELLO_FIXED, limit)
        rest = _recv_exact(sock, wire.hello_size(head) - len(head), limit)
        out.put((wire.parse_hello(secret, nonce_a, head + rest), sock, addr))
    except (OSError, wire.HandshakeError) as exc:
        log.warning("meshcomm sockets rank %d: rejected a connection from %s: %s", rank, addr[:2], exc)
        sock.close()


def _admit(h: wire.Hello, sock: socket.socket, addr: tuple, rank: int, world: int, pending: set[int],
           secret: bytes, version: str) -> int | None:
    """Answer a valid HELLO: the peer's rank when it is one we wait for, else None (or an
    error for a version or world-size skew, which no waiting can fix)."""
    status = wire.STATUS_OK
    if h.version != version:
        status = wire.STATUS_VERSION
    elif h.world != world:
        status = wire.STATUS_WORLD
    elif h.target != rank or h.rank not in pending:
        status = wire.STATUS_RANK
    try:
        sock.sendall(wire.welcome(secret, h.nonce, wire.Welcome(status, rank, version)))
    except OSError:
        pass
    if status == wire.STATUS_VERSION:
        sock.close()
        raise DistributedError(
            f"rank {rank}: rank {h.rank} runs {h.version!r} but rank {rank} runs {version!r}; "
            "install the same meshcomm versions on every host."
        )
    if status != wire.STATUS_OK:
        log.warning(
            "meshcomm sockets rank %d: rejected %s claiming rank %d of %d (target %d): %s",
            rank, addr[:2], h.rank, h.world, h.target, wire.STATUS_TEXT[status],
        )
        sock.close()
        if status == wire.STATUS_WORLD:
            raise DistributedError(
                f"rank {rank}: rank {h.rank} thinks the job has {h.world} ranks, this rank has "
                f"{world}; every rank must use the same hostfile."
            )
        return None
    return h.rank


def _accept_all(listener: socket.socket, peers: list[Peer], rank: int, secret: bytes, version: str,
                deadline: float, timeout: float) -> dict[int, socket.socket]:
    """Accept every higher rank; each connection is challenged on its own thread."""
    world = len(peers)
    pending = set(range(rank + 1, world))
    conns: dict[int, socket.socket] = {}
    hellos: queue.Queue[tuple[wire.Hello, socket.socket, tuple]] = queue.Queue()
    listener.settimeout(0.01)
    try:
        while pending:
            while not hellos.empty():
                h, sock, addr = hellos.get_nowait()
                q = _admit(h, sock, addr, rank, world, pending, secret, version)
                if q is not None:
                    pending.discard(q)
                    conns[q] = sock
            if not pending:
                break
            if time.monotonic() >= deadline:
                missing = ", ".join(f"{q} ({peers[q]})" for q in sorted(pending))
                raise CommTimeoutError(
                    f"rank {rank}: waited {timeout:g} s for ranks {missing} to connect; they never "
                    "did. Did they start, and do they use the same MLX_HOSTFILE?",
                    peer=min(pending),
                )
            try:
                sock, addr = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_greet, args=(sock, addr, rank, secret, deadline, hellos),
                             name="meshcomm-handshake", daemon=True).start()
    except BaseException:
        for s in conns.values():
            s.close()
        raise
    return conns


def establish(peers: list[Peer], rank: int, *, secret: bytes, version: str, timeout: float,
              bind: str | None = None, listener: socket.socket | None = None) -> dict[int, socket.socket]:
    """Connect this rank to every other rank; returns world rank -> connected socket.

    ``listener`` is an already listening socket (inherited from the launcher); without
    one this rank opens its own on its hostfile port.
    """
    world = len(peers)
    if world == 1:
        if listener is not None:
            listener.close()
        return {}
    deadline = time.monotonic() + timeout
    if listener is None:
        listener = open_listener(rank, peers[rank], bind, world)
    listener.setblocking(True)
    conns: dict[int, socket.socket] = {}
    try:
        for q in range(rank):
            conns[q] = _connect(rank, world, q, peers[q], secret, version, deadline, timeout)
        conns.update(_accept_all(listener, peers, rank, secret, version, deadline, timeout))
    except BaseException:
        for s in conns.values():
            s.close()
        raise
    finally:
        listener.close()
    for s in conns.values():
        tune(s)
        s.setblocking(False)
    return conns
