"""Bytes on the wire: the start-up handshake, the per-connection keys, and the frames.

Handshake (per connection, the higher rank connects to the lower one)::

    acceptor  -> connector : CHALLENGE  magic, protocol, nonce_a
    connector -> acceptor  : HELLO      magic, protocol, world size, rank, target rank,
                                        nonce_c, versions, HMAC(secret, nonce_a || hello)
    acceptor  -> connector : WELCOME    magic, protocol, status, rank, versions,
                                        HMAC(secret, nonce_c || welcome)

The HMAC key is the per-job secret (``MESHCOMM_JOB_SECRET``, empty when there is none),
so a stranger without it is rejected, and garbage fails on the magic first. The WELCOME
names the acceptor's versions only to a peer that proved a non-empty secret. HELLO and
WELCOME also carry each side's view of the connection (:func:`connection_view`: both
ends' addresses and ports): when the two views differ, something (a relay, a proxy, NAT)
sits between the ranks, whatever the addresses look like.

After the handshake both sides derive two keys from the secret and both nonces
(HKDF-SHA256, :func:`derive_keys`): one per direction. Every frame then is::

    header (28 bytes) | tag (16) | payload (nbytes) | payload tag (16, see below)

The header names the group, the call's sequence number (modulo 2**32, see
:func:`next_seq`), the operation, the dtype, the payload size, the call's argument (the
root of a rooted operation, else 0) and the call's element count, so a receiver detects
any disagreement between ranks before it uses a byte of payload. The tag is
HMAC-SHA256(direction key, "H" || frame counter || header) truncated to 16 bytes: the
counter (frames sent so far on this connection in this direction, never on the wire)
makes a replayed, dropped or reordered frame fail too. The payload tag is
HMAC-SHA256(key, "P" || counter || payload)[:16]; ABORT frames and the frames of start-up
control exchanges (shared-memory set-up) always carry it, data frames when payload
integrity is on (``MESHCOMM_SOCKETS_INTEGRITY``, see :data:`INTEGRITY_MODES`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
import struct
from dataclasses import dataclass

from meshcomm.plugin import wire_names

__all__ = [
    "MAGIC",
    "PROTOCOL",
    "HEADER",
    "HEADER_SIZE",
    "OPS",
    "OP_CODES",
    "ABORT",
    "ENDED",
    "SHAPE_SHIFT",
    "COUNT_MASK",
    "call_total",
    "HandshakeError",
    "Hello",
    "Welcome",
    "challenge",
    "parse_challenge",
    "hello",
    "parse_hello",
    "welcome",
    "parse_welcome",
    "connection_view",
    "CHALLENGE_SIZE",
    "HELLO_FIXED",
    "WELCOME_FIXED",
    "MAX_VERSION",
    "STATUS_OK",
    "STATUS_VERSION",
    "STATUS_WORLD",
    "STATUS_RANK",
    "STATUS_CROSSING",
    "STATUS_TEXT",
    "SEQ_MASK",
    "next_seq",
    "TAG",
    "FRAME_HEAD",
    "Mac",
    "derive_keys",
    "INTEGRITY_MODES",
]

MAGIC = b"MESHCOMM"
PROTOCOL = 3  # 2: the header carries the call's argument (root); 3: authenticated frames
MAX_VERSION = 512  #: bytes of a HELLO's or WELCOME's variable part: version, view, view length
VERSION_BYTES = 256  #: at most this much of the version string is sent
VIEW_BYTES = 255  #: and of the connection view

#: group u32, seq u32, op u16, dtype u16, nbytes u32, arg u32 (root), total u64
HEADER = struct.Struct("<IIHHIIQ")
HEADER_SIZE = HEADER.size
#: bytes of a frame's header tag and of its payload tag
TAG = 16
#: a frame's header with its tag
FRAME_HEAD = HEADER_SIZE + TAG
#: MESHCOMM_SOCKETS_INTEGRITY: "payload" (every data frame's payload authenticated) or
#: "header" (headers and control frames only; array payloads are not checked)
INTEGRITY_MODES = ("payload", "header")
#: sequence numbers live in the header's 32 bits and wrap around
SEQ_MASK = 0xFFFFFFFF


def next_seq(seq: int) -> int:
    """The sequence number after ``seq``: counts modulo 2**32, so a job may make any number
    of calls (ranks compare numbers only for equality, never for order)."""
    return (seq + 1) & SEQ_MASK


#: opcodes are the core's operation codes (meshcomm.protocol.operations), which are never reused
OPS = wire_names()
OP_CODES = {name: i for i, name in enumerate(OPS) if name != "?"}
#: a call's ``total`` (frame header, shared-memory descriptor): the element count in the low
#: SHAPE_SHIFT bits, the core's shape key (Backend.shape_key, < 2**23) above them, so that
#: two shapes of one element count are different calls (counts of 2**40 or more carry no key)
SHAPE_SHIFT = 40
COUNT_MASK = (1 << SHAPE_SHIFT) - 1


def call_total(count: int, key: int) -> int:
    """The ``total`` of a call on ``count`` elements whose shape has ``key``."""
    return count | (key << SHAPE_SHIFT) if key and count <= COUNT_MASK else count


#: the opcode of an ABORT frame, which carries the kind of failure in the dtype field
#: (1 peer lost, 2 timeout, 3 mismatch, 4 other: engine._KIND_OF; :data:`ENDED`)
ABORT = 0xFFFF
#: the kind of the ABORT frame a rank sends each peer when its program ends normally: no
#: failure, only "nothing more comes from me", so that a peer still waiting on it can say
#: the rank's program ended rather than that it crashed
ENDED = 5

STATUS_OK, STATUS_VERSION, STATUS_WORLD, STATUS_RANK, STATUS_CROSSING = 0, 1, 2, 3, 4
STATUS_TEXT = {
    STATUS_OK: "ok",
    STATUS_VERSION: "version skew",
    STATUS_WORLD: "different world size",
    STATUS_RANK: "unexpected rank",
    #: two ranks that connect only when needed dialled each other at once: the lower rank's
    #: connection is the one kept, the other side waits for it
    STATUS_CROSSING: "crossing connections",
}

_CHALLENGE = struct.Struct("<8sH16s")
CHALLENGE_SIZE = _CHALLENGE.size
_HELLO = struct.Struct("<8sHIII16sH")  # + version bytes + 32-byte mac
HELLO_FIXED = _HELLO.size
_WELCOME = struct.Struct("<8sHHIH")  # + version bytes + 32-byte mac
WELCOME_FIXED = _WELCOME.size
_MAC = 32


class HandshakeError(ValueError):
    """The peer's handshake bytes are not a valid meshcomm handshake (or fail the secret)."""


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def challenge(nonce: bytes) -> bytes:
    return _CHALLENGE.pack(MAGIC, PROTOCOL, nonce)


