"""The compiled call path (``meshcomm.api._callpath.Lane``: a group's blocking all_sum, all_max
and all_min into a new result, persistent starts, the blocking barrier) does what the
pure-Python one (``Group._all_reduce``, ``MESHCOMM_COMPILED=0``, and where no compiled one is
installed) does: the same results, the same errors with the same messages and causes, the
same call numbers, the same record for the stall inspector. Every case runs on both, on an
in-process job of 2 ranks, and the two outcomes are compared with each other and with NumPy.

The real-process jobs run the compiled path by default and the pure-Python one where a test
says so (the contract on 3 ranks of every backend; the two-threads failure job).
"""

from __future__ import annotations

import threading
from typing import Any

import meshcomm as mc
import numpy as np
import pytest
from meshcomm.api import debug, observer
from meshcomm.api.group import Group
from meshcomm.api.guard import compiled_path, new_guard
from meshcomm.plugin import CallsDiffer
from meshcomm.protocol.dtypes import BASE_SUPPORTED
from meshcomm.testing.threaded import ThreadedBackend, _Fabric, make_threaded_groups, run_threaded
from meshcomm.trace import progress as progress_mod
from meshcomm.trace.progress import ProgressWriter
from meshcomm.trace.recorder import Recorder

PATHS = [True, False]
REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


@pytest.fixture(autouse=True)
def _installed() -> None:
    assert compiled_path() is not None, "no compiled call path in this install: run scripts/setup.sh"


def _outcome(fn: Any) -> Any:
    """What a call gives: ("ok", dtype, shape, bytes), ("ok", None) for None, or ("error",
    type, message, cause type)."""
    try:
        res = fn()
    except Exception as exc:
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        return ("error", type(exc).__name__, str(exc), cause, exc.__suppress_context__)
    if res is None:
        return ("ok", None)
    return ("ok", res.dtype, res.shape, res.tobytes(), type(res).__name__)


def _job(fn: Any, compiled: bool, **kw: Any) -> list[Any]:
    """``fn(group)`` on 2 threaded ranks whose worlds run the ``compiled`` path: per-rank outcomes."""

    def rank(g: Group) -> Any:
        assert (g._lane is not None) == compiled
        assert (g._starter != g._start_persistent) == compiled  # persistent starts too
        assert (g._barrier_lane is not None) == compiled  # and barriers
        return fn(g)

    return run_threaded(2, rank, timeout=10, compiled=compiled, **kw)


def _both(fn: Any, **kw: Any) -> list[list[Any]]:
    """``fn(group)`` on 2 threaded ranks, once per path: the two lists of per-rank outcomes."""
    return [_job(fn, compiled, **kw) for compiled in PATHS]


def _value(dtype: np.dtype, r: int, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return (np.arange(n) % (r + 2) == 0).reshape(shape)
    return (np.arange(n) % 7 + 3 * r).astype(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", BASE_SUPPORTED, ids=str)
@pytest.mark.parametrize("op", list(REDUCE))
@pytest.mark.parametrize("check_calls", [True, False], ids=["checked", "plain"])
def test_every_dtype_and_op_gives_the_same_result_on_both_paths(dtype: np.dtype, op: str, check_calls: bool) -> None:
    shapes = [(5,), (2, 3), (), (0,), (3, 0)]
    fn = {"sum": mc.all_sum, "max": mc.all_max, "min": mc.all_min}[op]

    def body(g: Group) -> list[Any]:
        return [_outcome(lambda s=s: fn(_value(dtype, g.rank(), s), group=g)) for s in shapes]

    compiled, python = _both(body, check_calls=check_calls)
    assert compiled == python
    for i, s in enumerate(shapes):
        want = REDUCE[op](_value(dtype, 0, s), _value(dtype, 1, s))
        if dtype == np.bool_ and op == "sum":
            want = np.logical_or(_value(dtype, 0, s), _value(dtype, 1, s))
        for r in range(2):
            kind, got_dtype, got_shape, data, _ = compiled[r][i]
            assert (kind, got_dtype, got_shape) == ("ok", dtype, s)
            assert data == want.astype(dtype).tobytes(), (s, r)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda r: np.arange(12.0).reshape(3, 4)[:, ::2] + r, id="not-contiguous"),
        pytest.param(lambda r: np.asfortranarray(np.arange(6.0).reshape(2, 3)) + r, id="fortran-order"),
        pytest.param(lambda r: np.lib.stride_tricks.as_strided(np.arange(3.0) + r, (3,), (8,)), id="view"),
        pytest.param(lambda r: [1.0 + r, 2.0], id="list"),
        pytest.param(lambda r: np.float32(r), id="numpy-scalar"),
        pytest.param(lambda r: 5 + r, id="python-int"),
        pytest.param(lambda r: np.ones(4, np.float32).view(np.ndarray)[::-1], id="reversed"),
        pytest.param(lambda r: np.array(["a", "b"]), id="strings"),
        pytest.param(lambda r: np.array([object(), 1], dtype=object), id="objects"),
        pytest.param(lambda r: np.ma.masked_array([1.0, 2.0]), id="ndarray-subclass"),
    ],
)
def test_inputs_the_lane_hands_back_behave_the_same(make: Any) -> None:
    """Arrays the compiled lane does not take itself (and what it takes only after a copy)
    give the same result or the same error on both paths."""

    def body(g: Group) -> Any:
        x = make(g.rank())
        if isinstance(x, np.ndarray) and x.flags.writeable:
            x.setflags(write=False)  # a read-only input is fine: it is only read
        return _outcome(lambda: g.all_sum(x))

    compiled, python = _both(body)
    assert compiled == python


