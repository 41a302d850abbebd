"""The second round of the API (issue 16): all_to_all, gather, scatter, reduce, the object
collectives, ``out=``, ``async_op=True`` and ``close()`` — on real sockets jobs of 1-5 ranks
(and mpi, gloo), and in-process for the semantics that need a controlled peer."""

from __future__ import annotations

import sys
import threading
import time

import meshcomm as mc
import numpy as np
import pytest
from jobs import launch
from meshcomm.protocol import dtypes, operations
from meshcomm.testing.threaded import make_threaded_groups, run_threaded

MORE = (
    "import sys, meshcomm as mc\n"
    "from meshcomm.testing.contract import run_checks\n"
    "from meshcomm.testing.contract_more import MORE_CHECKS\n"
    "g = mc.init(strict=True)\n"
    "bad = run_checks(g, MORE_CHECKS)\n"
    "for name, err in bad: print('FAILED', g.rank(), name, err)\n"
    "print(f'rank {g.rank()}/{g.size()} on {g.backend}: {len(MORE_CHECKS) - len(bad)} more passed', flush=True)\n"
    "g.barrier()\n"
    "sys.exit(1 if bad else 0)\n"
)


def _run_more(tmp_path, n, backend, timeout=400):
    prog = tmp_path / "more.py"
    prog.write_text(MORE)
    res = launch(n, str(prog), backend=backend, timeout=timeout, launch_args=("--timeout", "60"))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    for r in range(n):
        assert f"rank {r}/{n} on {backend}: 9 more passed" in out, out[-4000:]


# -- real processes ---------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_new_operations_on_sockets(tmp_path, n):
    """Every dtype through all_to_all, gather, scatter, reduce; objects; out=; async; close."""
    _run_more(tmp_path, n, "sockets")


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_new_operations_on_mpi_and_gloo(tmp_path, backend):
    if not mc.is_available(backend):
        pytest.skip(f"{backend} is not installed here")
    _run_more(tmp_path, 3, backend)


ASYNC_EXIT = """
import sys, time, numpy as np, meshcomm as mc
g = mc.init(strict=True)
r, n = g.rank(), g.size()
mode = sys.argv[1]
if mode == "unwaited":
    hs = [mc.all_sum(np.full(100_000, r, np.float64), async_op=True) for _ in range(4)]
    print("issued", r, flush=True)      # never waited on: the exit lets them finish
elif mode == "unmatched":
    if r == 0:
        h = mc.recv((3,), np.float64, 1, async_op=True)   # rank 1 never sends
    print("issued", r, flush=True)
"""


@pytest.mark.parametrize("mode", ["unwaited", "unmatched"])
def test_a_handle_never_waited_on_does_not_hang_the_exit(tmp_path, mode):
    prog = tmp_path / "async_exit.py"
    prog.write_text(ASYNC_EXIT)
    t0 = time.monotonic()
    res = launch(3, str(prog), mode, timeout=120, launch_args=("--timeout", "20"))
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.stdout.count("issued") == 3, out[-3000:]
    assert res.returncode == 0, out[-3000:]
    assert took < 60, f"exit took {took:.1f} s"
    if mode == "unmatched":
        assert "never waited on" in out, out[-3000:]
    else:  # the exit let the matched operations finish on every rank: nothing failed
        assert "never waited on" not in out and "still unfinished" not in out, out[-3000:]


LOST = """
import sys, numpy as np, meshcomm as mc
g = mc.init(strict=True)
if g.rank() == 1:
    sys.exit(0)      # leaves while rank 0's async all_sum waits for it
h = mc.all_sum(np.ones(10), async_op=True)
try:
    h.wait()
    print("NO ERROR")
except mc.PeerLostError as exc:
    print("WAIT RAISED", exc.peer, exc)
"""


def test_a_lost_peer_is_raised_by_wait(tmp_path):
    prog = tmp_path / "lost.py"
    prog.write_text(LOST)
    res = launch(2, str(prog), timeout=120, launch_args=("--timeout", "20"))
    assert "WAIT RAISED 1" in res.stdout and "NO ERROR" not in res.stdout, (res.stdout + res.stderr)[-3000:]


