"""The compiled loop's Channel (meshcomm_sockets._shm) against the layout meshcomm_sockets.shm reads and
writes in Python: the words it publishes, the sleepers it reports, how its spin ends, what
it compares, and the errors for a layout or a piece that does not fit (no processes: one
anonymous mapping plays the segment of three local ranks; this process plays the peers
whose memory the direct path reads)."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from meshcomm_sockets import _shm as native  # built by scripts/setup.sh: missing is a failure, not a skip
from meshcomm_sockets import shm

N, PIECE = 3, 4096
LINE, SEQ, WAIT, DESC = shm._LINE, shm._SEQ, shm._WAIT, shm._DESC


@pytest.fixture
def segment():
    m = mmap.mmap(-1, shm.segment_size(N, PIECE))
    ctrl = np.frombuffer(m, np.int64, count=LINE * N).reshape(N, LINE)
    data = np.frombuffer(m, np.uint8, offset=8 * LINE * N)
    yield m, ctrl, data
    del ctrl, data


def test_publish_copies_into_the_slot_of_the_previous_pieces_parity_then_writes_descriptor_and_seq(segment):
    m, ctrl, data = segment
    ch = native.Channel(m, N, 1, LINE, PIECE)
    src = np.arange(10, dtype=np.float32)
    for prev, seq in ((4, 5), (5, 6)):
        d = 2 + DESC * (prev & 1)
        assert ch.publish(src + seq, d, 7, 11, 10, 99, -1, seq, prev) == 0  # nobody sleeps
        slot = data[(2 * 1 + (prev & 1)) * PIECE :][: src.nbytes].view(np.float32)
        assert (slot == src + seq).all()
        assert list(ctrl[1, d : d + DESC]) == [7, 11, 10, 99, -1]
        assert ctrl[1, SEQ] == seq
    assert not ctrl[0].any() and not ctrl[2].any(), "only this rank's line is written"
    ch.release()


def test_publish_reports_the_peers_asleep_on_this_piece_or_the_last(segment):
    m, ctrl, _ = segment
    ch = native.Channel(m, N, 0, LINE, PIECE)
    ctrl[1, WAIT], ctrl[2, WAIT] = 9, 3  # rank 1 waits for piece 9, rank 2 for an old one
    assert ch.publish(None, 2, 0, 0, 0, 0, 0, 9, 8) == 0b010
    ctrl[2, WAIT] = 8
    assert ch.publish(None, 2, 0, 0, 0, 0, 0, 9, 8) == 0b110
    ch.release()


def test_spin_ends_when_every_peer_moved_past_prev_or_when_the_budget_is_spent(segment):
    m, ctrl, _ = segment
    ch = native.Channel(m, N, 0, LINE, PIECE)
    ctrl[:, SEQ] = 4
    t0 = time.perf_counter()
    assert ch.spin(4, 20_000_000, False) is False  # 20 ms and nobody moved
    assert time.perf_counter() - t0 >= 0.019
    ctrl[1, SEQ] = 5
    assert ch.spin(4, 0, False) is False  # rank 2 still shows piece 4
    ctrl[2, SEQ] = 5
    assert ch.spin(4, 0, True) is True

    # a peer publishing while this thread spins (the GIL is released meanwhile)
    ctrl[1:, SEQ] = 5
    threading.Timer(0.05, lambda: ctrl.__setitem__((slice(1, None), SEQ), 6)).start()
    assert ch.spin(5, 5_000_000_000, False) is True
    ch.release()


def test_matches_compares_every_other_ranks_descriptor(segment):
    m, ctrl, _ = segment
    ch = native.Channel(m, N, 2, LINE, PIECE)
    d = 2 + DESC
    ctrl[:, d : d + DESC] = [1, 2, 3, 4, 5]
    assert ch.matches(d, 1, 2, 3, 4, 5) is True
    ctrl[0, d + 2] = 30  # rank 0 has another element count
    assert ch.matches(d, 1, 2, 3, 4, 5) is False
    ctrl[2, d : d + DESC] = 0  # this rank's own line is not compared
    ctrl[0, d + 2] = 3
    assert ch.matches(d, 1, 2, 3, 4, 5) is True
    ch.release()


def test_bad_layouts_and_pieces_are_errors_not_stray_writes():
    m = mmap.mmap(-1, shm.segment_size(N, PIECE))
    with pytest.raises(ValueError, match="the segment has .* bytes, the layout needs"):
        native.Channel(m, N, 0, LINE, 1 << 20)
    with pytest.raises(ValueError, match="bad layout"):
        native.Channel(m, N, N, LINE, PIECE)
    ch = native.Channel(m, N, 0, LINE, PIECE)
    with pytest.raises(ValueError, match="do not fit a 4096-byte slot"):
        ch.publish(np.zeros(PIECE + 1, np.uint8), 2, 0, 0, 0, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="outside the line"):
        ch.publish(None, LINE - 2, 0, 0, 0, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="outside the line"):
        ch.matches(0, 0, 0, 0, 0, 0)
    ch.release()
    with pytest.raises(ValueError, match="used after release"):
        ch.spin(0, 0, False)
    m.close()  # neither the released channel nor the refused ones hold the mapping


def _peers_publish(ctrl, data, prev, seq, desc, arrays, me):
    """Play the other local ranks: their slot of parity prev & 1 holds arrays[i], their
    descriptor is desc, their sequence number seq."""
    d = 2 + DESC * (prev & 1)
    for i, a in enumerate(arrays):
        if i == me:
            continue
        raw = a.view(np.uint8)
        data[(2 * i + (prev & 1)) * PIECE :][: raw.size] = raw
        ctrl[i, d : d + DESC] = desc
        ctrl[i, SEQ] = seq


def _spread(dtype, count: int, seed: int) -> np.ndarray:
    """Floats of very different magnitudes (the order of additions matters) or wrapping integers."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.floating):
        return (rng.standard_normal(count) * 10.0 ** rng.integers(-8, 9, count)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)