@pytest.mark.parametrize("op", list(REDUCE))
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.complex128], ids=str)
def test_a_result_into_out_is_the_same_on_both_paths_and_the_lane_takes_it(op: str, dtype: type) -> None:
    """``out=`` that fits (the input's dtype and shape, C-contiguous, writable, apart from x)
    gets the result on the compiled lane itself (the Python path is not called); the same
    array is returned, with NumPy's result, on both paths."""
    fn = {"sum": mc.all_sum, "max": mc.all_max, "min": mc.all_min}[op]

    def body(g: Group) -> Any:
        python_calls = []
        python_path = g._all_reduce

        def counted(*args: Any) -> Any:
            python_calls.append(args[0])
            return python_path(*args)

        g._all_reduce = counted  # type: ignore[method-assign]
        got = []
        for shape in [(5,), (2, 3)]:
            x, out = _value(np.dtype(dtype), g.rank(), shape), np.full(shape, -1, dtype)
            res = fn(x, out=out, group=g)
            got.append((res is out, _outcome(lambda res=res: res)))
        return got, python_calls

    compiled, python = _both(body)
    assert [c[0] for c in compiled] == [p[0] for p in python]
    for r in range(2):
        assert compiled[r][1] == [], "the compiled lane handed a fitting out= to the Python path"
        assert python[r][1] == [op, op]
        for (same, outcome), shape in zip(compiled[r][0], [(5,), (2, 3)], strict=True):
            want = REDUCE[op](_value(np.dtype(dtype), 0, shape), _value(np.dtype(dtype), 1, shape)).astype(dtype)
            assert same and outcome[3] == want.tobytes()


@pytest.mark.parametrize(
    "make_out",
    [
        pytest.param(lambda x: x, id="x-itself"),
        pytest.param(lambda x: x[::-1], id="x-reversed-view"),
        pytest.param(lambda x: np.empty(x.shape, np.float64), id="other-dtype"),
        pytest.param(lambda x: np.empty(x.shape, x.dtype.newbyteorder()), id="other-byte-order"),
        pytest.param(lambda x: np.empty((x.size + 1,), x.dtype), id="other-shape"),
        pytest.param(lambda x: np.empty((x.size * 2,), x.dtype)[::2], id="not-contiguous"),
        pytest.param(lambda x: np.empty(x.shape, x.dtype, order="C").view(np.ma.MaskedArray), id="subclass"),
        pytest.param(lambda x: [0.0] * x.size, id="list"),
        pytest.param(lambda x: _read_only(np.empty(x.shape, x.dtype)), id="read-only"),
    ],
)
def test_an_out_the_lane_hands_back_behaves_the_same(make_out: Any) -> None:
    """``out=`` arrays the compiled lane does not take itself (in place, overlapping, of
    another dtype or shape, not contiguous, read-only, not an ndarray) give the same result
    or the same error on both paths."""

    def body(g: Group) -> Any:
        x = np.arange(4, dtype=np.float32) + g.rank()
        out = make_out(x)
        return _outcome(lambda: g.all_sum(x, out=out)), x.tolist()

    compiled, python = _both(body)
    assert compiled == python


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def test_a_mismatch_raises_the_same_error_on_both_paths() -> None:
    def body(g: Group) -> Any:
        return _outcome(lambda: g.all_max(np.ones(3 + g.rank(), np.float32)))

    compiled, python = _both(body)
    assert compiled == python
    assert compiled[0][0] == "error" and compiled[0][1] == "CollectiveMismatchError", compiled