CLOSE = """
import numpy as np, meshcomm as mc
with mc.init(strict=True) as world:
    sub = world.split(world.rank() % 2)
    h = mc.all_sum(np.ones(3), async_op=True)      # issued before close: close lets it finish
    s = mc.all_sum(np.ones(2), group=sub)
print("sum", h.wait().tolist(), world.closed, sub.closed, flush=True)
for call in (lambda: mc.all_sum(np.ones(1)), lambda: mc.all_sum(np.ones(1), group=sub), lambda: world.barrier()):
    try:
        call()
        print("NO ERROR")
    except mc.DistributedError:
        print("closed ok", flush=True)
world.close()
"""


@pytest.mark.parametrize("backend", ["sockets", "mpi", "gloo"])
def test_close_on_real_backends(tmp_path, backend):
    if not mc.is_available(backend):
        pytest.skip(f"{backend} is not installed here")
    prog = tmp_path / "close.py"
    prog.write_text(CLOSE)
    res = launch(3, str(prog), backend=backend, timeout=120, launch_args=("--timeout", "20"))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert res.stdout.count("sum [3.0, 3.0, 3.0] True True") == 3 and res.stdout.count("closed ok") == 9, out[-3000:]


def test_async_overlap_and_order_on_sockets(tmp_path):
    """Ranks issue async operations in one order and block in between: results match the
    blocking calls, and a blocking call issued behind queued async ones waits its turn."""
    prog = tmp_path / "order.py"
    prog.write_text(
        "import numpy as np, meshcomm as mc\n"
        "g = mc.init(strict=True); r, n = g.rank(), g.size()\n"
        "x = np.arange(1_000_000, dtype=np.float32) * (r + 1)\n"
        "want = mc.all_sum(x)\n"
        "hs = [mc.all_sum(x, async_op=True) for _ in range(6)]\n"
        "gathered = mc.all_gather(np.array([r]))\n"
        "assert gathered.tolist() == list(range(n)), gathered\n"
        "for h in hs:\n"
        "    assert h.wait().tobytes() == want.tobytes()\n"
        "o = np.empty_like(x)\n"
        "hs = [mc.all_max(x, async_op=True), mc.reduce(x, 1, async_op=True), mc.all_sum(x, out=o, async_op=True)]\n"
        "assert hs[2].wait() is o and o.tobytes() == want.tobytes()\n"
        "red = hs[1].wait(); assert (red is None) == (r != 1)\n"
        "if r == 1: assert red.tobytes() == want.tobytes()\n"
        "print('ordered ok', r, flush=True)\n"
    )
    res = launch(4, str(prog), timeout=200)
    assert res.returncode == 0 and res.stdout.count("ordered ok") == 4, (res.stdout + res.stderr)[-3000:]


# -- in process: semantics ------------------------------------------------------------
def test_operation_table_keeps_the_sockets_wire_codes():
    wire = operations.wire_names()
    assert wire[:10] == (
        "?",
        "all_sum",
        "all_max",
        "all_min",
        "all_gather",
        "sum_scatter",
        "broadcast",
        "send",
        "barrier",
        "split",
    )
    assert len(set(o.code for o in operations.OPERATIONS)) == len(operations.OPERATIONS)
    for op in operations.OPERATIONS:
        assert op.kind in ("collective", "p2p", "object", "group")
        if op.kind != "p2p" and op.name not in ("split", "barrier"):
            assert hasattr(mc, op.name) and hasattr(mc.Group, op.name), op.name
    assert dtypes.REDUCTIONS == operations.REDUCTIONS
    wire_mod = pytest.importorskip("meshcomm_sockets.wire")
    assert tuple(wire_mod.OPS) == wire[: len(wire_mod.OPS)], "the sockets opcodes must be the table's codes"


