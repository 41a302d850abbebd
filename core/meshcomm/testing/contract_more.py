"""The second round of the API contract: all_to_all, gather, scatter, reduce, the object
collectives, ``out=``, ``async_op=True``, ``close()`` and persistent all-reduces, as checks that run on every rank.

Like the first round's (:mod:`meshcomm.testing.contract_first`), each ``check_*`` takes a
group and raises AssertionError naming the rank and what differed. They run after the first
round's checks with ``python -m meshcomm.testing.contract --more`` (and ``--meshcomm-more``
in the pytest plugin); :data:`ALL_CHECKS` is both rounds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import meshcomm as mc

from .checks_base import (
    LARGE,
    _dtypes,
    _expect,
    _identical_everywhere,
    _raises,
    _same,
    rank_input,
)
from .contract_first import CHECKS

__all__ = ["MORE_CHECKS", "ALL_CHECKS"]


def _blocks(a: np.ndarray, n: int, i: int) -> np.ndarray:
    m = a.shape[0] // n
    return a[i * m : (i + 1) * m]


def check_all_to_all(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    for dt in _dtypes():
        for shape in ((n,), (2 * n, 3), (0, 2)):
            inputs = [rank_input(q, shape, dt, salt=7) for q in range(n)]
            got = mc.all_to_all(inputs[r], group=g)
            want = np.concatenate([_blocks(inputs[q], n, r) for q in range(n)])
            _same(got, want, f"all_to_all({dt}, shape={shape})", r)
    big = [rank_input(q, (n * (LARGE // 8),), np.float32, salt=8) for q in range(n)]
    _same(mc.all_to_all(big[r], group=g), np.concatenate([_blocks(b, n, r) for b in big]), "all_to_all(large)", r)
    if n > 1:
        _raises(ValueError, lambda: mc.all_to_all(np.zeros(n + 1), group=g), "all_to_all of n+1 rows")
    _raises(ValueError, lambda: mc.all_to_all(np.float32(1), group=g), "all_to_all of a 0-d array")


def check_gather(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    for root in sorted({0, n - 1}):
        for dt in _dtypes():
            for shape in ((), (3,), (2, 5)):
                inputs = [rank_input(q, shape, dt, salt=9) for q in range(n)]
                got = mc.gather(inputs[r], root, group=g)
                if r == root:
                    want = np.stack(inputs) if shape == () else np.concatenate(inputs)
                    _same(got, want, f"gather(root={root}, {dt}, shape={shape})", r)
                else:
                    assert got is None, f"rank {r}: gather(root={root}) returned {type(got).__name__} off the root"
    big = [rank_input(q, (LARGE // 4,), np.float64, salt=10) for q in range(n)]
    got = mc.gather(big[r], 0, group=g)
    if r == 0:
        _same(got, np.concatenate(big), "gather(large)", r)
    _raises(ValueError, lambda: mc.gather(np.zeros(2), n, group=g), f"gather with root={n}")


def check_scatter(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    for root in sorted({0, n - 1}):
        for dt in _dtypes():
            for shape in ((n,), (2 * n, 3)):
                full = rank_input(root, shape, dt, salt=11)
                mine = full if r == root else np.zeros(shape, dt)
                got = mc.scatter(mine, root, group=g)
                _same(got, _blocks(full, n, r), f"scatter(root={root}, {dt}, shape={shape})", r)
    full = rank_input(0, (n * (LARGE // 4),), np.float32, salt=12)
    _same(mc.scatter(full if r == 0 else np.zeros_like(full), 0, group=g), _blocks(full, n, r), "scatter(large)", r)
    if n > 1:
        _raises(ValueError, lambda: mc.scatter(np.zeros(n + 1), 0, group=g), "scatter of n+1 rows")


def check_reduce(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    root = n - 1
    for dt in _dtypes():
        for shape in ((), (7,), (3, 5)):
            inputs = [rank_input(q, shape, dt, salt=13) for q in range(n)]
            for op in ("sum", "max", "min"):
                got = mc.reduce(inputs[r], root, op=op, group=g)
                if r == root:
                    _same(got, _expect(op, inputs), f"reduce(op={op}, {dt}, shape={shape})", r)
                else:
                    assert got is None, f"rank {r}: reduce returned {type(got).__name__} off the root"
    # bit-identical to all_sum on random floats, small and large
    rng = np.random.default_rng(99 + r)
    for size in (1000, 300_001):
        x = rng.standard_normal(size).astype(np.float32)
        a = mc.all_sum(x, group=g)
        b = mc.reduce(x, 0, group=g)
        if r == 0:
            assert b is not None and a.tobytes() == b.tobytes(), (
                f"rank {r}: reduce(sum) of {size} random float32 is not bit-identical to all_sum"
            )
    _raises(ValueError, lambda: mc.reduce(np.zeros(2), 0, op="prod", group=g), "reduce(op='prod')")


def check_objects(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    mine = {"rank": r, "text": "x" * r, "array": np.arange(r + 1), "nested": [r, (r, None)]}
    got = mc.all_gather_object(mine, group=g)
    assert isinstance(got, list) and len(got) == n, f"rank {r}: all_gather_object returned {got!r}"
    for q, obj in enumerate(got):
        assert obj["rank"] == q and obj["text"] == "x" * q and obj["nested"] == [q, (q, None)], (
            f"rank {r}: all_gather_object entry {q} is {obj!r}"
        )
        assert np.array_equal(obj["array"], np.arange(q + 1))
    for root in range(n):
        value = {"root": root, "big": list(range(1000))} if r == root else None
        got = mc.broadcast_object(value, root, group=g)
        assert got == {"root": root, "big": list(range(1000))}, f"rank {r}: broadcast_object(root={root}) gave {got!r}"
    # a rank whose object cannot be pickled: every rank raises ValueError, nobody hangs
    _raises(
        ValueError,
        lambda: mc.all_gather_object((lambda: 0) if r == n - 1 else r, group=g),
        "all_gather_object of an unpicklable object on one rank",
    )
    assert mc.all_gather_object(r, group=g) == list(range(n)), f"rank {r}: the group is unusable after the error"


def _check_bad_out(name: str, call: Callable[..., object], shape: tuple[int, ...]) -> None:
    """Wrong shape, wrong dtype, not contiguous, read-only: ValueError before any communication."""
    _raises(ValueError, lambda: call(np.empty((*shape, 2), np.float32)), f"{name}(out= of the wrong shape)")
    _raises(ValueError, lambda: call(np.empty(shape, np.float64)), f"{name}(out= of the wrong dtype)")
    _raises(
        ValueError, lambda: call(np.empty((shape[0], shape[1] * 2), np.float32)[:, ::2]), f"{name}(out= not contiguous)"
    )
    ro = np.empty(shape, np.float32)
    ro.flags.writeable = False
    _raises(ValueError, lambda: call(ro), f"{name}(out= read-only)")


def check_out(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    x = rank_input(r, (2 * n, 3), np.float32, salt=14)
    inputs = [rank_input(q, (2 * n, 3), np.float32, salt=14) for q in range(n)]
    cases: list[tuple[str, Callable[..., object], tuple[int, ...], np.ndarray | None]] = [
        ("all_sum", lambda o: mc.all_sum(x, group=g, out=o), x.shape, _expect("sum", inputs)),
        ("all_max", lambda o: mc.all_max(x, group=g, out=o), x.shape, _expect("max", inputs)),
        ("all_gather", lambda o: mc.all_gather(x, group=g, out=o), (2 * n * n, 3), np.concatenate(inputs)),
        ("sum_scatter", lambda o: mc.sum_scatter(x, group=g, out=o), (2, 3), _blocks(_expect("sum", inputs), n, r)),
        ("broadcast", lambda o: mc.broadcast(x, 0, group=g, out=o), x.shape, inputs[0]),
        (
            "all_to_all",
            lambda o: mc.all_to_all(x, group=g, out=o),
            x.shape,
            np.concatenate([_blocks(inputs[q], n, r) for q in range(n)]),
        ),
        ("scatter", lambda o: mc.scatter(x, 0, group=g, out=o), (2, 3), _blocks(inputs[0], n, r)),
        (
            "gather",
            lambda o: mc.gather(x, 0, group=g, out=o),
            (2 * n * n, 3),
            np.concatenate(inputs) if r == 0 else None,
        ),
        ("reduce", lambda o: mc.reduce(x, 0, group=g, out=o), x.shape, _expect("sum", inputs) if r == 0 else None),
    ]
    for name, call, shape, want in cases:
        o = np.full(shape, -7, np.float32)
        got = call(o)
        if want is None:
            assert got is None, f"rank {r}: {name}(out=) returned {type(got).__name__} off the root"
            continue
        assert got is o, f"rank {r}: {name}(out=) did not return out"
        _same(o, want, f"{name}(out=)", r)
        _check_bad_out(name, call, shape)
    # in place
    y = x.copy()
    assert mc.all_sum(y, group=g, out=y) is y
    _same(y, _expect("sum", inputs), "all_sum(x, out=x)", r)
    y = x.copy()
    view = y[...]  # another view of exactly x's memory is x itself
    assert mc.all_max(y, group=g, out=view) is view
    _same(y, _expect("max", inputs), "all_max(x, out=x[...])", r)
    y = x.copy()
    assert mc.all_min(y, group=g, out=y) is y
    _same(y, _expect("min", inputs), "all_min(x, out=x)", r)
    y = x.copy()
    assert mc.broadcast(y, n - 1, group=g, out=y) is y
    _same(y, inputs[n - 1], "broadcast(x, out=x)", r)
    if n > 1:
        y = x.copy()
        _raises(ValueError, lambda: mc.all_gather(y, group=g, out=y), "all_gather(out=x)")
        peer = (r + 1) % n
        src = (r - 1) % n
        o = np.empty((4,), np.int64)
        if r % 2 == 0:
            mc.send(np.arange(4) + r, peer, group=g)
            got = mc.recv((4,), np.int64, src, group=g, out=o)
        else:
            got = mc.recv((4,), np.int64, src, group=g, out=o)
            mc.send(np.arange(4) + r, peer, group=g)
        assert got is o
        _same(o, np.arange(4) + src, "recv(out=)", r)


def check_async(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    inputs = [rank_input(q, (LARGE // 16,), np.float64, salt=15) for q in range(n)]
    # several in flight, a blocking call between them, then waited in reverse order
    h1 = mc.all_sum(inputs[r], group=g, async_op=True)
    h2 = mc.all_gather(np.array([r]), group=g, async_op=True)
    h3 = mc.broadcast(np.array([r, r]), n - 1, group=g, async_op=True)
    mid = mc.all_max(np.array([r]), group=g)
    h4 = mc.all_gather_object(("async", r), group=g, async_op=True)
    h5 = g.barrier(async_op=True)
    h6 = mc.reduce(inputs[r], 0, group=g, async_op=True)
    assert h5.wait() is None
    _same(mid, np.array([n - 1]), "blocking all_max between async calls", r)
    assert h4.wait() == [("async", q) for q in range(n)], f"rank {r}: async all_gather_object"
    _same(h3.wait(), np.array([n - 1, n - 1]), "async broadcast", r)
    _same(h2.wait(), np.arange(n), "async all_gather", r)
    total = h1.wait()
    _same(total, _expect("sum", inputs), "async all_sum", r)
    red = h6.wait(timeout=60)
    if r == 0:
        assert red is not None and red.tobytes() == total.tobytes(), f"rank {r}: async reduce differs from all_sum"
    for h in (h1, h2, h3, h4, h5, h6):
        assert h.is_completed(), f"rank {r}: a waited handle is not completed"
    # async out=, and async send/recv around a ring
    o = np.empty(3, np.int64)
    h = mc.all_sum(np.array([1, 2, 3]), group=g, out=o, async_op=True)
    assert h.wait() is o and o.tolist() == [n, 2 * n, 3 * n]
    if n > 1:
        # queued operations run one at a time in issue order, so order sends and receives as
        # for blocking calls (a send may not complete before its receive is posted: gloo)
        first, second = ((r + 1) % n, (r - 1) % n)
        sent = np.full(5, r)
        if r % 2 == 0:
            hs = mc.send(sent, first, group=g, async_op=True)
            hr = mc.recv((5,), np.int64, second, group=g, async_op=True)
        else:
            hr = mc.recv((5,), np.int64, second, group=g, async_op=True)
            hs = mc.send(sent, first, group=g, async_op=True)
        _same(hr.wait(), np.full(5, (r - 1) % n), "async recv around the ring", r)
        assert hs.wait() is sent, f"rank {r}: an async send's wait() is not the array it sent (as MLX's send)"
    # bad arguments raise at the call, not in wait
    _raises(
        ValueError,
        lambda: (
            mc.scatter(np.zeros(n + 1), 0, group=g, async_op=True)
            if n > 1
            else mc.all_to_all(np.float32(1), group=g, async_op=True)
        ),
        "async call with a bad shape",
    )


def check_close_split(g: mc.Group) -> None:
    n, r = g.size(), g.rank()
    sub = g.split(0)
    _same(mc.all_sum(np.array([1]), group=sub), np.array([n]), "all_sum on a split before close", r)
    with sub:
        pass
    sub.close()  # twice: nothing happens
    _raises(mc.DistributedError, lambda: mc.all_sum(np.array([1]), group=sub), "all_sum on a closed split")
    _raises(mc.DistributedError, lambda: sub.barrier(), "barrier on a closed split")
    _same(mc.all_sum(np.array([1]), group=g), np.array([n]), "the world after closing a split", r)
    _identical_everywhere(g, mc.all_sum(np.arange(5.0) * (r + 1), group=g), "all_sum after close of a split")


def check_persistent(g: mc.Group) -> None:
    """all_reduce_init: each start reduces x's current contents into the same array, equal to
    all_sum/all_max/all_min of the same input, between other collectives; bad arguments are
    refused before any communication; a closed one refuses to start."""
    n, r = g.size(), g.rank()
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = base + r
    with g.all_reduce_init(x) as p:
        for step in range(1, 4):
            x += 1  # in place: the operation reads x at every start
            got = p()
            assert got is p.out, f"rank {r}: start #{step} did not return the operation's out array"
            _same(got, n * base + (n * (n - 1) // 2 + n * step), f"all_reduce_init start #{step}", r)
            _same(mc.all_gather(np.array([step]), group=g), np.full(n, step), "all_gather between starts", r)
        _same(got, mc.all_sum(x, group=g), "a start against all_sum of the same input", r)
    _raises(mc.DistributedError, p, "a start after close()")
    xi = np.array([r, -r, 7], dtype=np.int32)
    out = np.empty(3, dtype=np.int32)
    for op, want in (("max", [n - 1, 0, 7]), ("min", [0, -(n - 1), 7])):
        with g.all_reduce_init(xi, op, out=out) as q:
            _same(q(), np.array(want, dtype=np.int32), f"all_reduce_init op={op!r}", r)
            assert q.out is out, f"rank {r}: all_reduce_init(out=...) did not write into out"
    _raises(TypeError, lambda: g.all_reduce_init([1.0, 2.0]), "all_reduce_init of a list")  # type: ignore[arg-type]
    _raises(ValueError, lambda: g.all_reduce_init(np.ones((4, 4))[:, 0]), "all_reduce_init of a strided view")
    _raises(ValueError, lambda: g.all_reduce_init(np.ones(4), "prod"), "all_reduce_init with op='prod'")
    _raises(ValueError, lambda: g.all_reduce_init(np.ones(4), out=np.ones(5)), "all_reduce_init with a wrong out")


MORE_CHECKS: list[Callable[[mc.Group], None]] = [
    check_all_to_all,
    check_gather,
    check_scatter,
    check_reduce,
    check_objects,
    check_out,
    check_async,
    check_close_split,
    check_persistent,
]

ALL_CHECKS: list[Callable[[mc.Group], None]] = [*CHECKS, *MORE_CHECKS]