def test_an_unexpected_error_names_the_rank_and_keeps_its_cause_on_both_paths() -> None:
    def body(g: Group) -> Any:
        def broken(*args: Any) -> None:
            raise RuntimeError("the transport broke")

        g._moves.all_reduce = broken  # type: ignore[method-assign]
        first = _outcome(lambda: g.all_sum(np.ones(2)))
        again = _outcome(lambda: g.all_min(np.ones(2)))  # the guard let the world go
        return first, again, g._calls, g._b.user_op, g._b.user_no

    compiled, python = _both(body, check_calls=False)
    assert compiled == python
    (kind, name, message, cause, _), _, calls, user_op, user_no = compiled[0]
    assert (kind, name, cause) == ("error", "DistributedError", "RuntimeError")
    assert message == "[threaded] rank 0: all_sum failed: RuntimeError: the transport broke"
    assert (calls, user_op, user_no) == (2, "all_min", 2)


def test_errors_the_core_expects_pass_through_unchanged_on_both_paths() -> None:
    def body(g: Group) -> Any:
        def refuse(*args: Any) -> None:
            raise ValueError("no such reduction here")

        g._moves.all_reduce = refuse  # type: ignore[method-assign]
        return _outcome(lambda: g.all_max(np.ones(2)))

    compiled, python = _both(body, check_calls=False)
    assert compiled == python == [("error", "ValueError", "no such reduction here", None, False)] * 2


@pytest.mark.parametrize("check_calls", [True, False], ids=["checked", "plain"])
def test_a_barrier_numbers_its_calls_and_raises_the_same_errors_on_both_paths(check_calls: bool) -> None:
    """Barriers count as calls of the group; a barrier met by another call on the other rank
    (checked), a failing transport, a closed group raise alike on both paths."""

    def body(g: Group) -> Any:
        done = [g.barrier(), g.barrier(), g._calls, g._b.user_op]
        if check_calls:  # rank 0's barrier meets rank 1's all_sum
            met = _outcome(lambda: g.barrier() if g.rank() == 0 else g.all_sum(np.ones(1, np.float32)))
        else:

            def broken() -> None:
                raise RuntimeError("the transport broke")

            g._moves.barrier = broken  # type: ignore[method-assign]
            met = _outcome(g.barrier)
        g.close()
        return done, met, _outcome(g.barrier)

    compiled, python = _both(body, check_calls=check_calls)
    assert compiled == python
    done, met, closed = compiled[0]
    assert done == [None, None, 2, "barrier"]
    if check_calls:
        assert met[:2] == ("error", "CollectiveMismatchError") and "barrier" in met[2] and "all_sum" in met[2], met
    else:
        assert met[:4] == (
            "error",
            "DistributedError",
            "[threaded] rank 0: barrier failed: RuntimeError: the transport broke",
            "RuntimeError",
        )
    assert closed[1] == "DistributedError" and "barrier called" in closed[2] and "after it was closed" in closed[2]


def test_a_closed_group_refuses_the_same_way_on_both_paths() -> None:
    def body(g: Group) -> Any:
        g.barrier()
        g.close()
        return _outcome(lambda: g.all_sum(np.ones(2)))

    compiled, python = _both(body)
    assert compiled == python
    assert compiled[0][1] == "DistributedError" and "after it was closed" in compiled[0][2]


def test_a_blocking_call_waits_for_queued_asynchronous_ones_on_both_paths() -> None:
    def body(g: Group) -> Any:
        work = g.all_sum(np.full(1000, 1.0 + g.rank()), async_op=True)
        now = g.all_sum(np.full(3, 10.0))  # queued behind it, not paired with it
        return work.wait().tolist()[:2], now.tolist(), g._calls

    compiled, python = _both(body)
    assert compiled == python == [([3.0, 3.0], [20.0, 20.0, 20.0], 2)] * 2