@pytest.mark.parametrize(
    "dtype, kind", [(np.float32, 1), (np.float64, 2), (np.int32, 3), (np.uint32, 3), (np.int64, 4), (np.uint64, 4)]
)
def test_all_sum_publishes_then_sums_every_slot_in_rank_order_as_numpy_does(segment, dtype, kind):
    """The same bits as NumPy's ((slot 0 + slot 1) + slot 2): floats of very different
    magnitudes (the order matters) and integers that wrap."""
    m, ctrl, data = segment
    count = PIECE // np.dtype(dtype).itemsize
    arrays = [_spread(dtype, count, 10 * kind + i) for i in range(N)]
    me, prev, seq, desc = 1, 6, 7, [3, 11, count, 42, 0]
    _peers_publish(ctrl, data, prev, seq, desc, arrays, me)
    ch = native.Channel(m, N, me, LINE, PIECE)
    out = np.empty_like(arrays[me])
    with np.errstate(over="ignore"):
        want = (arrays[0] + arrays[1]) + arrays[2]
    assert ch.all_sum(arrays[me], out, kind, 2, *desc, seq, prev, 0, False) == 0
    assert out.tobytes() == want.tobytes()
    assert ctrl[me, SEQ] == seq and list(ctrl[me, 2 : 2 + DESC]) == desc, "published like publish()"
    # in place (out is the input): the input was copied into the slot first
    x = arrays[me].copy()
    _peers_publish(ctrl, data, seq, seq + 1, desc, arrays, me)
    assert ch.all_sum(x, x, kind, 2 + DESC, *desc, seq + 1, seq, 0, False) == 0
    assert x.tobytes() == want.tobytes()
    ch.release()


def test_all_sum_leaves_sleepers_lagging_peers_and_mismatches_to_python(segment):
    """Status 1: a peer sleeps on this piece (wake it, then wait); 2: a peer has not
    published within the budget; 3: a peer's descriptor differs. Each time the piece is
    published and ``out`` is not written."""
    m, ctrl, data = segment
    ch = native.Channel(m, N, 0, LINE, PIECE)
    x = np.arange(8, dtype=np.float32)
    desc = [3, 11, 8, 1, 0]
    arrays = [x] * N

    def run(prev: int, seq: int) -> tuple[int, np.ndarray]:
        out = np.full(8, -1.0, np.float32)
        status = ch.all_sum(x, out, 1, 2 + DESC * (prev & 1), *desc, seq, prev, 0, False)
        assert ctrl[0, SEQ] == seq
        return status, out

    _peers_publish(ctrl, data, 4, 5, desc, arrays, 0)
    ctrl[2, WAIT] = 5
    status, out = run(4, 5)
    assert status == 1 and (out == -1).all()
    ctrl[2, WAIT] = 0
    _peers_publish(ctrl, data, 5, 6, desc, arrays, 0)
    ctrl[1, SEQ] = 5  # rank 1 still shows the piece before
    status, out = run(5, 6)
    assert status == 2 and (out == -1).all()
    _peers_publish(ctrl, data, 6, 7, desc, arrays, 0)
    ctrl[2, 2 + 2] = 9  # rank 2's descriptor (word 2: prev 6 is even) says 9 elements
    status, out = run(6, 7)
    assert status == 3 and (out == -1).all()
    ch.release()


