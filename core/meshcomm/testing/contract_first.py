"""The first round of the API contract: identity, the reductions, all_gather, sum_scatter,
broadcast, send/recv, split and barrier, as checks that run on every rank.

Each ``check_*`` takes the world group and raises AssertionError naming the rank and what
differed; :data:`CHECKS` is the round, in the order :mod:`meshcomm.testing.contract` runs it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import meshcomm as mc

from .checks_base import (
    LARGE,
    SHAPES,
    _dtypes,
    _expect,
    _identical_everywhere,
    _raises,
    _same,
    rank_input,
)

__all__ = ["CHECKS"]


def check_identity(g: mc.Group) -> None:
    assert 0 <= g.rank() < g.size(), f"rank {g.rank()} not in [0, {g.size()})"
    sizes = mc.all_gather(np.array(g.size()), group=g)
    ranks = mc.all_gather(np.array(g.rank()), group=g)
    assert (sizes == g.size()).all(), f"ranks disagree on size: {sizes}"
    assert sorted(ranks.tolist()) == list(range(g.size())), f"ranks are not 0..n-1: {ranks}"
    assert isinstance(g.backend, str) and g.backend


def check_reductions(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    for dt in _dtypes():
        for shape in SHAPES:
            inputs = [rank_input(q, shape, dt) for q in range(n)]
            mine = inputs[r].copy()
            for op, fn in (("sum", mc.all_sum), ("max", mc.all_max), ("min", mc.all_min)):
                got = fn(mine, group=g)
                _same(got, _expect(op, inputs), f"all_{op}({dt}, shape={shape})", r)
                assert np.array_equal(mine, inputs[r]), f"rank {r}: all_{op} modified its input"


def check_large_and_noncontiguous(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    for dt in (np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.float64), np.dtype(np.uint16)):
        inputs = [rank_input(q, (LARGE,), dt) for q in range(n)]
        got = mc.all_sum(inputs[r], group=g)
        _same(got, _expect("sum", inputs), f"all_sum({dt}, {LARGE} elements)", r)
        _identical_everywhere(g, got, f"all_sum({dt}, {LARGE} elements)")
        got = mc.all_max(inputs[r], group=g)
        _same(got, _expect("max", inputs), f"all_max({dt}, {LARGE} elements)", r)
    # results the caller keeps are its own: later calls leave every one of them alone (large
    # enough that the backend allocates them with its own empty())
    big = max(LARGE, g.transport.EMPTY_MIN_BYTES // 4 + 13)
    kept = [mc.all_sum(rank_input(r, (big,), np.float32, salt=k), group=g) for k in range(4)]
    for k, got in enumerate(kept):
        assert got.flags.c_contiguous and got.flags.writeable, f"rank {r}: all_sum result {k} is read-only"
        _same(
            got,
            _expect("sum", [rank_input(q, (big,), np.float32, salt=k) for q in range(n)]),
            f"all_sum result {k} kept across later calls",
            r,
        )
    # strided and transposed views, Fortran order
    base = [rank_input(q, (6, 10), np.float32) for q in range(n)]
    for name, view in (
        ("strided", lambda a: a[::2, 1::3]),
        ("transposed", lambda a: a.T),
        ("fortran", lambda a: np.asfortranarray(a)),
    ):
        got = mc.all_sum(view(base[r]), group=g)
        _same(got, _expect("sum", [view(b) for b in base]), f"all_sum({name} view)", r)
    # python scalars and lists
    got = mc.all_sum([1, 2, 3], group=g)
    _same(got, np.array([1, 2, 3]) * n, "all_sum(list)", r)
    got = mc.all_sum(2.5, group=g)
    _same(got, np.array(2.5 * n), "all_sum(python float)", r)


def check_float_results_identical(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    rng = np.random.default_rng(1234 + r)
    for size in (5, 1000, 300_001):
        x = rng.standard_normal(size).astype(np.float32)
        got = mc.all_sum(x, group=g)
        _identical_everywhere(g, got, f"all_sum(random float32, {size})")
        want = mc.all_gather(x, group=g).reshape(n, size).astype(np.float64).sum(0)
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * n), f"rank {r}: float32 sum of {size} off"


def check_special_semantics(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    b = np.array([r == 0, False, True])
    _same(mc.all_sum(b, group=g), np.array([True, False, True]), "all_sum(bool) is logical or", r)
    _same(mc.all_min(b, group=g), np.array([n == 1, False, True]), "all_min(bool)", r)
    x = np.full(5, 100, dtype=np.int8)
    _same(mc.all_sum(x, group=g), (np.full(5, 100, np.int64) * n).astype(np.int8), "int8 wrap-around", r)
    u = np.full(4, 2**64 - 1, dtype=np.uint64)
    _same(mc.all_sum(u, group=g), (u * np.uint64(n)).astype(np.uint64), "uint64 wrap-around", r)
    empty = np.zeros((0, 3), np.float32)
    _same(mc.all_sum(empty, group=g), empty, "all_sum(empty)", r)
    _same(mc.all_gather(empty, group=g), np.zeros((0, 3), np.float32), "all_gather(empty)", r)


def check_all_gather(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    for dt in _dtypes():
        for shape in SHAPES:
            inputs = [rank_input(q, shape, dt, salt=1) for q in range(n)]
            got = mc.all_gather(inputs[r], group=g)
            want = np.stack(inputs) if shape == () else np.concatenate(inputs)
            _same(got, want, f"all_gather({dt}, shape={shape})", r)
    big = [rank_input(q, (LARGE // 4, 2), np.float32) for q in range(n)]
    _same(mc.all_gather(big[r], group=g), np.concatenate(big), "all_gather(large)", r)


def check_sum_scatter(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    for dt in _dtypes():
        for shape in ((n,), (3 * n, 2), (n * 4099,)):
            inputs = [rank_input(q, shape, dt, salt=2) for q in range(n)]
            got = mc.sum_scatter(inputs[r], group=g)
            full = _expect("sum", inputs)
            k = shape[0] // n
            _same(got, full[r * k : (r + 1) * k], f"sum_scatter({dt}, shape={shape})", r)
    if n > 1:
        _raises(ValueError, lambda: mc.sum_scatter(np.zeros(n + 1), group=g), "sum_scatter of n+1 rows")
    _raises(ValueError, lambda: mc.sum_scatter(np.float32(1), group=g), "sum_scatter of a 0-d array")


def check_broadcast(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    for root in range(n):
        for dt in _dtypes():
            for shape in ((), (5,), (LARGE // 8 + 1,)):
                want = rank_input(root, shape, dt, salt=3)
                mine = want.copy() if r == root else np.zeros(shape, dt)
                before = mine.copy()
                got = mc.broadcast(mine, root, group=g)
                _same(got, want, f"broadcast(root={root}, {dt}, shape={shape})", r)
                assert np.array_equal(mine, before), f"rank {r}: broadcast modified its input"
    _raises(ValueError, lambda: mc.broadcast(np.zeros(3), n, group=g), f"broadcast with root={n}")


def check_send_recv(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    if n == 1:
        _raises(ValueError, lambda: mc.send(np.zeros(2), 0, group=g), "send in a size-1 group")
        return
    _raises(ValueError, lambda: mc.send(np.zeros(2), r, group=g), "send to self")
    _raises(ValueError, lambda: mc.send(np.zeros(2), n, group=g), f"send to rank {n}")
    _raises(ValueError, lambda: mc.recv((2,), np.float32, -1, group=g), "recv from rank -1")
    # every ordered pair, two messages each, in a deadlock-free order
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            a = rank_input(src, (dst + 3, 2), np.float64, salt=4)
            b = rank_input(src, (), np.int16, salt=5)
            if r == src:
                sent = mc.send(a, dst, group=g)
                assert sent is a, (
                    f"rank {r}: send returned {type(sent).__name__}, not the array it sent (as MLX's send)"
                )
                work = mc.send(b, dst, group=g, async_op=True)
                assert work.wait() is b, f"rank {r}: send(async_op=True).wait() is not the array it sent"
            elif r == dst:
                _same(mc.recv(a.shape, a.dtype, src, group=g), a, f"recv from {src}", r)
                _same(mc.recv_like(b, src, group=g), b, f"recv_like from {src}", r)
    # a large message around the ring, not only between neighbours
    big = rank_input(r, (LARGE,), np.float32, salt=6)
    if r % 2 == 0:
        mc.send(big, (r + 1) % n, group=g)
        got = mc.recv_like(big, (r - 1) % n, group=g)
    else:
        got = mc.recv_like(big, (r - 1) % n, group=g)
        mc.send(big, (r + 1) % n, group=g)
    _same(got, rank_input((r - 1) % n, (LARGE,), np.float32, salt=6), "large recv around the ring", r)


def check_barrier(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    shared = os.environ.get("MESHCOMM_TEST_DIR")
    d = Path(shared) if shared else Path(tempfile.gettempdir())
    token = mc.broadcast(np.array(int(time.time() * 1e6) % 10**12), 0, group=g)
    for rnd in range(3):
        if r == n - 1:
            time.sleep(0.05)
        (d / f"barrier-{int(token)}-{rnd}-{r}").touch()
        g.barrier()
        if shared:  # only when the ranks share a file system
            missing = [q for q in range(n) if not (d / f"barrier-{int(token)}-{rnd}-{q}").exists()]
            assert not missing, f"rank {r}: left barrier {rnd} before ranks {missing} entered it"
        g.barrier()
        (d / f"barrier-{int(token)}-{rnd}-{r}").unlink()


def check_split(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    sub = g.split(r % 2, key=n - r)  # reversed order inside each colour
    members = [q for q in range(n) if q % 2 == r % 2]
    want_order = sorted(members, key=lambda q: n - q)
    assert sub.size() == len(members), f"rank {r}: split size {sub.size()}, expected {len(members)}"
    assert sub.rank() == want_order.index(r), f"rank {r}: split rank {sub.rank()}, expected {want_order.index(r)}"
    _same(mc.all_sum(np.array([r, 1]), group=sub), np.array([sum(members), len(members)]), "all_sum in split", r)
    got = mc.all_gather(np.array([r]), group=sub)
    _same(got, np.array(want_order), "all_gather in split follows key order", r)
    if sub.size() > 1:
        peer = (sub.rank() + 1) % sub.size()
        src = (sub.rank() - 1) % sub.size()
        if sub.rank() % 2 == 0:
            mc.send(np.array([r]), peer, group=sub)
            got = mc.recv((1,), np.int64, src, group=sub)
        else:
            got = mc.recv((1,), np.int64, src, group=sub)
            mc.send(np.array([r]), peer, group=sub)
        assert int(got[0]) == want_order[src], f"rank {r}: send/recv inside split got {got}"
    sub.barrier()
    # default key keeps the old order; a second level of split works
    same = g.split(0)
    assert same.size() == n and same.rank() == r, f"rank {r}: split(0) gave rank {same.rank()}/{same.size()}"
    solo = same.split(r)
    assert solo.size() == 1 and solo.rank() == 0
    _same(mc.all_sum(np.array([7]), group=solo), np.array([7]), "all_sum on a size-1 split", r)
    # the world still works after splits
    _same(mc.all_sum(np.array([1]), group=g), np.array([n]), "world after split", r)


CHECKS: list[Callable[[mc.Group], None]] = [
    check_identity,
    check_reductions,
    check_special_semantics,
    check_large_and_noncontiguous,
    check_float_results_identical,
    check_all_gather,
    check_sum_scatter,
    check_broadcast,
    check_send_recv,
    check_split,
    check_barrier,
]
