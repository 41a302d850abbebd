"""The sockets engine's short path for a sendrecv with one peer (``Fabric.exchange``).

Every round of a small reduction over TCP sends one frame to a peer and receives one from
it. The short path writes the frame with one ``sendmsg`` and reads spinning on the socket;
whatever does not move at once goes on in the general loop. On real TCP connections in one
process (one thread per end):

* both paths put the same bytes on the wire: an end on the short path and an end on the
  general one (``post_send``/``post_recv``/``progress``) understand each other, round after
  round, with and without payload tags, for a sendrecv and for a send or a recv alone;
* a frame larger than the socket takes at once (64 KiB socket buffers, the largest frame
  of the short path each way at the same time) is finished, without a deadlock, spinning
  or not; larger transfers take the general loop and meet the short path's frames;
* a peer that closes its end is a ``PeerLostError`` naming it; a peer in another call is a
  ``CollectiveMismatchError`` naming both calls.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
from jobs import tcp_pair
from meshcomm.protocol.errors import CollectiveMismatchError, PeerLostError

engine = pytest.importorskip("meshcomm_sockets.engine")
wire = pytest.importorskip("meshcomm_sockets.wire")

FRAME = 1 << 26  # the backend's largest frame
FLOAT32 = 11


def _call(seq: int, count: int, dtype: int = FLOAT32) -> engine.Call:
    return engine.Call(group=0, seq=seq, op=wire.OP_CODES["all_sum"], dtype=dtype, total=count, label="world")


def _short(fab: engine.Fabric, call: engine.Call, payload: np.ndarray, target: np.ndarray) -> None:
    fab.exchange(fab.links[1 - fab.rank], call, engine.as_bytes(payload), call, engine.as_bytes(target), FRAME)


def _general(fab: engine.Fabric, call: engine.Call, payload: np.ndarray, target: np.ndarray) -> None:
    link = fab.links[1 - fab.rank]
    fab.post_send(link, call, engine.as_bytes(payload), FRAME)
    fab.post_recv(link, call, engine.as_bytes(target), FRAME)
    fab.progress([link])


PATHS: dict[str, Callable[..., None]] = {"short": _short, "general": _general}


def _fabrics(integrity: bool, buffer: int | None = None, spin: float = 0.0) -> tuple[engine.Fabric, engine.Fabric]:
    """Rank 0's and rank 1's engines over one loopback connection (``buffer``: both
    sockets' kernel buffer sizes; ``spin``: seconds each polls before sleeping)."""
    a, b = tcp_pair()
    fabs = []
    for rank, sock in ((0, a), (1, b)):
        if buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        sock.setblocking(False)
        fab = engine.Fabric(rank, 2, {1 - rank: sock}, 10.0, payload_integrity=integrity)
        fab.set_waiting(spin, False)
        fabs.append(fab)
    return fabs[0], fabs[1]


def _close(*fabs: engine.Fabric) -> None:
    for fab in fabs:
        for link in fab.links.values():
            link.sock.close()


def _both(first: Callable[[], None], second: Callable[[], None]) -> None:
    """``first`` here and ``second`` on another thread at the same time; re-raise either's error."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            second()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        first()
    finally:
        t.join(30)
    assert not t.is_alive(), "the other end did not finish"
    if errors:
        raise errors[0]


def _rounds(fab0: engine.Fabric, fab1: engine.Fabric, path0: str, path1: str, count: int, rounds: int = 3) -> None:
    """``rounds`` exchanges of ``count`` float32 each way; each end gets exactly what the other sent."""
    rng = np.random.default_rng(count)
    for seq in range(1, rounds + 1):
        x0, x1 = (rng.standard_normal(count).astype(np.float32) for _ in range(2))
        y0, y1 = np.full(count, np.nan, np.float32), np.full(count, np.nan, np.float32)
        call = _call(seq, count)
        _both(partial(PATHS[path0], fab0, call, x0, y0), partial(PATHS[path1], fab1, call, x1, y1))
        assert np.array_equal(y0, x1) and np.array_equal(y1, x0), f"round {seq}"


@pytest.mark.parametrize("integrity", [True, False], ids=["payload-tags", "header-tags"])
@pytest.mark.parametrize("count", [0, 2, 16384])
@pytest.mark.parametrize(
    "paths", [("short", "general"), ("general", "short"), ("short", "short")], ids=lambda p: "-".join(p)
)
def test_short_and_general_paths_speak_the_same_frames(integrity, count, paths):
    fab0, fab1 = _fabrics(integrity)
    try:
        _rounds(fab0, fab1, *paths, count)
    finally:
        _close(fab0, fab1)


def _send(path: str, fab: engine.Fabric, call: engine.Call, x: np.ndarray) -> None:
    link = fab.links[1 - fab.rank]
    if path == "short":
        fab.exchange(link, call, engine.as_bytes(x), None, None, FRAME)
    else:
        fab.post_send(link, call, engine.as_bytes(x), FRAME)
        fab.progress([link])


def _recv(path: str, fab: engine.Fabric, call: engine.Call, y: np.ndarray) -> None:
    link = fab.links[1 - fab.rank]
    if path == "short":
        fab.exchange(link, None, None, call, engine.as_bytes(y), FRAME)
    else:
        fab.post_recv(link, call, engine.as_bytes(y), FRAME)
        fab.progress([link])


@pytest.mark.parametrize("count", [0, 2, 1 << 16, 1 << 19])
@pytest.mark.parametrize("sender,receiver", [("short", "general"), ("general", "short"), ("short", "short")])
def test_a_send_or_a_recv_alone_speaks_the_same_frames(sender, receiver, count):
    fab0, fab1 = _fabrics(True, buffer=65536)
    try:
        for seq in range(1, 4):
            x = np.arange(count, dtype=np.float32) + seq
            y = np.full(count, np.nan, np.float32)
            call = _call(seq, count)
            _both(partial(_recv, receiver, fab1, call, y), partial(_send, sender, fab0, call, x))
            assert np.array_equal(y, x), f"message {seq}"
    finally:
        _close(fab0, fab1)


@pytest.mark.parametrize("spin", [0.0, 0.05], ids=["sleeping", "spinning"])
@pytest.mark.parametrize("paths", [("short", "short"), ("short", "general")], ids=lambda p: "-".join(p))
def test_a_frame_the_socket_takes_in_parts_is_finished_without_deadlock(spin, paths):
    """SHORT_BYTES each way through 64 KiB socket buffers: the first sendmsg takes a part,
    the rest is queued, and each end keeps reading while it writes."""
    fab0, fab1 = _fabrics(True, buffer=65536, spin=spin)
    try:
        _rounds(fab0, fab1, *paths, engine.SHORT_BYTES // 4, rounds=2)
    finally:
        _close(fab0, fab1)


def test_a_peer_that_closes_its_end_is_named():
    fab0, fab1 = _fabrics(True)
    try:
        fab1.links[0].sock.close()
        with pytest.raises(PeerLostError, match="lost rank 1") as info:
            _short(fab0, _call(1, 2), np.ones(2, np.float32), np.empty(2, np.float32))
        assert info.value.peer == 1
    finally:
        _close(fab0)


def test_a_peer_in_another_call_is_a_mismatch_naming_both():
    fab0, fab1 = _fabrics(True)
    try:
        x, y = np.ones(2, np.float32), np.empty(2, np.float32)
        theirs = _call(1, 1, dtype=12)  # float64: the same 8 bytes, another call
        link = fab1.links[0]
        fab1.post_send(link, theirs, engine.as_bytes(x), FRAME)
        fab1._send(link)
        with pytest.raises(CollectiveMismatchError, match=r"rank 0 called all_sum #1 \(2 x float32\).*rank 1 sent"):
            _short(fab0, _call(1, 2), x, y)
    finally:
        _close(fab0, fab1)
