"""Growing a world: new processes join when its ranks call ``grow()``.

A newcomer (``mc.init(join=True)``, ``MESHCOMM_JOIN=1``; ``meshcomm launch --restart-lost``
starts replacements that way) knows the job's hostfile and secret. It dials every address
in the hostfile at once and waits. Only the world's rank 0, *the door*, answers, and only
inside ``grow()``: it takes every connection waiting in its listening socket, runs the
usual handshake (the job secret's proof both ways, marked as a join so no other handshake
can be mistaken for one), and reads each newcomer's address. A process without the secret
fails the handshake and is turned away; the world goes on.

The door then tells its world who joins (a broadcast inside the world, authenticated),
sends each newcomer its rank (the next free numbers, in order of arrival), the addresses
of everyone and the world's number, and every rank, old and new, connects to every other
one for the larger world. Nobody waiting: ``grow()`` returns at once and the world goes on
as it is. A newcomer not admitted within ``MLX_TIMEOUT`` raises CommTimeoutError.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from meshcomm.plugin import CommTimeoutError, DistributedError

from . import wire
from .connect import Connection, _connect_once, _direct, _Greeters, _Hello, establish, phase_version
from .hostfile import Peer
from .recovery import Recovery, _agree_key, read_message, seal_message
from .sockio import recv_exact

__all__ = ["admit_waiting", "announce", "connect_world", "share", "join", "Joiner", "JOIN_LIMIT"]

log = logging.getLogger("meshcomm.sockets")

#: seconds the door gives a waiting newcomer's handshake (a real one answers in one round trip)
JOIN_LIMIT = 2.0
#: seconds between a newcomer's attempts to reach an address that did not answer
_RETRY = 0.2


@dataclass
class Joiner:
    """A newcomer the door admitted: its connection and the address it listens on."""

    conn: Connection
    peer: Peer


def admit_waiting(rec: Recovery) -> list[Joiner]:
    """At the door: every newcomer waiting in the listening socket that proves the secret."""
    me = rec.rank
    version = phase_version(rec.version, "join")
    deadline = time.monotonic() + JOIN_LIMIT
    hellos: queue.Queue[_Hello] = queue.Queue()
    greeters = _Greeters()
    rec.listener.setblocking(False)
    try:
        while True:
            try:
                sock, addr = rec.listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            greeters.greet(sock, addr, me, rec.secret, deadline, hellos.put)
    finally:
        rec.listener.setblocking(True)
    while greeters.count and time.monotonic() < deadline:
        time.sleep(0.005)
    joiners: list[Joiner] = []
    while not hellos.empty():
        got = hellos.get_nowait()
        h, sock = got.hello, got.sock
        if h.version != version:  # a late connection of a recovery, or a stranger's claim
            log.info("meshcomm sockets rank %d: turned away %s (not a join: %r)", me, got.addr[:2], h.version)
            sock.close()
            continue
        view = wire.connection_view(sock, connector=False)
        try:
            sock.sendall(wire.welcome(rec.secret, h.nonce, wire.Welcome(wire.STATUS_OK, me, version, view)))
            c2a, a2c = wire.derive_keys(rec.secret, got.nonce_a, h.nonce)
            entry = read_message(sock, _agree_key(c2a), 0, time.monotonic() + JOIN_LIMIT, f"newcomer {got.addr[0]}")
            peer = Peer(ip=str(entry["ip"]), port=int(entry["port"]))
        except (OSError, ValueError, KeyError, DistributedError) as exc:
            log.warning("meshcomm sockets rank %d: a newcomer from %s failed to join: %s", me, got.addr[:2], exc)
            sock.close()
            continue
        joiners.append(Joiner(Connection(sock, a2c, c2a, _direct(me, -1, view, h.view)), peer))
    return joiners


def announce(joiners: list[Joiner], nxt: Recovery) -> None:
    """At the door: tell each newcomer its rank, everyone's address and the number of the
    world ``nxt`` (the larger world's recovery, as this rank holds it) they all join."""
    first = len(nxt.peers) - len(joiners)
    for i, j in enumerate(joiners):
        msg = {"rank": first + i, "peers": [p.model_dump() for p in nxt.peers], "epoch": nxt.epoch}
        try:
            j.conn.sock.settimeout(nxt.timeout)
            j.conn.sock.sendall(seal_message(_agree_key(j.conn.send_key), 0, msg))
        except OSError as exc:  # it is gone: the larger world finds out when it connects
            log.warning("meshcomm sockets rank %d: could not tell newcomer %s its rank: %s", nxt.rank, j.peer, exc)
        finally:
            j.conn.sock.close()


def connect_world(rec: Recovery) -> dict[int, Connection]:
    """Connect this rank to every other of the world ``rec`` belongs to (old ranks and newcomers
    alike), in a handshake marked with its epoch."""
    version = phase_version(rec.version, "world", rec.epoch)
    return establish(
        rec.peers,
        rec.rank,
        secret=rec.secret,
        version=version,
        timeout=rec.timeout,
        listener=rec.listener,
        keep_listener=True,
    )


def share(backend: Any, joiners: list[Joiner]) -> list[Peer]:
    """Inside the world (``backend``, a SocketsBackend): every rank learns the newcomers'
    addresses from the door (rank 0)."""
    blob = json.dumps([j.peer.model_dump() for j in joiners]).encode() if backend.rank() == 0 else b""
    size = np.array([len(blob)], np.int64)
    with backend.fabric.sealed():  # membership steers the job: always authenticated
        backend.broadcast(size, 0)
        data = np.frombuffer(blob, np.uint8).copy() if backend.rank() == 0 else np.empty(int(size[0]), np.uint8)
        if data.size:
            backend.broadcast(data, 0)
    return [Peer(**p) for p in json.loads(data.tobytes() or b"[]")]


def join(
    hint: list[Peer], slot: int, secret: bytes, version: str, timeout: float, listener: socket.socket
) -> tuple[int, list[Peer], int]:
    """On a newcomer: wait at every address of ``hint`` (the job's hostfile; ``slot`` is this
    process's own entry) until a door admits it; returns (rank, everyone's address, the
    world's number)."""
    deadline = time.monotonic() + timeout
    host, port = listener.getsockname()[:2]
    entry = {"ip": hint[slot].ip if 0 <= slot < len(hint) else host, "port": int(port)}
    won: queue.Queue[tuple[socket.socket, bytes, bytes]] = queue.Queue()
    done = threading.Event()
    errors: list[str] = []

    def dial(q: int) -> None:
        while not done.is_set() and time.monotonic() < deadline:
            sock = None
            try:
                sock = _connect_once(hint[q], deadline)
                nonce_a = wire.parse_challenge(recv_exact(sock, wire.CHALLENGE_SIZE, deadline, during="a join"))
                nonce_c = os.urandom(16)
                view = wire.connection_view(sock, connector=True)
                hello = wire.Hello(0, slot, q, nonce_c, phase_version(version, "join"), view)
                sock.sendall(wire.hello(secret, nonce_a, hello))
                head = recv_exact(sock, wire.WELCOME_FIXED, deadline, during="a join")
                rest = recv_exact(sock, wire.welcome_size(head) - len(head), deadline, during="a join")
                w = wire.parse_welcome(secret, nonce_c, head + rest)
                if w.status != wire.STATUS_OK:
                    raise DistributedError(f"refused: {wire.STATUS_TEXT.get(w.status, w.status)}")
                c2a, a2c = wire.derive_keys(secret, nonce_a, nonce_c)
                sock.sendall(seal_message(_agree_key(c2a), 0, entry))
                if done.is_set():
                    sock.close()
                    return
                done.set()
                won.put((sock, c2a, a2c))
                return
            except (OSError, wire.HandshakeError, DistributedError) as exc:
                errors.append(f"{hint[q]}: {exc}")
                if sock is not None:
                    sock.close()
                if isinstance(exc, wire.HandshakeError):
                    return  # not a meshcomm rank of this job: no use trying again
                time.sleep(_RETRY)

    threads = [threading.Thread(target=dial, args=(q,), daemon=True) for q in range(len(hint)) if q != slot]
    for t in threads:
        t.start()
    try:
        sock, _c2a, a2c = won.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        done.set()
        raise CommTimeoutError(
            f"newcomer (hostfile entry {slot}): no rank admitted it within MLX_TIMEOUT={timeout:g} s; the job's "
            "ranks admit newcomers when they call grow() (last errors: "
            f"{'; '.join(errors[-3:]) or 'none'})"
        ) from None
    try:
        msg = read_message(sock, _agree_key(a2c), 0, deadline, "the door")
    finally:
        sock.close()
    peers = [Peer(**p) for p in msg["peers"]]
    return int(msg["rank"]), peers, int(msg["epoch"])
