"""A small authenticated rendezvous: rank 0 serves at the coordinator address, every rank
learns every rank's entry (for example its address), then the connection is closed.

Protocol (TCP, one connection per rank, the job secret ``MESHCOMM_JOB_SECRET`` as key; an
empty key when the job has none)::

    coordinator -> rank : CHALLENGE  magic, nonce_s
    rank -> coordinator : HELLO      magic, nonce_c, client id, rank, size, entry (JSON),
                                     HMAC-SHA256(secret, "hello" || nonce_s || hello)
    coordinator -> rank : REPLY*     kind, body (JSON),
                                     HMAC-SHA256(secret, "reply" || nonce_c || counter || reply)

Replies are WAITING (which ranks rank 0 still waits for; sent when a rank registers and
when the set changes), then one TABLE (every rank's entry, in rank order) or one ERROR.
Both directions are authenticated: a process without the secret can neither register as
a rank (its HELLO is rejected and logged, the job goes on) nor pose as the coordinator
and feed a rank addresses (its replies fail the MAC and the rank stops with an error).
The nonces make every message good for one connection only (no replay).

Rank 0 serves from the calling thread with one selector, so strangers cost no thread; at
most :data:`MAX_PENDING` connections may be in the handshake at once. A flood of silent
connections cannot hold that table: a newcomer to a full table evicts the oldest handshake
once that one had :data:`MIN_HANDSHAKE` seconds (a real rank answers within one round
trip), newcomers wait their turn in the kernel's accept queue, first come first served,
and past half the table each handshake gets :data:`PRESSURE_LIMIT` instead of
:data:`HANDSHAKE_LIMIT`. Connections that never complete a handshake are counted by source
address, and rank 0's timeout error names such a flood. The sockets backend starts with it
when no hostfile gives the peers (:mod:`.rendezvous`); :func:`exchange` takes and returns
plain JSON objects.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import resource
import selectors
import socket
import struct
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshcomm.plugin import SECRET_HINT, CommTimeoutError, Coordinator, DistributedError

from .sockio import recv_exact

__all__ = ["exchange", "local_address", "RendezvousError", "MAX_PENDING", "NO_SECRET_WARNING"]

log = logging.getLogger("meshcomm.coordinator")

MAGIC = b"MCRDV\x00\x00\x01"  # the last byte is the protocol version
#: handshakes in progress at once on rank 0; a newcomer to a full table evicts the oldest
MAX_PENDING = 64
HANDSHAKE_LIMIT = 5.0  # seconds a connection gets to send its HELLO
#: the handshake limit while more than half of MAX_PENDING are taken: under a flood, silent
#: connections are recycled fast
PRESSURE_LIMIT = 1.0
#: seconds a handshake keeps its place in a full table: only a handshake this old is evicted
#: for a newcomer, and until one is, newcomers wait in the kernel's accept queue (in order of
#: arrival, so a flood that reconnects at once queues behind a real rank). A real rank
#: answers the challenge within one round trip. A full accept queue (_BACKLOG) is served in
#: _BACKLOG / MAX_PENDING * MIN_HANDSHAKE = 4 s, less than the HANDSHAKE_LIMIT a rank waits
#: for its challenge.
MIN_HANDSHAKE = 0.5
#: connections without a completed handshake that rank 0 logs one by one; later ones are
#: only counted (a flood must not flood the log too) and summed up at the end
_LOGGED_STRAYS = 5
MAX_ENTRY = 64 * 1024  # bytes of one rank's JSON entry
MAX_REPLY = 256 * 1024 * 1024  # bytes of one reply (the table of a very large job)
_CHALLENGE = struct.Struct("<8s16s")
_HELLO = struct.Struct("<8s16s16sIII")  # magic, nonce_c, client id, rank, size, entry length
_REPLY = struct.Struct("<BI")  # kind, body length
_MAC = 32
WAITING, TABLE, ERROR = 1, 2, 3
_BACKLOG = 512

#: logged once, by rank 0, when a job meets at a coordinator without MESHCOMM_JOB_SECRET
NO_SECRET_WARNING = (
    "meshcomm coordinator (rank 0): MESHCOMM_JOB_SECRET is not set, so any process that can reach the "
    "coordinator's port can register as a rank, learn every rank's address, or pose as the coordinator. "
    f"{SECRET_HINT}."
)


class RendezvousError(DistributedError):
    """The rendezvous cannot complete: a rank registered twice, ranks disagree on the job's
    size, a rank is out of range, or the coordinator is not this job's rank 0."""

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer


def _mac(secret: bytes, label: bytes, nonce: bytes, counter: int, data: bytes) -> bytes:
    return hmac.new(secret, label + nonce + counter.to_bytes(8, "little") + data, hashlib.sha256).digest()


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _host(addr: Any) -> str:
    """The host part of a socket address (what a flood is counted by)."""
    return str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)


def _addr_text(addr: Any) -> str:
    try:
        host, port = addr[0], addr[1]
    except (TypeError, IndexError):
        return str(addr)
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


# -- where to listen and which address to advertise ------------------------------------------


def _is_loopback_name(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_address(coord: Coordinator) -> str:
    """The local address this process uses to reach ``coord`` (what a rank advertises).

    The kernel's route to the coordinator decides, as the source address of a TCP
    connection to it would be (a UDP socket is "connected" to find out: no packet is sent,
    so rank 0 need not be up yet). When the coordinator is named by a host name that
    resolves to a loopback address here (``/etc/hosts`` often maps the host's own name to
    127.0.1.1) ranks on other hosts could not reach a loopback address, so the address of
    the default route is used instead when there is one."""
    try:
        infos = socket.getaddrinfo(coord.host, coord.port, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        infos = []
    for family, stype, proto, _, addr in infos:
        with socket.socket(family, stype, proto) as s:
            try:
                s.connect(addr)
            except OSError:
                continue
            here = s.getsockname()[0]
        if ipaddress.ip_address(here.split("%")[0]).is_loopback and not _is_loopback_name(coord.host):
            outward = _default_route_address(family)
            if outward is not None:
                return outward
        return str(here)
    return "127.0.0.1" if _is_loopback_name(coord.host) else socket.gethostname()


def _default_route_address(family: socket.AddressFamily) -> str | None:
    target = ("2001:db8::1", 9) if family == socket.AF_INET6 else ("198.51.100.1", 9)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(target)
        except OSError:
            return None
        here = str(s.getsockname()[0])
    return None if ipaddress.ip_address(here.split("%")[0]).is_loopback else here


def _listen(coord: Coordinator, size: int) -> tuple[socket.socket, bool]:
    """Rank 0's listening socket at the coordinator address: bound to that address when it
    is on this machine, else on every interface (rank 0 may be reached through a name or a
    forwarded address that is not its own). Returns the socket and whether the address is
    this machine's own."""
    try:
        infos = socket.getaddrinfo(coord.host, coord.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RendezvousError(
            f"rank 0 cannot serve the coordinator at {coord} (from {coord.source}): the host name "
            f"{coord.host!r} does not resolve ({exc.strerror}). Set MLX_COORDINATOR=host:port to an address "
            "of rank 0's machine that every rank can reach.",
            rank=0,
        ) from None
    family, _, _, _, addr = infos[0]
    ip = str(addr[0])
    literal = _is_loopback_name(coord.host) or _is_ip(coord.host)
    candidates = [addr] if literal or not ipaddress.ip_address(ip.split("%")[0]).is_loopback else []
    wildcard = ("::", coord.port, 0, 0) if family == socket.AF_INET6 else ("0.0.0.0", coord.port)
    candidates.append(wildcard)
    last: OSError | None = None
    for i, where in enumerate(candidates):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(where)
        except OSError as exc:
            sock.close()
            last = exc
            if exc.errno == errno.EADDRNOTAVAIL:
                continue  # not an address of this machine: listen on every interface
            break
        sock.listen(max(_BACKLOG, min(size, 4096)))
        return sock, not (i == len(candidates) - 1 and last is not None)
    assert last is not None
    if last.errno == errno.EADDRINUSE:
        raise RendezvousError(
            f"rank 0 cannot serve the coordinator at {coord} (from {coord.source}): port {coord.port} is "
            "already in use by another process (another job's coordinator? under torchrun MASTER_PORT is "
            "torch's own store). Give the job another port: MLX_COORDINATOR=host:port.",
            rank=0,
        )
    raise RendezvousError(
        f"rank 0 cannot serve the coordinator at {coord} (from {coord.source}): {last.strerror or last}. "
        "Set MLX_COORDINATOR=host:port to an address and free port of rank 0's machine.",
        rank=0,
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _raise_fd_limit(size: int) -> None:
    """Rank 0 holds one connection per rank until the table goes out: raise the soft
    open-file limit towards the hard one when a large job needs it."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = size + MAX_PENDING + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            if new > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (OSError, ValueError):
        pass


# -- rank 0: the server -------------------------------------------------------------------------


@dataclass
class _Pending:
    sock: socket.socket
    addr: Any
    nonce_s: bytes
    since: float  # time.monotonic() of its accept
    buf: bytearray = field(default_factory=bytearray)


@dataclass
class _Member:
    sock: socket.socket
    addr: Any
    nonce_c: bytes
    client_id: bytes
    entry: dict
    counter: int = 0


class _Server:
    """Rank 0's side of one rendezvous (runs on the calling thread)."""

    def __init__(self, coord: Coordinator, size: int, entry: dict, secret: bytes, timeout: float) -> None:
        self.coord, self.size, self.entry, self.secret, self.timeout = coord, size, entry, secret, timeout
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.members: dict[int, _Member] = {}
        self.seen: set[int] = set()  # ranks that registered at some point
        self.pending: dict[socket.socket, _Pending] = {}  # in order of accept: the oldest first
        self.refused: list[str] = []
        self.strays: Counter[str] = Counter()  # source host -> connections that never completed a handshake
        self.wrong_secret: Counter[str] = Counter()  # source host -> HELLOs that failed the secret check
        self.evicted = 0
        self.listening = False
        self.changed = False
        self.last_status = 0.0
        self.sel = selectors.DefaultSelector()
        self.own_address = True

    # replies
    def _send(self, m: _Member, kind: int, body: Any) -> bool:
        data = _encode(body)
        head = _REPLY.pack(kind, len(data))
        mac = _mac(self.secret, b"meshcomm rendezvous reply", m.nonce_c, m.counter, head + data)
        m.counter += 1
        try:
            m.sock.settimeout(max(1.0, min(10.0, self.deadline - time.monotonic())))
            m.sock.sendall(head + data + mac)
            return True
        except OSError:
            return False
        finally:
            m.sock.setblocking(False)

    def _missing(self) -> list[int]:
        return [q for q in range(1, self.size) if q not in self.members]

    def _fail(self, exc: DistributedError, kind: str, missing: Sequence[int] = ()) -> DistributedError:
        """Tell every registered rank why the rendezvous failed; returns ``exc`` to raise."""
        for m in self.members.values():
            self._send(m, ERROR, {"kind": kind, "message": str(exc), "missing": list(missing)})
        return exc

    def run(self) -> list[dict]:
        listener, self.own_address = _listen(self.coord, self.size)
        _raise_fd_limit(self.size)
        listener.setblocking(False)
        try:
            while self._missing():
                now = time.monotonic()
                if now >= self.deadline:
                    raise self._timeout()
                self._expire(now)
                if self.changed and now - self.last_status >= 1.0:
                    self._broadcast_waiting()
                wait = min(0.5, self.deadline - now, self._pace(listener, now))
                for key, _ in self.sel.select(timeout=max(0.0, wait)):
                    if key.fileobj is listener:
                        self._accept(listener)
                    else:
                        self._readable(key.fileobj)  # type: ignore[arg-type]
            table = [self.entry] + [self.members[q].entry for q in range(1, self.size)]
            for q, m in sorted(self.members.items()):
                if not self._send(m, TABLE, table):
                    log.warning(
                        "meshcomm coordinator: could not send the table to rank %d at %s; it will "
                        "report the failure itself",
                        q,
                        _addr_text(m.addr),
                    )
            return table
        finally:
            if self.evicted or self.strays.total() > _LOGGED_STRAYS:
                log.warning("meshcomm coordinator (rank 0): the %s", self._strays_text())
            for s in [*self.pending, *(m.sock for m in self.members.values())]:
                self._close(s)
            self.sel.close()
            listener.close()

    def _unfinished(self) -> Counter[str]:
        """Source host -> connections that never completed a handshake (those still in it too)."""
        return self.strays + Counter(_host(p.addr) for p in self.pending.values())

    def _strays_text(self) -> str:
        """How many connections never completed a handshake, and from where (names a flood)."""
        unfinished = self._unfinished()
        host, most = unfinished.most_common(1)[0] if unfinished else ("nowhere", 0)
        evicted = (
            f"; {self.evicted} of them were evicted from the full table of {MAX_PENDING} handshakes to "
            "make room for newer ones"
            if self.evicted
            else ""
        )
        return (
            f"coordinator at {self.coord} saw {unfinished.total()} connections that never completed a "
            f"handshake in the last {round(time.monotonic() - self.started, 1):g} s, most from {host} "
            f"({most}){evicted}"
        )

    def _flooded(self) -> bool:
        """Whether the handshake table filled up: a flood of connections, not a stray one."""
        return self.evicted > 0 or self._unfinished().total() >= MAX_PENDING

    def _timeout(self) -> CommTimeoutError:
        missing = self._missing()
        never = [q for q in missing if q not in self.seen]
        left = [q for q in missing if q in self.seen]
        also = f" Meanwhile: {'; '.join(self.refused[-3:])}." if self.refused else ""
        if left:
            also = f" Ranks {_ranks(left)} registered but closed their connection (they gave up or died)." + also
        if self._flooded():
            host = self._unfinished().most_common(1)[0][0]
            also += (
                f" Rank 0's {self._strays_text()}: a flood of connections, which can keep the job's ranks "
                f"from getting in. Stop what connects from {host} (on that machine, `ss -tnp dport = "
                f":{self.coord.port}` names the process) or block it with a firewall rule, or give the job a "
                "coordinator port that only its own machines can reach (MLX_COORDINATOR=host:port)."
            )
        if self.wrong_secret:
            host, most = self.wrong_secret.most_common(1)[0]
            also += (
                f" {self.wrong_secret.total()} connections sent a HELLO that failed the job secret check, "
                f"most from {host} ({most}): is MESHCOMM_JOB_SECRET the same on every rank?"
            )
        if not self.own_address:
            also += (
                f" Note: {self.coord.host} is not an address of rank 0's machine, so rank 0 listens on every "
                f"interface; if {self.coord} is another machine, the other ranks knock there in vain: point "
                "MLX_COORDINATOR at rank 0's machine."
            )
        what = (
            f"ranks {_ranks(never)} of {self.size}; they never registered. Did they start, and do they reach "
            f"{self.coord}?"
            if never
            else f"ranks {_ranks(missing)} of {self.size} to come back."
        )
        exc = CommTimeoutError(
            f"rank 0: waited {self.timeout:g} s (MLX_TIMEOUT) at the coordinator {self.coord} (from "
            f"{self.coord.source}) for {what}{also}",
            peer=(never or missing)[0],
        )
        return self._fail(exc, "timeout", never or missing)  # type: ignore[return-value]

    def _broadcast_waiting(self) -> None:
        missing = self._missing()
        for m in list(self.members.values()):
            self._send(m, WAITING, {"missing": missing})
        self.changed = False
        self.last_status = time.monotonic()

    def _close(self, sock: socket.socket) -> None:
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _expire(self, now: float) -> None:
        """Drop the handshakes past their limit: HANDSHAKE_LIMIT, or PRESSURE_LIMIT while more
        than half the table is taken (silent connections of a flood are recycled fast)."""
        limit = PRESSURE_LIMIT if len(self.pending) > MAX_PENDING // 2 else HANDSHAKE_LIMIT
        for p in list(self.pending.values()):  # the oldest first
            if now < p.since + limit:
                return
            self._drop(p, f"no HELLO within {limit:g} s")

    def _drop(self, p: _Pending, why: str) -> None:
        """Close a connection that did not complete its handshake and count it by source (a
        flood is named from these counts); only the first few are logged one by one."""
        del self.pending[p.sock]
        self._close(p.sock)
        self.strays[_host(p.addr)] += 1
        n = self.strays.total()
        if n <= _LOGGED_STRAYS:
            log.warning("meshcomm coordinator (rank 0): rejected a connection from %s: %s", _addr_text(p.addr), why)
        if n == _LOGGED_STRAYS:
            log.warning(
                "meshcomm coordinator (rank 0): further connections that do not complete a handshake are "
                "counted, not logged one by one (a summary follows)"
            )

    def _room_at(self) -> float:
        """When a newcomer can have a place in the handshake table: at once while it has room,
        else when its oldest handshake turns MIN_HANDSHAKE (then that one is evicted)."""
        if len(self.pending) < MAX_PENDING:
            return 0.0
        return next(iter(self.pending.values())).since + MIN_HANDSHAKE

    def _pace(self, listener: socket.socket, now: float) -> float:
        """Watch the listener only while a newcomer can have a place: the others wait in the
        kernel's accept queue, in order, instead of being closed (a flood that reconnects at
        once would then overtake a real rank). Returns how long the selector may wait."""
        room_at = self._room_at()
        if (room_at <= now) != self.listening:
            if self.listening:
                self.sel.unregister(listener)
            else:
                self.sel.register(listener, selectors.EVENT_READ, None)
            self.listening = not self.listening
        return 0.5 if self.listening else max(0.0, room_at - now)

    def _accept(self, listener: socket.socket) -> None:
        """Take connections from the accept queue and challenge them while the handshake table
        has a place for them (a full table evicts its oldest handshake once that one had
        MIN_HANDSHAKE); the rest stay queued, in order of arrival."""
        while True:
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                    raise self._fail(
                        DistributedError(
                            f"rank 0: the coordinator at {self.coord} ran out of file descriptors accepting "
                            f"connections ({exc.strerror}; open-file limit {soft}, hard limit {hard}, job size "
                            f"{self.size}). Raise the limit (ulimit -n) on rank 0's machine."
                        ),
                        "config",
                    ) from None
                return
            nonce_s = os.urandom(16)
            try:
                sock.setblocking(False)
                sock.send(_CHALLENGE.pack(MAGIC, nonce_s))  # 24 bytes fit any fresh socket buffer
            except OSError:
                sock.close()
                continue
            if len(self.pending) >= MAX_PENDING:
                self.evicted += 1
                self._drop(
                    next(iter(self.pending.values())),
                    "evicted from the full handshake table "
                    f"({MAX_PENDING} connections without a complete HELLO: a flood?)",
                )
            self.pending[sock] = _Pending(sock, addr, nonce_s, time.monotonic())
            self.sel.register(sock, selectors.EVENT_READ, None)
            if self._room_at() > time.monotonic():
                return  # the rest wait in the accept queue until the oldest handshake had its time

    def _readable(self, sock: socket.socket) -> None:
        p = self.pending.get(sock)
        try:
            chunk = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if p is None:  # a registered rank's connection: it closed (died) or sent junk
            for q, m in list(self.members.items()):
                if m.sock is sock:
                    del self.members[q]
                    self.changed = True
                    log.warning(
                        "meshcomm coordinator (rank 0): rank %d at %s closed its connection before the "
                        "table was ready; waiting for it to register again",
                        q,
                        _addr_text(m.addr),
                    )
            self._close(sock)
            return
        if not chunk:
            return self._drop(p, "closed before its HELLO")
        p.buf += chunk
        if len(p.buf) < _HELLO.size:
            return
        magic, nonce_c, client_id, rank, size, length = _HELLO.unpack(p.buf[: _HELLO.size])
        if magic != MAGIC or length > MAX_ENTRY:
            why = "not a meshcomm rendezvous HELLO" if magic != MAGIC else f"an entry of {length} bytes"
            return self._reject(p, why)
        total = _HELLO.size + length + _MAC
        if len(p.buf) < total:
            return
        if len(p.buf) > total:
            return self._reject(p, "bytes after its HELLO")
        body, mac = bytes(p.buf[:-_MAC]), bytes(p.buf[-_MAC:])
        if not hmac.compare_digest(mac, _mac(self.secret, b"meshcomm rendezvous hello", p.nonce_s, 0, body)):
            self.wrong_secret[_host(p.addr)] += 1
            return self._reject(
                p, "wrong job secret (its MESHCOMM_JOB_SECRET differs, or it is not a rank of this job)"
            )
        try:
            entry = json.loads(body[_HELLO.size :])
        except ValueError:
            entry = None
        if not isinstance(entry, dict):
            return self._reject(p, "its entry is not a JSON object")
        del self.pending[sock]
        self._register(_Member(sock, p.addr, nonce_c, client_id, entry), rank, size)

    def _reject(self, p: _Pending, why: str) -> None:
        log.warning("meshcomm coordinator (rank 0): rejected a connection from %s: %s", _addr_text(p.addr), why)
        del self.pending[p.sock]
        self._close(p.sock)

    def _register(self, m: _Member, rank: int, size: int) -> None:
        where = _addr_text(m.addr)
        problem = None
        if size != self.size:
            problem = (
                f"rank {rank} at {where} says the job has {size} ranks, rank 0 says {self.size}: every "
                "rank must be started with the same world size (check the launcher's -n / WORLD_SIZE)"
            )
        elif rank == 0:
            problem = (
                f"a process at {where} registered as rank 0, but rank 0 is the coordinator itself: two "
                "processes have rank 0 (check the rank variables every process got)"
            )
        elif rank >= self.size:
            problem = f"rank {rank} at {where} is not below the job size {self.size}"
        elif rank in self.members and self.members[rank].client_id != m.client_id:
            first = _addr_text(self.members[rank].addr)
            problem = (
                f"rank {rank} registered twice: from {first} and from {where}. Two processes got the "
                "same rank; check the rank variables each process got (MLX_RANK, SLURM_PROCID, RANK ...)"
            )
        if problem is None:
            old = self.members.pop(rank, None)
            if old is not None:  # the same process again (its first connection broke)
                self._close(old.sock)
            self.members[rank] = m  # its socket stays registered: readable now means it closed
            self.seen.add(rank)
            self._send(m, WAITING, {"missing": self._missing()})
            self.changed = True
            return
        self._send(m, ERROR, {"kind": "config", "message": f"rank 0: {problem}", "missing": []})
        self._close(m.sock)
        if self.secret:  # the claim proved the secret: a real rank, so the job cannot succeed
            raise self._fail(RendezvousError(f"rank 0: {problem}", rank=0, peer=rank), "config")
        log.warning(
            "meshcomm coordinator (rank 0): refused %s (without a job secret anybody can claim anything, "
            "so the job goes on waiting for its real ranks)",
            problem,
        )
        self.refused.append(problem)


def _ranks(qs: Sequence[int]) -> str:
    shown = ", ".join(str(q) for q in qs[:20])
    return shown + (f" and {len(qs) - 20} more" if len(qs) > 20 else "")


# -- every other rank: the client --------------------------------------------------------------


class _Refused(Exception):
    """The coordinator closed the connection without an authenticated answer (retry).
    ``after_hello``: it did so after this rank's HELLO (only then can the secret be why)."""

    def __init__(self, message: str, *, after_hello: bool) -> None:
        super().__init__(message)
        self.after_hello = after_hello


def _closed_hint(before: int, after: int) -> str:
    """What the coordinator's closing without an answer can mean. Only a close after this
    rank's HELLO can be a refusal of its secret; a flood of connections to rank 0 (which its
    own error names) drops handshakes too, so neither is claimed as the cause."""
    hint = ""
    if before:
        hint += (
            f" {before} attempt(s) ended before this rank could send its HELLO (the process there closed the "
            f"connection or sent no challenge within {HANDSHAKE_LIMIT:g} s), so not over the secret: rank 0 "
            "drops handshakes when a flood of connections fills its table (its own error then names the "
            "flood), or it is another program on that port."
        )
    if after:
        hint += (
            f" The process there closed the connection {after} time(s) after this rank's HELLO without an "
            "answer: rank 0 refuses a HELLO that fails the job secret check (its log then says 'wrong job "
            "secret': is MESHCOMM_JOB_SECRET the same on every rank?), and drops handshakes under a flood of "
            "connections (its error then names the flood)."
        )
    return hint


def _join(coord: Coordinator, rank: int, size: int, entry: dict, secret: bytes, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    client_id = os.urandom(16)
    delay, last, before, after = 0.02, "no attempt", 0, 0
    while True:
        left = deadline - time.monotonic()
        try:
            sock = socket.create_connection((coord.host, coord.port), timeout=max(0.05, min(left, 5.0)))
        except OSError as exc:
            last = exc.strerror or str(exc)
        else:
            try:
                return _session(sock, coord, rank, size, entry, secret, client_id, deadline, timeout)
            except _Refused as exc:
                after += exc.after_hello
                before += not exc.after_hello
                last = str(exc)
            finally:
                sock.close()
        if time.monotonic() + delay >= deadline:
            raise CommTimeoutError(
                f"rank {rank}: could not reach the coordinator at {coord} (from {coord.source}) within "
                f"{timeout:g} s (MLX_TIMEOUT); last error: {last}.{_closed_hint(before, after)} Is rank 0 running, "
                f"and can this machine reach {coord}? Set MLX_COORDINATOR=host:port to an address of rank 0's "
                "machine.",
                peer=0,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _session(
    sock: socket.socket,
    coord: Coordinator,
    rank: int,
    size: int,
    entry: dict,
    secret: bytes,
    client_id: bytes,
    deadline: float,
    timeout: float,
) -> list[dict]:
    """One connection to the coordinator: handshake, then replies until the table."""
    limit = min(deadline, time.monotonic() + HANDSHAKE_LIMIT)
    try:
        challenge = recv_exact(sock, _CHALLENGE.size, limit)
    except (OSError, TimeoutError) as exc:
        raise _Refused(f"no challenge from {coord} ({exc})", after_hello=False) from None
    magic, nonce_s = _CHALLENGE.unpack(challenge)
    if magic != MAGIC:
        other = " (another meshcomm version: use the same version on every rank)" if magic[:5] == MAGIC[:5] else ""
        raise RendezvousError(
            f"rank {rank}: the process at {coord} (from {coord.source}) is not a meshcomm coordinator{other}. "
            "Point MLX_COORDINATOR at a free port of rank 0's machine (under torchrun, MASTER_PORT is torch's "
            "own store; meshcomm uses MASTER_PORT + 1).",
            rank=rank,
            peer=0,
        )
    nonce_c = os.urandom(16)
    data = _encode(entry)
    body = _HELLO.pack(MAGIC, nonce_c, client_id, rank, size, len(data)) + data
    try:
        sock.sendall(body + _mac(secret, b"meshcomm rendezvous hello", nonce_s, 0, body))
    except OSError as exc:
        raise _Refused(f"{coord} closed the connection during the handshake ({exc})", after_hello=False) from None
    counter, missing = 0, None
    while True:
        try:
            head = recv_exact(sock, _REPLY.size, deadline)
            kind, length = _REPLY.unpack(head)
            if length > MAX_REPLY:
                raise _forged(rank, coord, f"a reply of {length} bytes")
            rest = recv_exact(sock, length + _MAC, deadline)
        except TimeoutError:
            said = (
                f"; it was still waiting for ranks {_ranks(missing)}"
                if missing
                else ""
                if missing is not None
                else "; it never answered this rank's HELLO"
            )
            ask = (
                "Did every rank start, with the same MESHCOMM_JOB_SECRET?"
                if missing is not None
                else "Is rank 0 still running? (It refuses a HELLO that fails the secret by closing the connection, "
                "not by silence.)"
            )
            raise CommTimeoutError(
                f"rank {rank}: the coordinator at {coord} (rank 0) sent no table within {timeout:g} s "
                f"(MLX_TIMEOUT){said}. {ask}",
                peer=missing[0] if missing else 0,
            ) from None
        except OSError as exc:
            if counter == 0:
                raise _Refused(
                    f"{coord} closed the connection without answering its HELLO ({exc})", after_hello=True
                ) from None
            raise RendezvousError(
                f"rank {rank}: rank 0 (the coordinator at {coord}) closed the connection before sending the "
                "table: it failed or was stopped (its own error says why).",
                rank=rank,
                peer=0,
            ) from None
        data, mac = rest[:length], rest[length:]
        if not hmac.compare_digest(mac, _mac(secret, b"meshcomm rendezvous reply", nonce_c, counter, head + data)):
            raise _forged(rank, coord, "a reply that fails the job secret check")
        counter += 1
        try:
            msg = json.loads(data)
        except ValueError:
            raise _forged(rank, coord, "an authenticated reply that is not JSON") from None
        if kind == WAITING:
            missing = [int(q) for q in msg.get("missing", [])]
        elif kind == ERROR:
            text = f"rank {rank}: the coordinator at {coord} says: {msg.get('message', '?')}"
            if msg.get("kind") == "timeout":
                gone = [int(q) for q in msg.get("missing", [])]
                raise CommTimeoutError(text, peer=gone[0] if gone else 0)
            raise RendezvousError(text, rank=rank, peer=0)
        elif kind == TABLE:
            return _check_table(msg, rank, size, entry, coord)
        else:
            raise _forged(rank, coord, f"a reply of unknown kind {kind}")


def _forged(rank: int, coord: Coordinator, what: str) -> RendezvousError:
    return RendezvousError(
        f"rank {rank}: the process at {coord} (from {coord.source}) sent {what}: it is not this job's rank 0 "
        "(a coordinator of another job or an impostor on that port), or MESHCOMM_JOB_SECRET differs between "
        "this rank and rank 0. Nothing it sent was used.",
        rank=rank,
        peer=0,
    )


def _check_table(table: Any, rank: int, size: int, entry: dict, coord: Coordinator) -> list[dict]:
    if (
        not isinstance(table, list)
        or len(table) != size
        or not all(isinstance(e, dict) for e in table)
        or table[rank] != json.loads(_encode(entry))
    ):
        raise RendezvousError(
            f"rank {rank}: the table from the coordinator at {coord} does not list {size} entries with this "
            "rank's own at its place; every rank must run the same meshcomm version.",
            rank=rank,
            peer=0,
        )
    return table


# -- the entry point ----------------------------------------------------------------------------

_warned = False


def exchange(
    coord: Coordinator, rank: int, size: int, entry: dict, *, secret: bytes, timeout: float, warn_no_secret: bool = True
) -> list[dict]:
    """Every rank's ``entry``, in rank order, learnt through the coordinator ``coord``.

    Rank 0 serves at ``coord`` until all ``size`` ranks registered; every other rank
    connects (retrying until ``timeout`` seconds have passed), proves ``secret`` and checks
    that the coordinator proves it too. ``entry`` is a JSON object (for example
    ``{"ip": ..., "port": ...}``) of at most 64 KiB.

    Raises CommTimeoutError naming the ranks that did not register (or the unreachable
    coordinator) within ``timeout``, RendezvousError for a rank registered twice, a size
    mismatch or a coordinator that fails the secret; ValueError for bad arguments.
    Without a secret it works, and rank 0 logs :data:`NO_SECRET_WARNING` once
    (``warn_no_secret=False`` when the caller warns itself).
    """
    global _warned
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} and size {size}: need 0 <= rank < size")
    if not isinstance(entry, dict):
        raise ValueError(f"entry must be a JSON object (a dict), got {type(entry).__name__}")
    data = _encode(entry)  # TypeError here for what JSON cannot hold
    if len(data) > MAX_ENTRY:
        raise ValueError(f"entry of {len(data)} bytes as JSON; at most {MAX_ENTRY}")
    if size == 1:
        return [json.loads(data)]
    if rank == 0:
        if not secret and warn_no_secret and not _warned:
            _warned = True
            log.warning(NO_SECRET_WARNING)
        return _Server(coord, size, json.loads(data), secret, timeout).run()
    return _join(coord, rank, size, entry, secret, timeout)