@pytest.mark.parametrize("n", [2, 3])
def test_bad_arguments_raise_before_any_communication(n):
    # one rank alone raising ValueError must not leave its peers waiting: nothing was sent
    def body(g):
        r = g.rank()
        errors = []
        for call in (
            lambda: mc.all_to_all(np.zeros(n + 1), group=g),
            lambda: mc.scatter(np.zeros((n + 1, 2)), 0, group=g),
            lambda: mc.gather(np.zeros(2), n, group=g),
            lambda: mc.reduce(np.zeros(2), -1, group=g),
            lambda: mc.reduce(np.zeros(2), 0, op="mean", group=g),
            lambda: mc.all_sum(np.zeros(3), out=np.zeros(4), group=g),
            lambda: mc.all_sum(np.zeros(3), out=np.zeros(3, np.float32), group=g),
            lambda: mc.all_gather(np.zeros(3), out=np.zeros(3 * n + 1), group=g, async_op=True),
            lambda: mc.broadcast_object(1, root=n, group=g),
        ):
            if r == 0:
                with pytest.raises(ValueError) as info:
                    call()
                errors.append(str(info.value))
        return errors, mc.all_sum(np.array([1]), group=g).tolist()

    results = run_threaded(n, body, timeout=10)
    assert all(res[1] == [n] for res in results)
    assert any("divisible" in e for e in results[0][0])
    assert any("'mean'" in e for e in results[0][0])
    assert any("rank 0" in e for e in results[0][0])


def test_out_in_place_and_overlap_rules():
    def body(g):
        x = np.arange(6.0) + g.rank()
        assert mc.all_sum(x, out=x, group=g) is x
        y = np.arange(6.0)
        with pytest.raises(ValueError, match="overlaps"):
            mc.all_sum(y[:3], out=y[1:4], group=g)
        z = np.arange(6.0) + g.rank()
        assert mc.all_sum(z[:3], out=z[0:3], group=g).base is z  # the same memory is x itself
        assert z[3:].tolist() == (np.arange(3.0, 6.0) + g.rank()).tolist()
        with pytest.raises(ValueError, match="only all_sum"):
            mc.all_to_all(y, out=y, group=g)
        b = np.full(4, g.rank(), np.int16)
        assert mc.broadcast(b, 1, out=b, group=g) is b
        return x, b, z

    (x0, b0, z0), (x1, b1, z1) = run_threaded(2, body)
    np.testing.assert_array_equal(z0[:3], np.arange(3.0) * 2 + 1)
    np.testing.assert_array_equal(z1[:3], z0[:3])
    np.testing.assert_array_equal(x0, np.arange(6.0) * 2 + 1)
    np.testing.assert_array_equal(x1, x0)
    assert b0.tolist() == b1.tolist() == [1] * 4


def test_a_backend_is_told_in_place_only_for_the_very_same_buffer():
    """``meshcomm.protocol.backend.in_place``: what MPI and gloo use to pick MPI_IN_PLACE."""
    from meshcomm.protocol.backend import in_place

    a = np.arange(8.0)
    assert in_place(a, a.reshape(-1)) and in_place(a.reshape(2, 4).reshape(-1), a)
    assert not in_place(a, a.copy())
    assert not in_place(a[:4], a[4:])  # neighbours in one array
    assert not in_place(a[:5], a[3:])  # overlapping, different start: never in place


def test_errors_reach_wait_and_every_rank():
    def body(g):
        h = mc.all_sum(np.ones(3 + g.rank()), group=g, async_op=True)
        with pytest.raises(mc.CollectiveMismatchError, match=r"\(3,\).*\(4,\)|\(4,\).*\(3,\)"):
            h.wait()
        assert h.is_completed()
        return True

    assert run_threaded(2, body, timeout=10) == [True, True]


def test_reduce_op_and_root_mismatch_is_detected():
    def body(g):
        try:
            mc.reduce(np.ones(3), 0, op="max" if g.rank() == 1 else "sum", group=g)
        except mc.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    msgs = run_threaded(3, body, timeout=10)
    assert len(set(msgs)) == 1 and "op='max'" in msgs[0] and "op='sum'" in msgs[0], msgs
    msgs = run_threaded(2, lambda g: _mismatch(lambda: mc.gather(np.ones(2), g.rank(), group=g)), timeout=10)
    assert all("root=0" in m and "root=1" in m for m in msgs), msgs
    msgs = run_threaded(
        2, lambda g: _mismatch(lambda: (mc.scatter if g.rank() else mc.all_to_all)(np.ones(4), group=g)), timeout=10
    )
    assert all("scatter" in m and "all_to_all" in m for m in msgs), msgs


