"""Hostile input on the sockets backend's wire: handshake parsers, frame headers, a live job.

* The handshake parsers accept only well-formed, authenticated messages: anything else is a
  ``HandshakeError`` (a ValueError), never another exception, and every size they derive
  from a peer's bytes is bounded (no allocation the peer controls).
* The frame-header check (``Fabric._check`` through the receive loop) turns any header that
  differs from the expected call into a ``DistributedError`` subclass — mismatch, or the
  ABORT a peer sent — within a bounded time and memory, whatever the 28 bytes say.
* Frame authentication: any changed bit of a header, its tag, a payload or its tag, an
  ABORT's message, a replayed frame or a frame made without the key is a ``FrameAuthError``
  and nothing it says (an ABORT's text) reaches the user; the per-connection keys differ
  per connection and direction.
* A live 2-rank job keeps working while a fuzzer hammers rank 0's listening port during
  start-up; each rejected connection is logged.
* A send/recv pair that disagrees on shape or dtype is a ``CollectiveMismatchError`` on both
  ranks (without ``MLX_DEBUG``).
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jobs import connect_when_listening, finish, free_ports, start_ranks, tcp_pair, write_hostfile
from meshcomm.protocol.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    DistributedError,
    PeerLostError,
)

wire = pytest.importorskip("meshcomm_sockets.wire")
engine = pytest.importorskip("meshcomm_sockets.engine")

HELLO_MAX = wire.HELLO_FIXED + wire.MAX_VERSION + 32
WELCOME_MAX = wire.WELCOME_FIXED + wire.MAX_VERSION + 32
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u32 = st.integers(0, 2**32 - 1)
u16 = st.integers(0, 2**16 - 1)
nonces = st.binary(min_size=16, max_size=16)
secrets_ = st.binary(max_size=40)


def _prefixed(fixed: int, magic_proto: bytes) -> st.SearchStrategy[bytes]:
    """Bytes that pass the magic and protocol check more often than random bytes would."""
    return st.one_of(
        st.binary(max_size=fixed * 3),
        st.binary(min_size=fixed - len(magic_proto), max_size=fixed * 3).map(lambda b: magic_proto + b),
    )


GOOD_HEAD = wire.MAGIC + struct.pack("<H", wire.PROTOCOL)


# -- handshake parsers ---------------------------------------------------------------------------


@FUZZ
@given(_prefixed(wire.CHALLENGE_SIZE, GOOD_HEAD))
def test_parse_challenge_only_raises_handshake_error(data: bytes) -> None:
    try:
        nonce = wire.parse_challenge(data)
    except wire.HandshakeError:
        return
    assert len(data) == wire.CHALLENGE_SIZE and data.startswith(GOOD_HEAD) and nonce == data[-16:]


@FUZZ
@given(_prefixed(wire.HELLO_FIXED, GOOD_HEAD))
def test_hello_size_is_bounded(data: bytes) -> None:
    try:
        size = wire.hello_size(data)
    except wire.HandshakeError:
        return
    assert wire.HELLO_FIXED + 32 <= size <= HELLO_MAX


@FUZZ
@given(_prefixed(wire.WELCOME_FIXED, GOOD_HEAD))
def test_welcome_size_is_bounded(data: bytes) -> None:
    try:
        size = wire.welcome_size(data)
    except wire.HandshakeError:
        return
    assert wire.WELCOME_FIXED + 32 <= size <= WELCOME_MAX


@FUZZ
@given(secrets_, nonces, _prefixed(wire.HELLO_FIXED, GOOD_HEAD))
def test_parse_hello_rejects_garbage(secret: bytes, nonce_a: bytes, data: bytes) -> None:
    with pytest.raises(wire.HandshakeError):
        wire.parse_hello(secret, nonce_a, data)


@FUZZ
@given(secrets_, nonces, _prefixed(wire.WELCOME_FIXED, GOOD_HEAD))
def test_parse_welcome_rejects_garbage(secret: bytes, nonce_c: bytes, data: bytes) -> None:
    with pytest.raises(wire.HandshakeError):
        wire.parse_welcome(secret, nonce_c, data)


hellos = st.builds(wire.Hello, u32, u32, u32, nonces, st.text(max_size=300), st.text(max_size=300))


@FUZZ
@given(secrets_, nonces, hellos, st.data())
def test_hello_round_trip_and_any_change_is_rejected(secret: bytes, nonce_a: bytes, h, data) -> None:
    msg = wire.hello(secret, nonce_a, h)
    assert len(msg) <= HELLO_MAX and wire.hello_size(msg[: wire.HELLO_FIXED]) == len(msg)
    got = wire.parse_hello(secret, nonce_a, msg)
    version = h.version.encode()[: wire.VERSION_BYTES].decode("utf-8", "replace")
    view = h.view.encode()[: wire.VIEW_BYTES].decode("utf-8", "replace")
    assert got == wire.Hello(h.world, h.rank, h.target, h.nonce, version, view)
    # flip one bit anywhere, or cut or extend the message: rejected
    i = data.draw(st.integers(0, len(msg) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = msg[:i] + bytes([msg[i] ^ (1 << bit)]) + msg[i + 1 :]
    for bad in (flipped, msg[:-1], msg + b"\0"):
        with pytest.raises(wire.HandshakeError):
            wire.parse_hello(secret, nonce_a, bad)
    other = data.draw(secrets_)
    # HMAC pads keys with zero bytes, so b"k" and b"k\0" are the same key (harmless: the
    # secret comes from an environment variable, which cannot hold a NUL byte)
    assume(other.rstrip(b"\0") != secret.rstrip(b"\0"))
    with pytest.raises(wire.HandshakeError, match="secret"):
        wire.parse_hello(other, nonce_a, msg)


@FUZZ
@given(secrets_, nonces, st.builds(wire.Welcome, u16, u32, st.text(max_size=300), st.text(max_size=300)), st.data())
def test_welcome_round_trip_and_any_change_is_rejected(secret: bytes, nonce_c: bytes, w, data) -> None:
    msg = wire.welcome(secret, nonce_c, w)
    assert len(msg) <= WELCOME_MAX and wire.welcome_size(msg[: wire.WELCOME_FIXED]) == len(msg)
    got = wire.parse_welcome(secret, nonce_c, msg)
    assert (got.status, got.rank) == (w.status, w.rank)
    assert got.view == w.view.encode()[: wire.VIEW_BYTES].decode("utf-8", "replace")
    i = data.draw(st.integers(0, len(msg) - 1))
    flipped = msg[:i] + bytes([msg[i] ^ 0x80]) + msg[i + 1 :]
    with pytest.raises(wire.HandshakeError):
        wire.parse_welcome(secret, nonce_c, flipped)


# -- frame headers -------------------------------------------------------------------------------

EXPECT = engine.Call(group=0, seq=5, op=wire.OP_CODES["broadcast"], dtype=11, total=64, label="world", arg=1)


MAC = wire.Mac(b"")  # the engine's keys when none are given


def _frame(header: bytes, payload: bytes, ctr: int = 0, nbytes: int = 256) -> bytes:
    """``header`` with its tag, ``payload``, and the tag of its first ``nbytes`` bytes (as a
    rank holding the connection's key sends it)."""
    return MAC.seal(ctr, header) + payload + MAC.tag(b"P", ctr, payload[:nbytes])


def _receive(
    header: bytes,
    payload: bytes,
    expect_bytes: int = 256,
    timeout: float = 2.0,
    raw: bytes | None = None,
    payload_integrity: bool = True,
) -> BaseException | None:
    """Rank 0 expects one frame of ``EXPECT`` from rank 1, which sends ``header + payload``
    (authenticated, see _frame; or ``raw`` bytes) and closes; returns what the receive loop
    raised (None: it accepted the frame)."""
    a, b = tcp_pair()
    try:
        fab = engine.Fabric(0, 2, {1: a}, timeout, payload_integrity=payload_integrity)
        a.setblocking(False)
        target = memoryview(bytearray(expect_bytes))
        fab.post_recv(fab.links[1], EXPECT, target, 1 << 20)
        b.sendall(_frame(header, payload, nbytes=wire.HEADER.unpack(header)[4]) if raw is None else raw)
        b.shutdown(socket.SHUT_WR)
        try:
            fab.progress([fab.links[1]])
        except BaseException as exc:  # examined by the caller
            return exc
        return None
    finally:
        a.close()
        b.close()


def _ok(exc: BaseException | None, header: bytes) -> None:
    if exc is None:  # only the exact expected header (and a full payload) is accepted
        assert wire.HEADER.unpack(header) == (
            EXPECT.group,
            EXPECT.seq,
            EXPECT.op,
            EXPECT.dtype,
            256,
            EXPECT.arg,
            EXPECT.total,
        )
        return
    assert isinstance(exc, DistributedError), repr(exc)
    assert isinstance(exc, (CollectiveMismatchError, PeerLostError, CommTimeoutError, engine.FrameAuthError)) or (
        "stopped the job" in str(exc)
    ), repr(exc)


headers = st.one_of(
    st.binary(min_size=wire.HEADER_SIZE, max_size=wire.HEADER_SIZE),
    st.tuples(u32, u32, u16, u16, u32, u32, st.integers(0, 2**64 - 1)).map(lambda t: wire.HEADER.pack(*t)),
    # near misses of the expected header, and ABORT frames of any kind and size
    st.tuples(
        st.sampled_from([0, 1, 0xFFFFFFFF]),
        st.sampled_from([4, 5, 6]),
        st.sampled_from([wire.OP_CODES["broadcast"], wire.OP_CODES["all_max"], wire.ABORT, 999]),
        st.sampled_from([0, 10, 11, 12, 4, 0xFFFF]),
        st.sampled_from([0, 255, 256, 257, 4096, 2**32 - 1]),
        st.sampled_from([0, 1, 2, 2**32 - 1]),  # the root
        st.sampled_from([63, 64, 65, 2**64 - 1]),
    ).map(lambda t: wire.HEADER.pack(*t)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers, st.binary(max_size=600))
def test_any_frame_header_is_a_clear_error_or_the_expected_frame(header: bytes, payload: bytes) -> None:
    t0 = time.monotonic()
    exc = _receive(header, payload)
    assert time.monotonic() - t0 < 5, "the receive loop must not hang on a hostile header"
    _ok(exc, header)
    if isinstance(exc, CollectiveMismatchError) and wire.HEADER.unpack(header)[2] != wire.ABORT:
        assert "rank 0 called broadcast #5 (64 x float32, root 1)" in str(exc) and "rank 1 sent" in str(exc), str(exc)


def test_abort_announcing_4_gib_reads_at_most_4_kib() -> None:
    """An ABORT's message length comes from the peer: it is capped, not allocated."""
    header = wire.HEADER.pack(0xFFFFFFFF, 1, wire.ABORT, 4, 2**32 - 1, 0, 0)
    tracemalloc.start()
    try:
        exc = _receive(header, b"x" * 100_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(exc, DistributedError) and "stopped the job" in str(exc)
    assert str(exc).count("x") <= 4096 + 100
    assert peak < 4 << 20, f"peak allocation {peak} bytes"


def test_header_split_into_single_bytes_is_checked_like_a_whole_one() -> None:
    a, b = tcp_pair()
    try:
        fab = engine.Fabric(0, 2, {1: a}, 2.0)
        a.setblocking(False)
        fab.post_recv(fab.links[1], EXPECT, memoryview(bytearray(8)), 1 << 20)
        bad = MAC.seal(0, wire.HEADER.pack(0, 5, EXPECT.op, 12, 8, EXPECT.arg, EXPECT.total))  # float64, not float32

        def drip() -> None:
            for i in range(len(bad)):
                b.send(bad[i : i + 1])
                time.sleep(0.002)

        t = threading.Thread(target=drip)
        t.start()
        with pytest.raises(CollectiveMismatchError, match="float64"):
            fab.progress([fab.links[1]])
        t.join()
    finally:
        a.close()
        b.close()


def test_a_frame_of_the_same_call_with_another_root_is_a_mismatch() -> None:
    header = wire.HEADER.pack(EXPECT.group, EXPECT.seq, EXPECT.op, EXPECT.dtype, 256, 2, EXPECT.total)
    exc = _receive(header, b"\0" * 256)
    assert isinstance(exc, CollectiveMismatchError), repr(exc)
    assert "root 1" in str(exc) and "root 2" in str(exc), str(exc)


# -- frame authentication ------------------------------------------------------------------------

GOOD = wire.HEADER.pack(EXPECT.group, EXPECT.seq, EXPECT.op, EXPECT.dtype, 256, EXPECT.arg, EXPECT.total)
PAYLOAD = bytes(range(256))


def test_the_expected_authenticated_frame_is_accepted() -> None:
    assert _receive(GOOD, PAYLOAD) is None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, wire.FRAME_HEAD + 256 + wire.TAG - 1), st.integers(0, 7))
def test_any_flipped_bit_of_a_frame_is_an_authentication_error(pos: int, bit: int) -> None:
    frame = bytearray(_frame(GOOD, PAYLOAD))
    frame[pos] ^= 1 << bit
    exc = _receive(GOOD, PAYLOAD, raw=bytes(frame))
    assert isinstance(exc, engine.FrameAuthError), (pos, repr(exc))
    assert "failed authentication" in str(exc) and "rank 1" in str(exc)


def test_header_only_integrity_leaves_payloads_unchecked() -> None:
    """What MESHCOMM_SOCKETS_INTEGRITY=header gives up: a changed payload byte is accepted
    (its header is still authenticated)."""
    frame = bytearray(MAC.seal(0, GOOD) + PAYLOAD)
    frame[wire.FRAME_HEAD + 7] ^= 1
    assert _receive(GOOD, PAYLOAD, raw=bytes(frame), payload_integrity=False) is None
    frame[3] ^= 1
    assert isinstance(_receive(GOOD, PAYLOAD, raw=bytes(frame), payload_integrity=False), engine.FrameAuthError)


def test_a_frame_sealed_with_another_key_or_counter_is_rejected() -> None:
    other = wire.Mac(b"some other key")
    for raw in (
        other.seal(0, GOOD) + PAYLOAD + other.tag(b"P", 0, PAYLOAD),  # another key
        _frame(GOOD, PAYLOAD, ctr=1),  # a replayed/reordered frame: another counter
        GOOD + b"\0" * wire.TAG + PAYLOAD + b"\0" * wire.TAG,
    ):  # no key at all
        assert isinstance(_receive(GOOD, PAYLOAD, raw=raw), engine.FrameAuthError)


def test_a_forged_abort_is_rejected_and_its_text_never_shown() -> None:
    msg = b"FORGED: rank 1 says the disk is full"
    head = wire.HEADER.pack(0xFFFFFFFF, 1, wire.ABORT, 4, len(msg), 0, 0)
    for raw in (
        head + b"\0" * wire.TAG + msg + b"\0" * wire.TAG,  # header tag forged
        MAC.seal(0, head) + msg + b"\0" * wire.TAG,  # authentic header, message forged
        MAC.seal(0, head) + msg[:-1] + b"X" + MAC.tag(b"P", 0, msg),
    ):  # message changed
        exc = _receive(GOOD, PAYLOAD, raw=raw)
        assert isinstance(exc, engine.FrameAuthError), repr(exc)
        assert "FORGED" not in str(exc) and "stopped the job" not in str(exc)
    exc = _receive(GOOD, PAYLOAD, raw=MAC.seal(0, head) + msg + MAC.tag(b"P", 0, msg))  # the real thing
    assert not isinstance(exc, engine.FrameAuthError) and "rank 1 stopped the job: FORGED" in str(exc), repr(exc)


def test_keys_differ_per_connection_and_direction() -> None:
    c2a, a2c = wire.derive_keys(b"secret", b"a" * 16, b"c" * 16)
    assert c2a != a2c and len(c2a) == len(a2c) == 32
    assert wire.derive_keys(b"secret", b"a" * 16, b"d" * 16)[0] != c2a
    assert wire.derive_keys(b"other", b"a" * 16, b"c" * 16)[0] != c2a


# -- a live job under a connection fuzzer --------------------------------------------------------

FAULTS = "tests/programs/sockets_faults.py"


def _garbage(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 2000))
    if kind == 1:  # right magic, random rest
        return GOOD_HEAD + rng.randbytes(rng.randrange(0, 200))
    if kind == 2:  # a HELLO announcing the largest version string, then garbage
        return struct.pack("<8sHIII16sH", wire.MAGIC, wire.PROTOCOL, 2, 1, 0, rng.randbytes(16), 0xFFFF)
    if kind == 3:  # a well-formed HELLO with a wrong secret (the nonce is not even read)
        return wire.hello(b"not-the-secret", b"\0" * 16, wire.Hello(2, 1, 0, rng.randbytes(16), "x"))
    if kind == 4:
        return b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    return wire.HEADER.pack(0, 1, wire.ABORT, 1, 10, 0, 0) + b"0123456789"  # a data-plane ABORT at start-up