def parse_challenge(data: bytes) -> bytes:
    """Return nonce_a; HandshakeError unless ``data`` is a CHALLENGE of our protocol."""
    if len(data) != CHALLENGE_SIZE:
        raise HandshakeError(f"challenge of {len(data)} bytes, expected {CHALLENGE_SIZE}")
    magic, proto, nonce = _CHALLENGE.unpack(data)
    if magic != MAGIC:
        raise HandshakeError("not a meshcomm peer (bad magic)")
    if proto != PROTOCOL:
        raise HandshakeError(f"peer speaks sockets protocol {proto}, this rank speaks {PROTOCOL}")
    return nonce


def connection_view(sock: socket.socket, connector: bool) -> str:
    """``"connector ip:port > acceptor ip:port"`` as this end of ``sock`` sees it (IPv4-mapped
    IPv6 addresses written as IPv4): the same text on both ends of a direct connection."""

    def where(addr: tuple) -> str:
        ip = ipaddress.ip_address(addr[0].split("%", 1)[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        return f"{mapped or ip}:{addr[1]}"

    try:
        mine, theirs = where(sock.getsockname()), where(sock.getpeername())
    except (OSError, ValueError, IndexError, TypeError):
        return "?"
    return f"{mine} > {theirs}" if connector else f"{theirs} > {mine}"


def _pack_text(version: str, view: str) -> bytes:
    """The variable part: version bytes, view bytes, then the view's length (one byte)."""
    v, w = version.encode()[:VERSION_BYTES], view.encode()[:VIEW_BYTES]
    return v + w + bytes([len(w)])


def _unpack_text(var: bytes) -> tuple[str, str]:
    """(version, view) of a variable part made by :func:`_pack_text`."""
    if not var or var[-1] + 1 > len(var):
        raise HandshakeError("malformed version and view field")
    n = var[-1]
    return (var[: len(var) - 1 - n].decode("utf-8", "replace"), var[len(var) - 1 - n : -1].decode("utf-8", "replace"))


@dataclass(frozen=True)
class Hello:
    world: int
    rank: int
    target: int
    nonce: bytes
    version: str
    view: str = ""  #: the connector's connection_view


def hello(secret: bytes, nonce_a: bytes, h: Hello) -> bytes:
    v = _pack_text(h.version, h.view)
    body = _HELLO.pack(MAGIC, PROTOCOL, h.world, h.rank, h.target, h.nonce, len(v)) + v
    return body + _mac(secret, nonce_a, body)


def _message_size(prefix: bytes, layout: struct.Struct, what: str) -> int:
    """Total size of a HELLO or WELCOME once its fixed part is known: the fixed part
    starts with magic and protocol and ends with the version length (HandshakeError on garbage)."""
    if len(prefix) < layout.size:
        raise HandshakeError(f"short {what}")
    fields = layout.unpack(prefix[: layout.size])
    magic, proto, vlen = fields[0], fields[1], fields[-1]
    if magic != MAGIC:
        raise HandshakeError("not a meshcomm peer (bad magic)")
    if proto != PROTOCOL:
        raise HandshakeError(f"peer speaks sockets protocol {proto}, this rank speaks {PROTOCOL}")
    if vlen > MAX_VERSION:
        raise HandshakeError(f"version string of {vlen} bytes (max {MAX_VERSION})")
    return layout.size + vlen + _MAC


def hello_size(prefix: bytes) -> int:
    """Total HELLO size once its fixed part is known (HandshakeError on garbage)."""
    return _message_size(prefix, _HELLO, "hello")


def _authenticated(
    data: bytes, layout: struct.Struct, what: str, secret: bytes, nonce: bytes, refusal: str
) -> tuple[tuple, bytes]:
    """The fixed fields and the variable part of a HELLO/WELCOME whose size and MAC are right."""
    size = _message_size(data, layout, what)
    if len(data) != size:
        raise HandshakeError(f"{what} of {len(data)} bytes, expected {size}")
    body, mac = data[:-_MAC], data[-_MAC:]
    if not hmac.compare_digest(mac, _mac(secret, nonce, body)):
        raise HandshakeError(refusal)
    return layout.unpack(data[: layout.size]), data[layout.size : -_MAC]


def parse_hello(secret: bytes, nonce_a: bytes, data: bytes) -> Hello:
    """Decode and authenticate a HELLO; HandshakeError on anything wrong."""
    fields, version = _authenticated(
        data, _HELLO, "hello", secret, nonce_a, "wrong job secret (MESHCOMM_JOB_SECRET differs or is missing)"
    )
    _magic, _proto, world, rank, target, nonce, _vlen = fields
    return Hello(world, rank, target, nonce, *_unpack_text(version))


@dataclass(frozen=True)
class Welcome:
    status: int
    rank: int
    version: str
    view: str = ""  #: the acceptor's connection_view


def welcome(secret: bytes, nonce_c: bytes, w: Welcome) -> bytes:
    v = _pack_text(w.version, w.view)
    body = _WELCOME.pack(MAGIC, PROTOCOL, w.status, w.rank, len(v)) + v
    return body + _mac(secret, nonce_c, body)


def welcome_size(prefix: bytes) -> int:
    """Total WELCOME size once its fixed part is known (HandshakeError on garbage)."""
    return _message_size(prefix, _WELCOME, "welcome")


def parse_welcome(secret: bytes, nonce_c: bytes, data: bytes) -> Welcome:
    """Decode and authenticate a WELCOME; HandshakeError on anything wrong."""
    fields, version = _authenticated(
        data, _WELCOME, "welcome", secret, nonce_c, "peer failed the job secret check (MESHCOMM_JOB_SECRET differs)"
    )
    _magic, _proto, status, rank, _vlen = fields
    return Welcome(status, rank, *_unpack_text(version))


def derive_keys(secret: bytes, nonce_a: bytes, nonce_c: bytes) -> tuple[bytes, bytes]:
    """(connector -> acceptor key, acceptor -> connector key) of one connection: HKDF-SHA256
    (RFC 5869) with the job secret as input key material and both handshake nonces as salt,
    so every connection (and every direction) has its own keys even with one job secret."""
    prk = hmac.new(nonce_a + nonce_c, secret, hashlib.sha256).digest()
    c2a = hmac.new(prk, b"meshcomm sockets 3 connector->acceptor\x01", hashlib.sha256).digest()
    a2c = hmac.new(prk, b"meshcomm sockets 3 acceptor->connector\x01", hashlib.sha256).digest()
    return c2a, a2c


class Mac:
    """HMAC-SHA256 under one direction key, with the key's pads hashed once (a frame tag
    then costs two hash-state copies, not a key schedule)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        block = key.ljust(64, b"\0") if len(key) <= 64 else hashlib.sha256(key).digest().ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def tag(self, kind: bytes, counter: int, data: bytes | memoryview) -> bytes:
        """The 16-byte tag of ``data`` (``kind``: b"H" header, b"P" payload) as frame ``counter``."""
        inner = self._inner.copy()
        inner.update(kind + counter.to_bytes(8, "little"))
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:TAG]

    def seal(self, counter: int, header: bytes) -> bytes:
        """``header`` followed by its tag (what goes on the wire)."""
        return header + self.tag(b"H", counter, header)