class _Watching:
    """An observer that runs every operation itself (no lane_record): what it was handed."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def call(self, group: Any, op: str, run: Any, payload: Any = None, arg: int = -1, seq: int = 0) -> Any:
        with self.lock:
            self.seen.append((op, arg, seq))
        return run()


def test_an_observer_without_lane_record_sees_every_call_on_both_paths() -> None:
    seen = []
    for compiled in PATHS:
        watch = _Watching()
        observer.attach(watch)
        try:
            run_threaded(
                2, lambda g: [g.all_sum(np.ones(3)), g.all_min(np.ones(2, np.int8)), g.barrier()], compiled=compiled
            )
        finally:
            observer.detach()
        seen.append(sorted(watch.seen))
    assert seen[0] == seen[1]
    assert seen[0] == sorted([("all_sum", -1, 1), ("all_min", -1, 2), ("barrier", -1, 3)] * 2)


def _record_bytes(mm: Any) -> bytes:
    """The record without its time field (the only field that differs between two runs)."""
    raw = bytes(mm)
    return raw[:16] + raw[24:]


def test_the_stall_inspectors_record_is_written_alike_on_both_paths(tmp_path: Any) -> None:
    """With the stall inspector's recorder attached (no tracing), the compiled lane keeps
    ``current`` and writes the progress record itself: the same bytes as Recorder.call and
    ProgressWriter.begin/end write, the same ``current`` during the call, None after."""
    runs = [_recorded_run(tmp_path / ("c" if compiled else "p"), compiled) for compiled in PATHS]
    assert runs[0] == runs[1]
    records, currents = runs[0]
    assert currents == [("world", 0, 0, 1, 1, "all_sum", -1), ("world", 0, 0, 1, 2, "all_max", -1)]
    state = int.from_bytes(records[1][progress_mod._STATE_AT : progress_mod._STATE_AT + 4], "little")
    assert state == progress_mod.FAILED


def _recorded_run(folder: Any, compiled: bool) -> tuple[tuple[bytes, bytes], list[Any]]:
    """Two calls and a failing one on a 1-rank world with the stall inspector's recorder:
    the progress record after the second and after the third (without its time), and
    ``current`` as the backend saw it during the first two (without the start time)."""
    g = make_threaded_groups(1, compiled=compiled)[0]  # one rank: the size-1 backend's copy
    writer = ProgressWriter(folder, 0)
    rec = Recorder(g, folder=None, capacity=8, progress=writer)
    during: list[Any] = []
    original = g._moves.all_reduce

    def watched(*args: Any) -> None:
        during.append(rec.current)
        original(*args)

    def broken(*args: Any) -> None:
        raise RuntimeError("x")

    calls: list[str] = []
    rec_call = rec.call

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(args[1])
        return rec_call(*args, **kw)

    g._moves.all_reduce = watched  # type: ignore[method-assign]
    rec.call = counted  # type: ignore[method-assign]
    observer.attach(rec)
    try:
        g.all_sum(np.ones(3))
        g.all_max(np.ones((2, 2), np.int32))
        after = rec.current
        ok_record = _record_bytes(writer._mm)
        g._moves.all_reduce = broken  # type: ignore[method-assign]
        with pytest.raises(mc.DistributedError):
            g.all_min(np.ones(2))
        failed_record = _record_bytes(writer._mm)
    finally:
        observer.detach()
        writer.close()
    assert after is None and rec.current is None
    # the compiled lane keeps the record itself; the Python path runs through Recorder.call
    assert calls == ([] if compiled else ["all_sum", "all_max", "all_min"])
    assert all(isinstance(c[7], float) for c in during)
    return (ok_record, failed_record), [c[:7] for c in during]


def test_a_tracing_recorder_gets_every_event_on_both_paths(tmp_path: Any) -> None:
    """While tracing, the compiled lane hands each call to the recorder (its ring keeps them)."""
    events = []
    for compiled in PATHS:
        g = make_threaded_groups(1, compiled=compiled)[0]
        rec = Recorder(g, folder=tmp_path, capacity=8, progress=None)
        observer.attach(rec)
        try:
            g.all_sum(np.ones(3, np.float32))
            g.all_min(np.ones(5, np.int64))
            g.barrier()
        finally:
            observer.detach()
        assert rec.ring is not None
        events.append([(e[0], e[1], e[2], e[3], e[4], str(e[5]), e[8]) for e in rec.ring])
    want = [
        ("world", 1, "all_sum", -1, 12, "float32", True),
        ("world", 2, "all_min", -1, 40, "int64", True),
        ("world", 3, "barrier", -1, 0, "", True),
    ]
    assert events[0] == events[1] == want


@pytest.mark.parametrize("op", list(REDUCE))
@pytest.mark.parametrize("dtype", [np.float32, np.int64], ids=str)
def test_persistent_starts_give_the_same_results_and_numbers_on_both_paths(op: str, dtype: type) -> None:
    def body(g: Group) -> Any:
        x = np.zeros(5, dtype)
        got = []
        with g.all_reduce_init(x, op) as p:
            for step in range(3):
                x[...] = np.arange(5) * (g.rank() + 1) + step
                got.append(_outcome(p))
        return got, g._calls, g._b.user_op

    compiled, python = _both(body)
    assert compiled == python
    got, calls, user_op = compiled[0]
    assert (calls, user_op) == (3, "all_reduce_init")
    for step, outcome in enumerate(got):
        a, b = np.arange(5) + step, np.arange(5) * 2 + step
        assert outcome[3] == REDUCE[op](a, b).astype(dtype).tobytes()


def test_persistent_start_errors_are_the_same_on_both_paths() -> None:
    def body(g: Group) -> Any:
        mismatch = g.all_reduce_init(np.ones(3 + g.rank()))  # the ranks' shapes differ
        first = _outcome(mismatch)
        broken = g.all_reduce_init(np.ones(2))

        def fails() -> None:
            raise RuntimeError("the start broke")

        broken._start = fails
        second = _outcome(broken)
        g.barrier()
        g.close()
        third = _outcome(broken)
        return first, second, third

    compiled, python = _both(body, check_calls=True)
    assert compiled == python
    first, second, third = compiled[0]
    assert first[:2] == ("error", "CollectiveMismatchError"), first
    assert second[:4] == (
        "error",
        "DistributedError",
        "[threaded] rank 0: all_reduce_init failed: RuntimeError: the start broke",
        "RuntimeError",
    )
    assert third[1] == "DistributedError" and "after it was closed" in third[2], third


class _CarryingBackend(ThreadedBackend):
    """A threaded rank whose backend carries the core's call check beside the data
    (``pipelines_calls``), as mpi does: each all-reduce records the key it was given and
    compares the ranks' keys before the data moves."""

    pipelines_calls = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.keys: list[Any] = []

    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        key, self.call_key = self.call_key, None
        self.keys.append(None if key is None else key.tolist())
        if key is not None:
            seen = np.empty(2, np.int64)
            super().all_reduce(key, seen, "max")
            if seen[0] != -seen[1]:
                raise CallsDiffer("the carried keys differ")
        super().all_reduce(sendbuf, recvbuf, op)

    def barrier(self) -> None:
        self.all_reduce(np.zeros(1), np.empty(1), "sum")  # the carried check is the barrier