def test_live_job_survives_a_connection_fuzzer_during_startup(tmp_path) -> None:
    ports = free_ports(2)
    hf = write_hostfile(tmp_path / "h.json", ports)
    env = {"MLX_TIMEOUT": "60", "MESHCOMM_JOB_SECRET": "fuzz-secret"}
    procs = start_ranks(2, [FAULTS, "ok"], hf, ranks=[0], env=env)
    stop = threading.Event()
    sent: list[int] = []

    def fuzzer(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", ports[0]), timeout=2) as s:
                    s.settimeout(2)
                    if rng.random() < 0.5:
                        s.recv(wire.CHALLENGE_SIZE)
                    s.sendall(_garbage(rng))
                    s.shutdown(socket.SHUT_WR)  # never leave rank 0 waiting on a silent stranger
                    s.recv(100)
                    sent.append(1)
            except OSError:
                time.sleep(0.01)

    threads = [threading.Thread(target=fuzzer, args=(seed,), daemon=True) for seed in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # rank 0 alone, under fire
    procs.update(start_ranks(2, [FAULTS, "ok"], hf, ranks=[1], env=env))
    try:
        results = finish(procs, timeout=90)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    for r in range(2):
        rc, out, err = results[r]
        lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
        assert rc == 0 and lines and lines[0].get("result") == [3.0, 3.0, 3.0], (r, out, err[-3000:])
    rejected = results[0][2].count("rejected a connection")
    print(f"\nfuzzer: {len(sent)} hostile connections, rank 0 logged {rejected} rejections")
    assert rejected >= 5, results[0][2][-3000:]
    assert "bad magic" in results[0][2]


# -- send/recv that disagree ---------------------------------------------------------------------

P2P = """
import json, sys, time
import numpy as np
import meshcomm as mc
mode = sys.argv[1]
g = mc.init(strict=True)
r = g.rank()
t0 = time.monotonic()
try:
    if r == 0:
        mc.send(np.ones(10, np.float32), 1)
    elif mode == "dtype":
        mc.recv((10,), np.float64, 0)
    else:
        mc.recv((11,), np.float32, 0)
    g.barrier()  # rank 0's send returned at once; it learns of the mismatch here
    print(json.dumps({"error": None}), flush=True)
except mc.DistributedError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - t0}), flush=True)
"""


@pytest.mark.parametrize("mode", ["dtype", "shape"])
def test_send_recv_disagreeing_on_shape_or_dtype_is_a_mismatch_on_both_ranks(tmp_path, mode: str) -> None:
    prog = tmp_path / "p2p.py"
    prog.write_text(P2P)
    hf = write_hostfile(tmp_path / "h.json", free_ports(2))
    env = {"MLX_TIMEOUT": "20", "MLX_DEBUG": "0"}  # the always-on frame check, not the debug one
    results = finish(start_ranks(2, [str(prog), mode], hf, env=env), timeout=60)
    got = {}
    for r in range(2):
        rc, out, err = results[r]
        line = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
        assert line["error"] == "CollectiveMismatchError", (r, out, err[-2000:])
        assert line["elapsed"] < 20, "a mismatch must not wait for the timeout"
        got[r] = line["message"]
    want = "float64" if mode == "dtype" else "11 x float32"
    assert want in got[1] and "10 x float32" in got[1], got[1]
    assert "rank 1 stopped the job" in got[0] and want in got[0], got[0]


def test_silent_strangers_do_not_stop_the_job_from_starting(tmp_path) -> None:
    ports = free_ports(2)
    hf = write_hostfile(tmp_path / "h.json", ports)
    env = {"MLX_TIMEOUT": "6", "MESHCOMM_JOB_SECRET": "s"}
    procs = start_ranks(2, [FAULTS, "ok"], hf, ranks=[0], env=env)
    silent = [connect_when_listening(ports[0]) for _ in range(2)]
    try:
        procs.update(start_ranks(2, [FAULTS, "ok"], hf, ranks=[1], env=env))
        results = finish(procs, timeout=60)
    finally:
        for s in silent:
            s.close()
    for r in range(2):
        lines = [json.loads(ln) for ln in results[r][1].splitlines() if ln.startswith("{")]
        assert lines and lines[0].get("result") == [3.0, 3.0, 3.0], results[r]
