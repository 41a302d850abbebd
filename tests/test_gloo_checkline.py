"""The gloo backend's call-check channel (meshcomm_gloo.checkline): the maximum on every rank,
strangers refused, changed frames caught, a closed or silent peer reported as gloo would.

The ranks are threads of this process over a real torch HashStore sealed with a job secret
(the AuthStore every gloo rank uses) and real loopback sockets.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")


def _store(secret: bytes = b"job secret") -> Any:
    import torch.distributed as dist
    from meshcomm_gloo.authstore import AuthStore
    from meshcomm_gloo.sealing import Sealer

    return AuthStore(dist.HashStore(), Sealer(secret, "job1"))


def _on_ranks(n: int, body: Callable[[int], Any]) -> list[Any]:
    """``body(rank)`` on ``n`` threads; each one's result, or the exception it raised."""
    got: list[Any] = [None] * n

    def run(r: int) -> None:
        try:
            got[r] = body(r)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            got[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def _lines(n: int, store: Any = None, timeout: float = 5.0) -> list[Any]:
    from meshcomm_gloo.checkline import open_line

    store = store if store is not None else _store()
    lines = _on_ranks(n, lambda r: open_line(store, "g", r, n, timeout, "127.0.0.1"))
    for line in lines:
        assert not isinstance(line, BaseException), line
    return lines


def _close(lines: list[Any]) -> None:
    for line in lines:
        line.close()


@pytest.mark.parametrize("n", [2, 3, 5])
def test_every_rank_gets_the_maximum_and_equal_keys_pass(n: int) -> None:
    lines = _lines(n)
    try:
        for round_ in range(3):
            keys = [np.array([10 * round_ + r, -(10 * round_ + r)], np.int64) for r in range(n)]

            def check(r: int, keys: list[np.ndarray] = keys) -> np.ndarray:
                out = np.empty(2, np.int64)
                lines[r].reduce_max(keys[r], out, 5.0)
                return out

            want = np.max(np.stack(keys), axis=0)
            for r, got in enumerate(_on_ranks(n, check)):
                assert not isinstance(got, BaseException), got
                assert got.tolist() == want.tolist(), (r, got, want)
        same = np.array([7, -7], np.int64)
        outs = _on_ranks(n, lambda r: (lines[r].reduce_max(same, o := np.empty(2, np.int64), 5.0), o)[1])
        assert all(o.tolist() == [7, -7] for o in outs), outs
    finally:
        _close(lines)


def test_a_rank_at_another_check_makes_the_calls_differ() -> None:
    """Frames of another check (a rank that made one check more) never pass as equal keys."""
    lines = _lines(3)
    try:
        lines[1]._seq += 1
        key = np.array([7, -7], np.int64)
        outs = _on_ranks(3, lambda r: (lines[r].reduce_max(key, o := np.empty(2, np.int64), 5.0), o)[1])
        for o in outs:
            assert not isinstance(o, BaseException), o
            assert o[0] != -o[1], outs  # what the core reads as "the calls differ"
    finally:
        _close(lines)


def test_a_stranger_without_the_secret_is_refused_and_the_ranks_connect() -> None:
    """A process that read rank 0's address from the store connects first and sends a hello
    signed without the secret: rank 0 drops it and still takes rank 1's."""
    from meshcomm_gloo.checkline import open_line

    store = _store()
    hello_sent = threading.Event()
    refused: list[bytes] = []
    outsider = threading.Thread(target=lambda: stranger())

    def stranger() -> None:
        ip, port, nonce = bytes(store.get("g/meshcomm-line/0")).decode().split()
        with socket.create_connection((ip, int(port)), timeout=5) as s:
            forged = hmac.new(b"guess", b"hello" + bytes.fromhex(nonce), hashlib.sha256).digest()
            s.sendall(struct.pack("<4sIIII16s32s", b"mcl2", 2, 1, 0, 0, os.urandom(16), forged))
            hello_sent.set()  # rank 1 connects only now: rank 0 meets the stranger first
            s.settimeout(10)
            refused.append(s.recv(100))  # b"": closed without an answer

    def rank(r: int) -> Any:
        if r == 1:
            outsider.start()
            assert hello_sent.wait(10)
        return open_line(store, "g", r, 2, 10.0, "127.0.0.1")

    lines = _on_ranks(2, rank)
    outsider.join(10)
    try:
        assert refused == [b""]
        for line in lines:
            assert not isinstance(line, BaseException), line
        key = np.array([3, -3], np.int64)
        outs = _on_ranks(2, lambda r: (lines[r].reduce_max(key, o := np.empty(2, np.int64), 5.0), o)[1])
        assert [o.tolist() for o in outs] == [[3, -3], [3, -3]]
    finally:
        _close([x for x in lines if not isinstance(x, BaseException)])


def test_a_rank_with_another_secret_cannot_connect() -> None:
    """Rank 1 holds another secret (its store reads rank 0's address: only its checks differ):
    rank 0 never accepts it and times out; rank 1 is refused."""
    from meshcomm_gloo.checkline import open_line

    good = _store(b"right")
    bad = _store(b"wrong")

    def rank(r: int) -> Any:
        if r == 0:
            return open_line(good, "g", 0, 2, 1.0, "127.0.0.1")
        return open_line(_Unsealed(good, bad), "g", 1, 2, 1.0, "127.0.0.1")

    got = _on_ranks(2, rank)
    assert isinstance(got[0], RuntimeError) and "timed out" in str(got[0]), got
    assert isinstance(got[1], RuntimeError), got


class _Unsealed:
    """Rank 1's store: reads and writes as ``good`` does (the address is public), but its
    channel key comes from ``bad``'s secret."""

    def __init__(self, good: Any, bad: Any) -> None:
        self._good, self._bad = good, bad

    def set(self, key: str, value: Any) -> None:
        self._good.set(key, value)

    def get(self, key: str) -> bytes:
        return self._good.get(key)

    def derive(self, label: str) -> bytes:
        return self._bad.derive(label)


def test_a_changed_frame_is_an_error_not_a_passed_check() -> None:
    """Bytes put into the stream on the way (here: by writing to rank 1's socket to rank 0)
    fail the frame's tag on rank 0."""
    lines = _lines(2)
    try:
        body = struct.pack("<QqqI", 1, 7, -7, 0)
        lines[1]._outs[0].sendall(body + b"\0" * 16)  # a frame with rank 0's expected seq, unsigned
        with pytest.raises(RuntimeError, match="failed its authentication"):
            lines[0].reduce_max(np.array([7, -7], np.int64), np.empty(2, np.int64), 5.0)
    finally:
        _close(lines)


def test_a_closed_peer_is_named_and_a_silent_one_times_out() -> None:
    from meshcomm_gloo.checkline import PeerClosed

    lines = _lines(3)
    try:
        key = np.array([1, -1], np.int64)
        # rank 2 is silent: rank 0 (which hears from rank 2 in round 0) gives up after the timeout
        with pytest.raises(RuntimeError, match="timed out after 0.3 s waiting for rank 2"):
            lines[0].reduce_max(key, np.empty(2, np.int64), 0.3)
        lines[2].close()  # now rank 2 is gone: rank 1 hears of it at once, and names it
        with pytest.raises(PeerClosed) as err:
            lines[1].reduce_max(key, np.empty(2, np.int64), 5.0)
        assert err.value.peer == 2, err.value
        lines[1].close()
        with pytest.raises(RuntimeError, match="the channel was closed"):  # never a check of no rounds
            lines[1].reduce_max(key, np.empty(2, np.int64), 5.0)
    finally:
        _close(lines)


# -- small all-reduces on the channel (meshcomm_gloo.smallreduce) ------------------------
def _gathered(lines: list[Any], blocks: list[np.ndarray], keys: list[np.ndarray] | None = None) -> list[Any]:
    """Every rank's (max key, table) after one gathering exchange of its ``blocks[r]``."""
    n = len(lines)
    keys = keys or [np.array([5, -5], np.int64)] * n

    def one(r: int) -> tuple[tuple[int, int], np.ndarray]:
        table = np.empty((n, blocks[r].nbytes), np.uint8)
        table[0] = blocks[r].view(np.uint8)
        return lines[r].gather(keys[r], table, 30.0), table

    t0 = time.monotonic()
    got = _on_ranks(n, one)
    for g in got:
        assert not isinstance(g, BaseException), g
    # nothing after the exchange waits for more frames (its look for a peer that gave up peeks)
    assert time.monotonic() - t0 < 15.0, "a rank waited for the 30 s timeout after its exchange"
    return got


@pytest.mark.parametrize(
    ("n", "count"),
    [(2, 6), (3, 6), (4, 6), (5, 6), (7, 6), (2, 1 << 16), (3, 40_000), (4, 1 << 15)],
    ids=lambda v: str(v),
)
def test_a_gathering_exchange_gives_every_rank_every_block(n: int, count: int) -> None:
    """Row j of rank r's table is rank (r - j) % n's block, on every rank, over repeated calls;
    also with frames of 128-256 KiB, more than a send buffer holds (sent while reading)."""
    from meshcomm_gloo.checkline import BLOCKS_MAX

    assert n * count * 4 <= BLOCKS_MAX
    lines = _lines(n)
    for r, line in enumerate(lines):  # some ranks poll before they sleep (MESHCOMM_GLOO_SPIN_US), some do not
        line.spin = 0.0005 if r % 2 else 0.0
    if count > 6:  # small socket buffers: a rank that sent its whole frame before reading would wait forever
        for line in lines:
            for s in line._outs:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
            for s in line._ins:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    try:
        for call in range(3):
            blocks = [np.arange(count, dtype=np.int32) + 100 * r + call for r in range(n)]
            for r, (seen, table) in enumerate(_gathered(lines, blocks)):
                assert seen == (5, -5), (r, seen)
                rows = table.view(np.int32)
                for j in range(n):
                    assert rows[j].tolist() == blocks[(r - j) % n].tolist(), (n, r, j)
    finally:
        _close(lines)


@pytest.mark.parametrize("n", [3, 4, 5])
def test_small_reductions_take_the_same_steps_on_every_rank(n: int) -> None:
    """Each rank reduces in rank order, so sums whose value depends on the order, the sign of
    zero under max/min and NaN payloads come out as the same bits on every rank."""
    from meshcomm_gloo.smallreduce import reduce_rows

    lines = _lines(n)
    try:
        nan2 = np.frombuffer(np.uint32(0x7FC00002).tobytes(), np.float32)[0]  # a NaN with another payload
        blocks = []
        for r in range(n):
            b = np.array([1e8 if r == 0 else 3.0, -1e8 if r == n - 1 else 3.0, 0.0 if r % 2 else -0.0, 1.0], np.float32)
            b[3] = np.nan if r == 1 else (nan2 if r == 2 else r)
            blocks.append(b)
        tables = _gathered(lines, blocks)
        for op, f in (("sum", np.add), ("max", np.maximum), ("min", np.minimum)):
            want = blocks[0].copy()
            for b in blocks[1:]:
                want = f(want, b)
            results = []
            for r, (_, table) in enumerate(tables):
                out = np.empty(4, np.float32)
                reduce_rows(table.copy(), np.dtype(np.float32), op, r, out)
                results.append(out)
            for r, out in enumerate(results):
                assert out.tobytes() == want.tobytes(), (op, r, out, want)
        big, three = np.float32(1e8), np.float32(3)  # the order matters for these values in float32
        assert (big + three) + three != big + (three + three)
    finally:
        _close(lines)


def test_a_check_that_meets_a_gathering_exchange_makes_the_calls_differ() -> None:
    """A rank checking a call on the channel and one reducing there (same key: their settings
    differ) never pass as the same call, and neither waits for the other."""
    lines = _lines(3)
    try:
        key = np.array([9, -9], np.int64)

        def rank(r: int) -> tuple[int, int]:
            if r == 1:
                out = np.empty(2, np.int64)
                lines[r].reduce_max(key, out, 5.0)
                return int(out[0]), int(out[1])
            table = np.zeros((3, 8), np.uint8)
            return lines[r].gather(key, table, 5.0)

        for r, seen in enumerate(_on_ranks(3, rank)):
            assert not isinstance(seen, BaseException), seen
            assert seen != (9, -9), (r, seen)
    finally:
        _close(lines)


def test_a_frame_longer_than_any_rank_sends_is_refused_before_it_is_read() -> None:
    from meshcomm_gloo.checkline import BLOCKS_MAX

    lines = _lines(2)
    try:
        lines[1]._outs[0].sendall(struct.pack("<QqqI", 1, 7, -7, BLOCKS_MAX))  # no body follows
        with pytest.raises(RuntimeError, match=f"sent a frame of {BLOCKS_MAX} bytes"):
            lines[0].reduce_max(np.array([7, -7], np.int64), np.empty(2, np.int64), 5.0)
    finally:
        _close(lines)


def test_a_rank_resumed_after_the_others_gave_up_fails_the_call_too() -> None:
    """Rank 1 arrives (as if resumed after SIGSTOP) only after the others timed out and gave
    up: every frame it needs is in its buffers, but it raises naming a rank that gave up,
    instead of returning a result the others never got. Ranks that merely close after a
    completed exchange do not make a slower rank fail."""
    from meshcomm_gloo.checkline import PeerClosed

    lines = _lines(4)
    key = np.array([3, -3], np.int64)
    blocks = [np.full(2, r, np.int64) for r in range(4)]

    def others(r: int) -> Any:
        table = np.zeros((4, 16), np.uint8)
        table[0] = blocks[r].view(np.uint8)
        try:
            return lines[r].gather(key, table, 0.5)
        except RuntimeError as exc:
            lines[r].give_up()
            return exc

    got = _on_ranks(4, lambda r: None if r == 1 else others(r))
    assert all(isinstance(got[r], RuntimeError) for r in (0, 2, 3)), got
    table = np.zeros((4, 16), np.uint8)
    with pytest.raises(PeerClosed, match="gave up on this call"):
        lines[1].gather(key, table, 5.0)
    _close(lines)

    lines = _lines(2)
    closed = threading.Event()
    peek = lines[1]._given_up
    lines[1]._given_up = lambda seq: (closed.wait(5), peek(seq))[1]  # rank 1 looks only after rank 0 closed

    def rank(r: int) -> Any:
        table = np.zeros((2, 16), np.uint8)
        seen = lines[r].gather(key, table, 5.0)
        if r == 0:
            lines[0].close()  # rank 0 ends its program right after the call completed
            closed.set()
        return seen

    try:
        assert _on_ranks(2, rank) == [(3, -3), (3, -3)]
    finally:
        _close(lines)


def test_ranks_poll_before_they_sleep_only_where_the_host_has_a_core_for_each() -> None:
    from meshcomm_gloo.liveness import RankProcess, spin_for

    cores = os.cpu_count() or 1
    alone = [RankProcess("a", 1, 1)] + [RankProcess("b", q, 2) for q in range(cores + 3)]
    assert spin_for(50.0, alone, 0) == pytest.approx(50e-6)  # the only rank on host a
    crowded = [RankProcess("a", q, 1) for q in range(cores + 1)]
    assert spin_for(50.0, crowded, 0) == 0.0
    assert spin_for(50.0, crowded[:cores], 0) == pytest.approx(50e-6)
    assert spin_for(0.0, alone, 0) == 0.0


def test_a_rank_that_gives_up_after_a_completed_call_fails_only_the_next_one_of_a_slower_peer() -> None:
    """Rank 0 completes a call, then fails elsewhere and gives up; rank 1, slower, looks for
    notices of that call only after the give-up: its call stands, and its next one raises."""
    from meshcomm_gloo.checkline import PeerClosed

    lines = _lines(2)
    given_up = threading.Event()
    peek = lines[1]._given_up
    lines[1]._given_up = lambda seq: (given_up.wait(5), peek(seq))[1]
    key = np.array([4, -4], np.int64)

    def rank(r: int) -> Any:
        seen = lines[r].gather(key, np.zeros((2, 8), np.uint8), 5.0)
        if r == 0:
            lines[0].give_up()
            given_up.set()
        return seen

    try:
        assert _on_ranks(2, rank) == [(4, -4), (4, -4)]
        with pytest.raises(PeerClosed, match="rank 0 gave up"):
            lines[1].gather(key, np.zeros((2, 8), np.uint8), 5.0)
    finally:
        _close(lines)


def test_giving_up_never_waits_for_room_in_a_full_send_buffer() -> None:
    lines = _lines(2)
    try:
        out = lines[0]._outs[0]
        out.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        lines[1]._ins[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        out.setblocking(False)
        for _ in range(3):  # rank 1 reads nothing: fill its receive buffer and our send buffer
            try:
                while True:
                    out.send(b"\0" * 4096)
            except BlockingIOError:
                time.sleep(0.2)  # what the kernel still moves to rank 1 makes room: fill it too
        out.settimeout(30.0)
        t0 = time.monotonic()
        lines[0].give_up()
        assert time.monotonic() - t0 < 10.0, "give_up waited for room to send its notice"
    finally:
        _close(lines)