def test_a_backend_carrying_the_call_check_gets_each_calls_key_on_both_paths() -> None:
    """On a group whose backend carries the check, the compiled path hands the backend the
    key Group._check makes for each call (remembered for a repeat of the same dtype and shape,
    made anew for any other), names the call in flight on a mismatch, and clears the key after
    every call, as the pure-Python path does."""
    calls = [
        ("all_sum", np.float32, (3,)),
        ("all_sum", np.float32, (3,)),
        ("all_sum", np.float32, (1, 3)),
        ("all_max", np.float32, (3,)),
        ("all_sum", np.float64, (3,)),
        ("all_sum", np.float32, (3,)),
        ("all_min", np.int32, (2, 2)),
        ("all_min", np.int32, (2, 2)),
        ("barrier", None, ()),
        ("barrier", None, ()),
        ("all_min", np.int32, (2, 2)),
    ]

    def job(compiled: bool) -> list[Any]:
        fabric = _Fabric(2)
        groups = [Group(_CarryingBackend(fabric, r, 10.0), "threaded", guard=new_guard(compiled)) for r in range(2)]
        assert all(g._piped and (g._lane is not None) == compiled for g in groups)

        def rank(g: Group) -> Any:
            got = [
                _outcome(lambda c=c: g.barrier() if c[1] is None else getattr(g, c[0])(np.ones(c[2], c[1])))
                for c in calls
            ]
            got.append(_outcome(lambda: g.all_sum(np.ones(3 + g.rank(), np.float32))))  # shapes differ
            return got, g._moves.keys, g._moves.call_key, g._in_flight

        out: list[Any] = [None, None]
        threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, rank(groups[r]))) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads), "a rank did not finish"
        return out

    compiled, python = job(True), job(False)
    assert compiled == python
    got, keys, left, in_flight = compiled[0]
    assert all(o[0] == "ok" for o in got[:-1]) and got[-1][1] == "CollectiveMismatchError", got
    want = [debug.call_key(op, shape, None if dt is None else np.dtype(dt)).tolist() for op, dt, shape in calls]
    assert keys == [*want, debug.call_key("all_sum", (3,), np.dtype(np.float32)).tolist()]
    assert left is None and in_flight == ("all_sum", (3,), np.dtype(np.float32), 0, None)