def test_all_sum_refuses_buffers_that_do_not_fit_before_publishing(segment):
    m, ctrl, _ = segment
    ch = native.Channel(m, N, 0, LINE, PIECE)
    x = np.zeros(4, np.float32)
    args = (2, 0, 0, 4, 1, 0, 1, 0, 0, False)
    with pytest.raises(ValueError, match="unknown element kind 9"):
        ch.all_sum(x, x.copy(), 9, *args)
    with pytest.raises(ValueError, match="16 bytes in, 12 out"):
        ch.all_sum(x, np.zeros(3, np.float32), 1, *args)
    with pytest.raises(ValueError, match="8-byte elements"):
        ch.all_sum(np.zeros(3, np.float32), np.zeros(3, np.float32), 2, *args)
    with pytest.raises(ValueError, match=f"{PIECE}-byte slots"):
        big = np.zeros(PIECE // 4 + 1, np.float32)
        ch.all_sum(big, big.copy(), 1, *args)
    with pytest.raises((BufferError, TypeError, ValueError)):
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        ch.all_sum(x, ro, 1, *args)
    assert not ctrl.any(), "nothing was published"
    ch.release()


def _where(arrays, me: int, pid: int) -> np.ndarray:
    """The (pid, address) pairs of the direct path; this process plays every peer."""
    return np.array([(pid if i != me else 0, a.ctypes.data if i != me else 0) for i, a in enumerate(arrays)], np.int64)


@pytest.mark.parametrize(
    "dtype, kind", [(np.float32, 1), (np.float64, 2), (np.int32, 3), (np.uint32, 3), (np.int64, 4), (np.uint64, 4)]
)
@pytest.mark.parametrize("me", [0, 1, 2])
def test_read_sum_reads_every_peer_and_sums_in_rank_order_as_numpy_does(segment, dtype, kind, me):
    """The direct path's block sum: NumPy's ((rank 0 + rank 1) + rank 2), every peer's part
    read with process_vm_readv (this process plays the peers), in chunks that do not
    divide the block; in place too, where rank 2's own chunk must be kept before the first
    addition overwrites it."""
    m, _, _ = segment
    ch = native.Channel(m, N, me, LINE, PIECE)
    count = 1000  # with 3 * 4- or 8-byte chunks below: chunks of 12 or 24 bytes and a short last one
    arrays = [_spread(dtype, count, 10 * kind + i) for i in range(N)]
    with np.errstate(over="ignore"):
        want = (arrays[0] + arrays[1]) + arrays[2]
    where = _where(arrays, me, os.getpid())
    for chunk in (3 * np.dtype(dtype).itemsize, 1 << 20):
        out = np.empty_like(arrays[me])
        assert ch.read_sum(out, arrays[me], kind, where, chunk) is None
        assert out.tobytes() == want.tobytes()
        mine = arrays[me].copy()
        assert ch.read_sum(mine, mine, kind, where, chunk) is None  # in place
        assert mine.tobytes() == want.tobytes()
    ch.release()


def test_read_sum_names_the_peer_it_could_not_read_and_refuses_bad_buffers(segment):
    m, _, _ = segment
    ch = native.Channel(m, N, 0, LINE, PIECE)
    arrays = [np.ones(64, np.float32) for _ in range(N)]
    where = _where(arrays, 0, os.getpid())
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead = where.copy()
    dead[2, 0] = int(gone.stdout)  # a process that has exited (its pid not reused this soon)
    out = np.full(64, -1.0, np.float32)
    assert ch.read_sum(out, arrays[0], 1, dead, 1024) == (2, errno.ESRCH)
    bad = where.copy()
    bad[1, 1] = 8  # an address nothing is mapped at
    assert ch.read_sum(out, arrays[0], 1, bad, 1024) == (1, errno.EFAULT)
    with pytest.raises(ValueError, match="unknown element kind 7"):
        ch.read_sum(out, arrays[0], 7, where, 1024)
    with pytest.raises(ValueError, match="chunk of 2 bytes"):
        ch.read_sum(out, arrays[0], 1, where, 2)
    with pytest.raises(ValueError, match="256 bytes out, 252 own"):
        ch.read_sum(out, arrays[0][1:], 1, where, 1024)
    with pytest.raises(ValueError, match="for 3 ranks"):
        ch.read_sum(out, arrays[0], 1, where[:2], 1024)
    with pytest.raises(ValueError, match="overlapping"):
        big = np.zeros(65, np.float32)
        ch.read_sum(big[1:], big[:64], 1, where, 1024)
    ch.release()