def _mismatch(fn):
    try:
        fn()
    except mc.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_wait_timeout_then_wait_again():
    g0, g1 = make_threaded_groups(2, timeout=20)
    h = mc.all_sum(np.ones(2), group=g0, async_op=True)
    assert not h.is_completed()
    with pytest.raises(mc.CommTimeoutError, match="did not complete within"):
        h.wait(timeout=0.2)
    assert isinstance(mc.CommTimeoutError("x"), TimeoutError)
    other = mc.all_sum(np.ones(2), group=g1)
    assert h.wait(timeout=10).tolist() == [2, 2] and other.tolist() == [2, 2]


def test_blocking_calls_queue_behind_async_ones_in_issue_order():
    def body(g):
        r = g.rank()
        hs = [mc.broadcast(np.array([k, r]), root=k % g.size(), group=g, async_op=True) for k in range(5)]
        mid = mc.all_gather(np.array([r]), group=g)  # blocking: runs after the five
        late = [mc.all_sum(np.array([k]), group=g, async_op=True) for k in range(3)]
        if r == 0:
            time.sleep(0.2)  # rank 0 waits late: the others must still match in issue order
        return [h.wait().tolist() for h in hs], mid.tolist(), [h.wait().tolist() for h in late]

    for bcasts, mid, late in run_threaded(3, body, timeout=10):
        assert bcasts == [[k, k % 3] for k in range(5)]
        assert mid == [0, 1, 2]
        assert late == [[0], [3], [6]]


def test_second_thread_is_refused_while_async_operations_are_in_flight():
    g0, g1 = make_threaded_groups(2, timeout=10)
    h = mc.all_sum(np.ones(2), group=g0, async_op=True)  # in flight: rank 1 has not called
    refused = {}

    def intruder():
        try:
            mc.all_sum(np.ones(2), group=g0)
        except mc.DistributedError as exc:
            refused["err"] = str(exc)

    t = threading.Thread(target=intruder, name="intruder")
    t.start()
    t.join(5)
    assert "thread 'intruder'" in refused["err"] and "one operation at a time" in refused["err"]
    mc.all_sum(np.ones(2), group=g1)
    with pytest.raises(mc.DistributedError, match="is discarded"):
        h.wait(5)
    # the issuing thread itself may keep issuing (queued in order)
    hs = [mc.all_sum(np.ones(1), group=g0, async_op=True) for _ in range(3)]
    for _ in range(3):
        mc.all_sum(np.ones(1), group=g1)
    assert [x.wait(5).tolist() for x in hs] == [[2.0]] * 3


def test_objects_limit_and_unpicklable_raise_on_every_rank():
    fabric_groups = make_threaded_groups(2, timeout=10)
    for g in fabric_groups:
        g._max_object_bytes = 100

    def body(g):
        out = []
        for obj in ("small" if g.rank() else "x" * 500, (lambda: 1) if g.rank() == 0 else 1):
            try:
                mc.all_gather_object(obj, group=g)
                out.append("ok")
            except ValueError as exc:
                out.append(str(exc))
        out.append(mc.broadcast_object({"k": g.rank()}, root=1, group=g))
        return out

    results = [None, None]

    def run(r):
        results[r] = body(fabric_groups[r])

    ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    for res in results:
        assert "rank 0's object is" in res[0] and "MESHCOMM_MAX_OBJECT_BYTES" in res[0], res
        assert "cannot be pickled" in res[1], res
        assert res[2] == {"k": 1}
    assert "lambda" in results[0][1] or "pickle" in results[0][1].lower()


def test_max_object_bytes_setting(monkeypatch):
    monkeypatch.setenv("MESHCOMM_MAX_OBJECT_BYTES", "0")
    with pytest.raises(mc.ConfigError, match="MESHCOMM_MAX_OBJECT_BYTES"):
        mc.Config()
    monkeypatch.setenv("MESHCOMM_MAX_OBJECT_BYTES", "12345")
    assert mc.Config().max_object_bytes == 12345


def test_close_and_context_manager(fresh_registry, monkeypatch):
    for var in ("MLX_BACKEND", "MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with mc.init() as world:
        assert mc.all_sum([1, 2]).tolist() == [1, 2]
        h = mc.all_gather_object("a", async_op=True)
    assert h.wait() == ["a"]
    assert world.closed
    world.close()  # twice: nothing
    for call in (
        lambda: mc.all_sum([1]),
        lambda: world.barrier(),
        lambda: mc.broadcast_object(1, group=world),
        lambda: world.split(0),
    ):
        with pytest.raises(mc.DistributedError, match="closed"):
            call()
    again = mc.init()  # a new world
    assert again is not world and not again.closed and mc.all_sum([3]).tolist() == [3]


def test_closing_the_world_closes_the_backend_and_its_splits():
    g0, g1 = make_threaded_groups(2, timeout=10)
    closed = []

    def closer(rank):
        return lambda: closed.append(rank)

    for g in (g0, g1):
        g.transport.close = closer(g.rank())  # type: ignore[method-assign]
    results = {}

    def split(r, g):
        results[r] = g.split(0)

    ts = [threading.Thread(target=split, args=(r, g)) for r, g in enumerate((g0, g1))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    g0.close()
    g0.close()
    assert closed == [0]
    with pytest.raises(mc.DistributedError, match="world it was split from was closed"):
        mc.all_sum(np.ones(1), group=results[0])
    g1.close()
    assert sorted(closed) == [0, 1]


def test_async_on_size_one_and_every_op_returns_a_handle(fresh_registry, monkeypatch):
    for var in ("MLX_BACKEND", "MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    g = mc.init()
    x = np.arange(4.0)
    calls = {
        "all_sum": lambda: mc.all_sum(x, async_op=True),
        "all_max": lambda: mc.all_max(x, async_op=True),
        "all_min": lambda: mc.all_min(x, async_op=True),
        "all_gather": lambda: mc.all_gather(x, async_op=True),
        "sum_scatter": lambda: mc.sum_scatter(x, async_op=True),
        "broadcast": lambda: mc.broadcast(x, async_op=True),
        "all_to_all": lambda: mc.all_to_all(x, async_op=True),
        "gather": lambda: mc.gather(x, async_op=True),
        "scatter": lambda: mc.scatter(x, async_op=True),
        "reduce": lambda: mc.reduce(x, async_op=True),
        "all_gather_object": lambda: mc.all_gather_object(1, async_op=True),
        "broadcast_object": lambda: mc.broadcast_object(1, async_op=True),
        "barrier": lambda: g.barrier(async_op=True),
        "split": lambda: g.split(0, async_op=True),
    }
    for name, call in calls.items():
        h = call()
        assert isinstance(h, mc.Work), name
        res = h.wait(timeout=5)
        assert h.is_completed(), name
        if isinstance(res, np.ndarray):
            np.testing.assert_array_equal(res, x)


def test_every_dtype_in_process():
    from meshcomm.protocol.dtypes import SUPPORTED

    def body(g):
        n, r = g.size(), g.rank()
        for dt in SUPPORTED:
            x = (np.arange(2 * n) % 3 + r).astype(dt)
            a2a = mc.all_to_all(x, group=g)
            sc = mc.scatter(x, 1, group=g)
            rd = mc.reduce(x, 0, group=g, op="max")
            ag = mc.gather(x, 0, group=g, async_op=True).wait()
            if r == 0:
                assert rd.dtype == dt and ag.dtype == dt and ag.shape == (2 * n * n,)
            assert a2a.dtype == sc.dtype == dt
        return True

    assert run_threaded(3, body, timeout=20) == [True] * 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
