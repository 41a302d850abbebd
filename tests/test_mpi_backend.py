"""Tests of the ``mpi`` backend, run for real under the mpiexec of the MPI that mpi4py loads.

The module has two halves:

* pytest tests, which start jobs with :func:`meshcomm_mpi.launcher.mpiexec_command`;
* the rank side (``python tests/test_mpi_backend.py CHECK...`` under mpiexec), a set of
  ``rank_*`` functions that each compare what meshcomm returned with what NumPy
  computes from every rank's input, and print one ``RANKCHECK ok`` line per check.

The whole API contract runs through ``python -m meshcomm.testing.contract --backend mpi``
on 1, 2, 3 and 4 ranks (4 oversubscribes this 2-core machine).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()

# -- rank side -------------------------------------------------------------------------------


def _check_equal(got: np.ndarray, want: np.ndarray, what: str, rank: int) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"rank {rank}: {what}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)) and not np.array_equal(
        got, want, equal_nan=want.dtype.kind in "fc"
    ):
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:4]
        raise AssertionError(
            f"rank {rank}: {what} differs at {bad.tolist()}: got {got.reshape(-1)[bad]}, want {want.reshape(-1)[bad]}"
        )


def _bit_identical(g: Any, x: np.ndarray, what: str) -> None:
    import meshcomm as mc

    raw = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    every = mc.all_gather(raw, group=g).reshape(g.size(), -1)
    if not (every == every[0]).all():
        raise AssertionError(f"rank {g.rank()}: {what} is not bit-identical on every rank")


def _fold(f: Any, xs: list[np.ndarray]) -> np.ndarray:
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = f(acc, x).astype(acc.dtype)
    return acc


def rank_any_selects_mpi(g: Any) -> None:
    """Under mpiexec with MLX_BACKEND unset, ``init()`` (i.e. ``any``) chose mpi."""
    import meshcomm as mc

    w = mc.init()
    n = int(os.environ["OMPI_COMM_WORLD_SIZE"] if "OMPI_COMM_WORLD_SIZE" in os.environ else os.environ["PMI_SIZE"])
    if w.backend != "mpi" or w.size() != n:
        raise AssertionError(f"rank {g.rank()}: any chose {w.backend!r} of size {w.size()}, want 'mpi' of {n}")


def rank_integer_wrap(g: Any) -> None:
    """Long 8/16-bit integer sums wrap like NumPy (Open MPI's AVX kernels saturate)."""
    import meshcomm as mc

    n, r = g.size(), g.rank()
    length = (1 << 20) + 3
    for dt in (np.int8, np.int16, np.uint8, np.uint16):
        info = np.iinfo(dt)
        i = np.arange(length, dtype=np.int64)
        inputs = [
            ((i * (q + 7) + info.max - 5 * q) % (int(info.max) - int(info.min) + 1) + int(info.min)).astype(dt)
            for q in range(n)
        ]
        inputs = [np.where(i % 3 == 0, info.max - q, x).astype(dt) for q, x in enumerate(inputs)]  # overflow often
        got = mc.all_sum(inputs[r], group=g)
        _check_equal(got, _fold(np.add, inputs), f"all_sum({np.dtype(dt)}, {length})", r)
        _bit_identical(g, got, f"all_sum({np.dtype(dt)}, {length})")
        k = (length - 3) // n * n
        got = mc.sum_scatter(inputs[r][:k], group=g)
        want = _fold(np.add, [x[:k] for x in inputs])
        _check_equal(got, want[r * (k // n) : (r + 1) * (k // n)], f"sum_scatter({np.dtype(dt)})", r)


def rank_forced_numpy_int_sum(g: Any) -> None:
    """The user-defined NumPy op path (MESHCOMM_MPI_INT_SUM=numpy) is correct as well."""
    import meshcomm as mc
    from meshcomm.runtime.config import Config
    from meshcomm_mpi.factory import create_backend
    from meshcomm_mpi.settings import MPISettings

    n, r = g.size(), g.rank()
    b = create_backend(Config(), MPISettings(int_sum="numpy"))
    try:
        if b.split(0, -1).size() != n:  # type: ignore[attr-defined]
            raise AssertionError(f"rank {r}: split of the forced backend has the wrong size")
        sub = mc.Group(b, "mpi")
        for dt in (np.int8, np.uint16, np.int64):
            inputs = [np.full(70_001, np.iinfo(dt).max - q, dtype=dt) for q in range(n)]
            _check_equal(
                mc.all_sum(inputs[r], group=sub), _fold(np.add, inputs), f"numpy-op all_sum({np.dtype(dt)})", r
            )
    finally:
        b.close()


def rank_half_floats(g: Any) -> None:
    """float16 and bfloat16 sum/max/min (MPI has no portable half types)."""
    import meshcomm as mc
    from meshcomm.protocol.dtypes import bfloat16

    n, r = g.size(), g.rank()
    dts = [np.dtype(np.float16)] + ([bfloat16] if bfloat16 is not None else [])
    for dt in dts:
        i = np.arange(50_003)
        # halves of small integers: every partial sum is exact, so any order gives NumPy's answer
        inputs = [(((i * (q + 3) + q) % 23 - 11) / 2).astype(dt) for q in range(n)]
        for op, f, fn in (
            ("sum", np.add, mc.all_sum),
            ("max", np.maximum, mc.all_max),
            ("min", np.minimum, mc.all_min),
        ):
            got = fn(inputs[r], group=g)
            _check_equal(got, _fold(f, inputs), f"all_{op}({dt})", r)
            _bit_identical(g, got, f"all_{op}({dt})")
        k = 50_000 // n * n
        got = mc.sum_scatter(inputs[r][:k], group=g)
        want = _fold(np.add, [x[:k] for x in inputs])
        _check_equal(got, want[r * (k // n) : (r + 1) * (k // n)], f"sum_scatter({dt})", r)
        # rounding: 2048 + 1 in float16 rounds; the ufunc op must round like NumPy
        x = np.array([2048, 0.5, 1e4], dtype=dt) if r == 0 else np.array([1, 0.25, 7], dtype=dt)
        got = mc.all_sum(x, group=g)
        ins = [np.array([2048, 0.5, 1e4], dtype=dt)] + [np.array([1, 0.25, 7], dtype=dt)] * (n - 1)
        if n <= 2:  # beyond two ranks the (legitimate) order of float additions is MPI's
            _check_equal(got, _fold(np.add, ins), f"all_sum({dt}) rounding", r)
        _bit_identical(g, got, f"all_sum({dt}) rounding")


def rank_bool_and_complex(g: Any) -> None:
    """bool sum = logical or; complex max/min in NumPy's lexicographic order."""
    import meshcomm as mc

    n, r = g.size(), g.rank()
    i = np.arange(10_007)
    bools = [(i % (q + 2)) == 0 for q in range(n)]
    for op, f, fn in (("sum", np.add, mc.all_sum), ("max", np.maximum, mc.all_max), ("min", np.minimum, mc.all_min)):
        got = fn(bools[r], group=g)
        _check_equal(got, _fold(f, bools), f"all_{op}(bool)", r)
        if got.view(np.uint8).max() > 1:
            raise AssertionError(f"rank {r}: all_{op}(bool) produced bytes other than 0/1")
    for dt in (np.complex64, np.complex128):
        # equal real parts for many elements, so the imaginary part must decide
        cs = [((i % 5) - 2 + 1j * ((i * (q + 1)) % 7 - 3) + (q % 2) * 1j).astype(dt) for q in range(n)]
        for op, f, fn in (
            ("max", np.maximum, mc.all_max),
            ("min", np.minimum, mc.all_min),
            ("sum", np.add, mc.all_sum),
        ):
            got = fn(cs[r], group=g)
            _check_equal(got, _fold(f, cs), f"all_{op}({np.dtype(dt)})", r)
            _bit_identical(g, got, f"all_{op}({np.dtype(dt)})")


def rank_nan_max_min(g: Any) -> None:
    """Float max/min propagate NaN like np.maximum, identically on every rank."""
    import meshcomm as mc

    n, r = g.size(), g.rank()
    for dt in (np.float32, np.float64, np.complex64):
        xs = [np.arange(9, dtype=dt) * (q + 1) for q in range(n)]
        for q in range(n):
            xs[q][q] = np.nan  # rank q's NaN at index q
        for op, f, fn in (("max", np.maximum, mc.all_max), ("min", np.minimum, mc.all_min)):
            got = fn(xs[r], group=g)
            want = _fold(f, xs)
            if not np.array_equal(np.isnan(got), np.isnan(want)):
                raise AssertionError(
                    f"rank {r}: all_{op}({np.dtype(dt)}) NaNs at {np.isnan(got)}, want {np.isnan(want)}"
                )
            _check_equal(got, want, f"all_{op}({np.dtype(dt)}) with NaN", r)
            _bit_identical(g, got, f"all_{op}({np.dtype(dt)}) with NaN")


def rank_split_communicators(g: Any) -> None:
    """split gives MPIBackends on real MPI sub-communicators, for any integer colour and key."""
    import meshcomm as mc
    from meshcomm_mpi.backend import MPIBackend
    from mpi4py import MPI

    n, r = g.size(), g.rank()
    world = g.transport
    if not isinstance(world, MPIBackend):
        raise AssertionError(f"rank {r}: world transport is {type(world).__name__}")
    colors = {0: -7, 1: 2**40}  # negative and beyond 32 bits
    color = colors[r % 2]
    sub = g.split(color, key=n - r)  # reverse order
    t = sub.transport
    members = sorted((q for q in range(n) if q % 2 == r % 2), key=lambda q: n - q)
    if not isinstance(t, MPIBackend):
        raise AssertionError(f"rank {r}: split transport is {type(t).__name__}, not an MPIBackend")
    if t.comm.Get_size() != len(members) or sub.rank() != members.index(r):
        raise AssertionError(f"rank {r}: split communicator is rank {sub.rank()}/{t.comm.Get_size()}")
    if n > 1 and MPI.Comm.Compare(t.comm, world.comm) in (MPI.IDENT, MPI.CONGRUENT) and len(members) < n:
        raise AssertionError(f"rank {r}: split returned the world communicator")
    got = mc.all_gather(np.array([r]), group=sub)
    _check_equal(got, np.array(members), "all_gather in split (key order)", r)
    x = np.full(1001, r + 1, dtype=np.float32)
    _check_equal(
        mc.all_sum(x, group=sub), np.full(1001, sum(q + 1 for q in members), np.float32), "all_sum in split", r
    )
    # a second level of split, and the world still works afterwards
    solo = sub.split(sub.rank())
    if solo.size() != 1 or solo.transport.comm.Get_size() != 1:
        raise AssertionError(f"rank {r}: nested split has size {solo.size()}")
    _check_equal(mc.all_sum(np.array([n]), group=g), np.array([n * n]), "world after split", r)
    # colour/key too large for int64 on one rank: every rank raises ValueError, none hangs
    try:
        g.split(2**70 if r == 0 else 1)
    except ValueError as exc:
        if "rank 0" not in str(exc):
            raise AssertionError(f"rank {r}: split error does not name rank 0: {exc}") from None
    else:
        raise AssertionError(f"rank {r}: split with a colour of 2**70 on rank 0 did not raise ValueError")


def rank_error_translation(g: Any) -> None:
    """MPI errors surface as DistributedError carrying MPI's message and naming the rank/peer."""
    import meshcomm as mc

    n, r = g.size(), g.rank()
    # an invalid rank handed straight to the transport: MPI itself rejects it
    try:
        g.transport.send(np.zeros(2), n + 3)
    except mc.DistributedError as exc:
        msg = str(exc)
        if "MPI_ERR_RANK" not in msg and "invalid rank" not in msg.lower():
            raise AssertionError(f"rank {r}: error lacks MPI's message: {msg}") from None
        if f"rank {r}" not in msg or f"peer {n + 3}" not in msg:
            raise AssertionError(f"rank {r}: error does not name rank and peer: {msg}") from None
    else:
        raise AssertionError(f"rank {r}: send to rank {n + 3} did not raise DistributedError")
    if n < 2 or r > 1:
        g.barrier()
        return
    # a message longer than the receive buffer: MPI_ERR_TRUNCATE
    if r == 0:
        mc.send(np.arange(10, dtype=np.float32), 1, group=g)
        mc.send(np.arange(3, dtype=np.float32), 1, group=g)
    else:
        try:
            mc.recv((5,), np.float32, 0, group=g)
        except mc.DistributedError as exc:
            if "TRUNCATE" not in str(exc).upper() and "truncat" not in str(exc).lower():
                raise AssertionError(f"rank 1: truncation error lacks MPI's message: {exc}") from None
        else:
            raise AssertionError("rank 1: receiving 10 floats into 5 did not raise DistributedError")
        # a shorter message than expected is an error too, not a half-filled array
        try:
            mc.recv((5,), np.float32, 0, group=g)
        except mc.DistributedError as exc:
            if "got 3 elements" not in str(exc):
                raise AssertionError(f"rank 1: short-message error unclear: {exc}") from None
        else:
            raise AssertionError("rank 1: receiving 3 floats into 5 did not raise DistributedError")
    g.barrier()


def rank_die_after_barrier(g: Any) -> None:
    """The last rank is killed; the others wait on it forever unless the launcher ends the job."""
    import meshcomm as mc

    n, r = g.size(), g.rank()
    g.barrier()
    print(f"RANKCHECK alive rank {r}", flush=True)
    if r == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    mc.recv((4,), np.float32, n - 1, group=g)  # never satisfied
    print(f"RANKCHECK survived rank {r}", flush=True)


def rank_other_shape_same_count(g: Any) -> None:
    """Rank 1 sums a (3, 2) array where the others sum (2, 3): MPI would add them element by
    element; the call check carried beside the collective raises on every rank, naming both
    calls, and the communicator refuses further calls (MPI cannot cancel the one that met)."""
    import meshcomm as mc

    r = g.rank()
    # first on a split: a persistent all-reduce's start met by a plain all_sum, which the call
    # check tells apart (a backend may run the start as an MPI persistent request, which MPI
    # must not match with a plain one)
    sub = g.split(0)
    y = np.ones(4, dtype=np.float32)
    try:
        if r == 1:
            mc.all_sum(y, group=sub)
        else:
            sub.all_reduce_init(y)()
    except mc.CollectiveMismatchError as exc:
        if "all_reduce_init" not in str(exc) or "all_sum" not in str(exc):
            raise AssertionError(f"rank {r}: the mismatch error does not name both calls: {exc}") from None
    else:
        raise AssertionError(f"rank {r}: a persistent all-reduce met by an all_sum raised nothing")
    # the (6,) float32 plan made by a call every rank agrees on: the mismatch below then runs
    # as a start of it (in C on the compiled call path)
    mc.all_sum(np.ones(6, np.float32), group=g)
    x = np.ones((3, 2) if r == 1 else (2, 3), dtype=np.float32)
    try:
        got = mc.all_sum(x, group=g)
    except mc.CollectiveMismatchError as exc:
        text = str(exc)
        if "(2, 3)" not in text or "(3, 2)" not in text or "rank 1 called" not in text:
            raise AssertionError(f"rank {r}: the mismatch error does not name both calls: {text}") from None
    else:
        raise AssertionError(f"rank {r}: a (2, 3) and a (3, 2) all_sum returned {got.tolist()}")
    try:
        mc.all_sum(np.ones(4), group=g)
    except mc.DistributedError as exc:
        if "unusable" not in str(exc):
            raise AssertionError(f"rank {r}: the next call's error does not say why: {exc}") from None
    else:
        raise AssertionError(f"rank {r}: a call after the mismatch ran on the communicator")


def rank_carried_check_meets_other_calls(g: Any) -> None:
    """Where the extension is built, a small all_sum is one start of the call check's own
    operation, its data in the check's record (no plan, no second operation). Met on rank 1
    by another call -- an all_sum of another length or dtype (carried too), a bigger one (its
    plan beside the check), an all_max, a barrier, an all_gather -- every rank raises
    CollectiveMismatchError naming both calls, never returning a sum, and at once, not at the
    deadline (the records of every call check have one length, so two ranks' checks always
    meet; the test's job would run out of time first). A barrier is one start of the same
    operation with no data, in C (``barrier_now``): met by a bigger all_sum or an all_gather,
    it raises the same way."""
    import meshcomm as mc

    r = g.rank()
    x = np.full(2, r + 1, np.float32)
    _barrier_is_one_carried_start(g)
    cases = {
        "float32[3], carried": (lambda s: mc.all_sum(np.ones(3, np.float32), group=s), ["(2,)", "(3,)"]),
        "int32[2], carried": (lambda s: mc.all_sum(np.ones(2, np.int32), group=s), ["float32", "int32"]),
        "float32[100], planned": (lambda s: mc.all_sum(np.ones(100, np.float32), group=s), ["(2,)", "(100,)"]),
        "all_max": (lambda s: mc.all_max(x, group=s), ["all_max", "all_sum"]),
        "barrier": (lambda s: s.barrier(), ["barrier", "all_sum"]),
        "all_gather": (lambda s: mc.all_gather(x, group=s), ["all_gather", "all_sum"]),
        "barrier / float32[100]": (lambda s: mc.all_sum(np.ones(100, np.float32), group=s), ["barrier", "(100,)"]),
        "barrier / all_gather": (lambda s: mc.all_gather(x, group=s), ["barrier", "all_gather"]),
    }
    for case, (other, words) in cases.items():
        mine = (lambda s: s.barrier()) if case.startswith("barrier /") else (lambda s: mc.all_sum(x, group=s))
        sub = g.split(0)  # a communicator of its own: a mismatch makes it unusable
        for _ in range(2):  # the bigger all_sum's first call makes its plan
            _check_equal(mc.all_sum(x, group=sub), np.full(2, sub.size() * (sub.size() + 1) / 2, np.float32), "x", r)
            mc.all_sum(np.ones(100, np.float32), group=sub)
        carried = sub.transport.carried is not None
        if carried != (importlib.util.find_spec("meshcomm_mpi._planned") is not None):
            raise AssertionError(f"rank {r}: carried sum {carried} although the extension's presence differs")
        if carried and (np.dtype(np.float32), "sum", 2) in sub.transport._plans:
            raise AssertionError(f"rank {r}: a carried all_sum made a plan of its own")
        try:
            got = other(sub) if r == 1 else mine(sub)
        except mc.CollectiveMismatchError as exc:
            if not all(w in str(exc) for w in words):
                raise AssertionError(f"rank {r}: {case}: the error does not name both calls: {exc}") from None
        else:
            raise AssertionError(f"rank {r}: {case}: a carried call met by another call returned {got}")
    print(f"RANKCHECK carried cases rank {r} {len(cases)}", flush=True)


def _barrier_is_one_carried_start(g: Any) -> None:
    """Where the sum is carried, a barrier is the C entry's (``barrier_now``): one collective
    counted, the backend's Python call check not started; without it, the Python barrier."""
    sub = g.split(0)
    b, r = sub.transport, sub.rank()
    if (b.barrier_now is not None) != (b.carried is not None):
        raise AssertionError(f"rank {r}: barrier_now={b.barrier_now} but carried sum={b.carried}")
    python_keys = []
    python_start_key = b._start_key
    b._start_key = lambda: python_keys.append(1) or python_start_key()
    before = b.coll_count
    for _ in range(3):
        sub.barrier()
    if b.coll_count != before + 3 or bool(python_keys) != (b.barrier_now is None):
        raise AssertionError(f"rank {r}: 3 barriers counted {b.coll_count - before}, Python checks {len(python_keys)}")
    if b.barrier_now is not None and (not b.barrier_now() or b.coll_count != before + 4):
        raise AssertionError(f"rank {r}: barrier_now without a call key did not run as one collective")
    sub.close()


class _WatchedComm:
    """A communicator whose Iallreduce records the libnbc algorithm variable as MPI_T reads it."""

    def __init__(self, comm: Any, read: Any) -> None:
        self._comm, self._read, self.seen = comm, read, []

    def Iallreduce(self, *args: Any) -> Any:  # noqa: N802 - mpi4py's name
        self.seen.append(self._read())
        return self._comm.Iallreduce(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)


def _algorithm_reader() -> Any:
    """A function reading coll_libnbc_iallreduce_algorithm through MPI_T (Open MPI only)."""
    import ctypes

    from mpi4py import MPI

    lib = ctypes.CDLL(MPI.__file__)
    index, count, value = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    handle = ctypes.c_void_p()
    assert lib.MPI_T_cvar_get_index(b"coll_libnbc_iallreduce_algorithm", ctypes.byref(index)) == 0
    assert lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) == 0

    def read() -> int:
        assert lib.MPI_T_cvar_read(handle, ctypes.byref(value)) == 0
        return value.value

    return read


def rank_ring_allreduce(g: Any) -> None:
    """All-reduces from the ring threshold up run Open MPI's ring algorithm and give NumPy's
    results: every op and several dtypes, on both sides of the threshold and of 64 KiB, in
    place on some ranks only (on 4+ ranks Open MPI's own choice of algorithm would differ
    between those ranks)."""
    import meshcomm as mc
    from meshcomm_mpi import algorithms
    from mpi4py import MPI

    n, r = g.size(), g.rank()
    b = g.transport
    start = b._iallreduce
    if not MPI.Get_library_version().startswith("Open MPI"):
        if algorithms._variable is not None or start.ring_from is not None:
            raise AssertionError(f"rank {r}: the ring switch is on under {MPI.Get_library_version()[:20]}")
    else:
        want = algorithms.ring_threshold(n, "auto")
        if start.ring_from != want or algorithms._variable is None:
            raise AssertionError(f"rank {r}: ring from {start.ring_from} bytes, want {want}")
        read = _algorithm_reader()
        watched = _WatchedComm(b.comm, read)
        b.comm = watched
        try:
            mc.all_sum(np.ones(want // 4, np.float32), group=g)
            mc.all_sum(np.ones(want // 4 - 1, np.float32), group=g)
        finally:
            b.comm = watched._comm
        # the data: ring from the threshold; below it on 4+ ranks a fixed choice (the library's
        # own would depend on in place); the call key is a persistent request made before
        below = algorithms.algorithm_for(n, want - 4, want)
        if (n >= 4) != (below != 0):
            raise AssertionError(f"rank {r}: {n} ranks, {want - 4} bytes run under algorithm {below}")
        if watched.seen != [1, below] or read() != 0:
            raise AssertionError(f"rank {r}: algorithm per start {watched.seen}, after {read()}; want [1, {below}], 0")
    edges = (algorithms.ring_threshold(n, "auto") or 4096, 65536)
    for dt in (np.float32, np.float64, np.int32, np.float16, np.complex64):
        item = np.dtype(dt).itemsize
        for count in sorted({e // item + d for e in edges for d in (-1, 5)}):
            base = np.arange(count) % 11  # small integers: every order of summation is exact
            xs = [(base + 3 * q).astype(dt) for q in range(n)]
            for name, f in (("sum", np.add), ("max", np.maximum), ("min", np.minimum)):
                if dt == np.complex64 and name != "sum":
                    continue
                want_x = _fold(f, xs)
                got = getattr(mc, f"all_{name}")(xs[r], group=g)
                _check_equal(got, want_x, f"all_{name} {np.dtype(dt).name}[{count}]", r)
                y = xs[r].copy()
                out = y if r % 2 == 0 else None  # in place on even ranks only
                got = getattr(mc, f"all_{name}")(y, group=g, out=out)
                _check_equal(got, want_x, f"all_{name} {np.dtype(dt).name}[{count}], in place on even ranks", r)


def rank_failure_after_a_collective(g: Any) -> None:
    """A collective that completed raises for a peer's failure only when that peer failed
    inside it; a failure after it (the peer's program raised once the collective returned
    there) is left for the next operation, whose wait raises at once."""
    from meshcomm_mpi.ops import Desc

    b = g.transport
    ctl = b.control
    peer = 1 - g.rank() if g.rank() < 2 else 0
    done = Desc(b, ("coll", "barrier"))
    inside = {"cid": done.cid, "kind": "coll", "seq": done.seq, "phase": "raised KeyError"}
    cases = [
        (None, False),  # raised in its own code, outside any operation
        (inside, True),
        ({**inside, "seq": done.seq - 1}, False),  # an earlier collective
        ({**inside, "kind": "send"}, False),  # a send after this collective (same count)
        ({**inside, "cid": "world/1:0"}, False),  # another communicator
    ]
    for state, want in cases:
        got = ctl._failed_inside(done, peer, {"state": state})
        if got != want:
            raise AssertionError(f"rank {g.rank()}: failure with state {state} judged inside={got}, want {want}")


def rank_user_algorithm_kept(g: Any) -> None:
    """With the algorithm chosen by the user (an MCA variable), meshcomm never switches it."""
    import meshcomm as mc
    from meshcomm_mpi import algorithms

    if algorithms._variable is not None or g.transport._iallreduce.ring_from is not None:
        raise AssertionError(f"rank {g.rank()}: the ring switch is on although the user chose an algorithm")
    read = _algorithm_reader()
    x = np.ones(1 << 18, np.float32)
    _check_equal(mc.all_sum(x, group=g), x * g.size(), "all_sum under the user's algorithm", g.rank())
    if read() != 2:
        raise AssertionError(f"rank {g.rank()}: the user's algorithm 2 became {read()}")


def rank_small_sums_in_c_and_in_python(g: Any) -> None:
    """A small all-reduce's first call runs as an Iallreduce and makes its persistent
    operation; every later one is a start of it: in C from the core's compiled call path
    (``sum_now``, the backend's Python all_reduce not called) where the extension is built,
    in the backend's Python all_reduce otherwise. Where the extension is built, an all_sum of
    at most the carried sum's bytes is a start of the call check's own operation from its
    first call, and makes no plan. All give NumPy's sum for every dtype and size up to
    PLANNED_MAX and count each call once; a persistent all_sum starts through the C entry
    too; calls above PLANNED_MAX, and calls with no plan yet, are not the C entry's (it
    returns False, having done nothing); past PLANS_MAX shapes, Iallreduce again."""
    import importlib.util

    import meshcomm as mc
    from meshcomm_mpi.backend import PLANNED_MAX, PLANS_MAX

    g = g.split(0)  # a communicator of its own: no plans made by earlier checks (PLANS_MAX)
    b, r, n = g.transport, g.rank(), g.size()
    built = importlib.util.find_spec("meshcomm_mpi._planned") is not None
    if built != (b.sum_now is not None):
        raise AssertionError(f"rank {r}: extension built={built} but sum_now={b.sum_now}")
    python_calls = []
    python_all_reduce = b.all_reduce

    def counted(*args: Any) -> None:
        python_calls.append(args[2])
        python_all_reduce(*args)

    b.all_reduce = counted  # the core's calls of the backend's Python all_reduce, counted
    c = b.carried
    if built != (c is not None):
        raise AssertionError(f"rank {r}: extension built={built} but carried sum={c}")
    for dt in (np.float32, np.float64, np.int8, np.int32, np.int64, np.uint16, np.float16, np.complex64):
        size = np.dtype(dt).itemsize
        for count in (1, 5, 64 // size, 64 // size + 1, PLANNED_MAX // size):
            xs = [((np.arange(count) * 7 + q) % 50).astype(dt) for q in range(n)]
            want = _fold(np.add, xs)
            what = f"{dt.__name__}[{count}]"
            carried = c is not None and np.dtype(dt) in c.codes and count * size <= c.data
            _check_equal(mc.all_sum(xs[r], group=g), want, f"the first all_sum {what}", r)
            if (b._plans.get((np.dtype(dt), "sum", count)) is None) != carried:
                raise AssertionError(f"rank {r}: {what} (carried: {carried}) has the plans {list(b._plans)}")
            del python_calls[:]
            before = b.coll_count
            _check_equal(mc.all_sum(xs[r], group=g), want, f"all_sum {what}", r)
            if built and python_calls:
                raise AssertionError(f"rank {r}: a planned all_sum {what} ran the Python all_reduce")
            out = np.empty_like(xs[r])
            python_all_reduce(xs[r], out, "sum")
            _check_equal(out, want, f"the backend's Python all_reduce {what}", r)
            if b.coll_count != before + 2:
                raise AssertionError(f"rank {r}: two calls counted as {b.coll_count - before}")
    x = np.full(3, r + 1.0, np.float32)
    with g.all_reduce_init(x) as start:
        for step in range(3):
            x[...] = r + 1.0 + step
            del python_calls[:]
            _check_equal(start(), np.full(3, n * (n + 1) / 2 + n * step, np.float32), f"persistent start {step}", r)
            if built and step and python_calls:
                raise AssertionError(f"rank {r}: a persistent all_sum's start ran the Python all_reduce")
    b.all_reduce = python_all_reduce
    if b.sum_now is not None:
        big = np.ones(PLANNED_MAX // 4 + 1, np.float32)
        before = b.coll_count
        if b.sum_now(big, np.empty_like(big)) or b.coll_count != before:
            raise AssertionError(f"rank {r}: the C entry took a call above PLANNED_MAX")
        y = np.ones(33, np.float32)  # above the carried sum's bytes
        if b.sum_now(y, np.empty_like(y)) or b.coll_count != before:
            raise AssertionError(f"rank {r}: the C entry took a call it has no plan for")
        strided = np.ones(8, np.float32)[::2]
        if b.sum_now(strided, np.empty(4, np.float32)) or b.coll_count != before:
            raise AssertionError(f"rank {r}: the C entry took a non-contiguous array")
        if c is not None:  # a carried sum needs no plan, and no call key
            y, out = np.full(3, r, np.int16), np.empty(3, np.int16)
            if not b.sum_now(y, out) or b.coll_count != before + 1:
                raise AssertionError(f"rank {r}: the C entry did not take a carried all_sum")
            _check_equal(out, np.full(3, n * (n - 1) // 2, np.int16), "a carried all_sum without a key", r)
    # past PLANS_MAX shapes, further ones run as plain Iallreduce, with the same results
    extra = [k for k in range(17, 19 + PLANS_MAX) if (np.dtype(np.float32), "sum", k) not in b._plans]
    for count in extra:
        _check_equal(
            mc.all_sum(np.full(count, r, np.float32), group=g),
            np.full(count, n * (n - 1) / 2, np.float32),
            f"all_sum float32[{count}]",
            r,
        )
    made = [p for p in b._plans.values() if p is not None]
    if len(made) != PLANS_MAX or b._plans[np.dtype(np.float32), "sum", extra[-1]] is not None:
        raise AssertionError(f"rank {r}: {len(made)} plans made (PLANS_MAX={PLANS_MAX})")


RANK_CHECKS = {
    f.__name__: f
    for f in (
        rank_any_selects_mpi,
        rank_integer_wrap,
        rank_forced_numpy_int_sum,
        rank_half_floats,
        rank_bool_and_complex,
        rank_nan_max_min,
        rank_split_communicators,
        rank_error_translation,
        rank_die_after_barrier,
        rank_other_shape_same_count,
        rank_carried_check_meets_other_calls,
        rank_ring_allreduce,
        rank_failure_after_a_collective,
        rank_user_algorithm_kept,
        rank_small_sums_in_c_and_in_python,
    )
}
SPECIFIC = [
    k
    for k in RANK_CHECKS
    if k
    not in (
        "rank_die_after_barrier",
        "rank_other_shape_same_count",
        "rank_carried_check_meets_other_calls",
        "rank_user_algorithm_kept",
    )
]


def _rank_main(names: list[str]) -> int:
    import traceback

    import meshcomm as mc

    g = mc.init(strict=True, backend="mpi")
    for name in names:
        t0 = time.perf_counter()
        try:
            RANK_CHECKS[name](g)
        except Exception:
            print(f"RANKCHECK FAILED {name} rank {g.rank()}:\n{traceback.format_exc()}", flush=True)
            # peers may be waiting in a collective this rank left: end the whole job now
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        print(f"RANKCHECK ok {name} rank {g.rank()} ({time.perf_counter() - t0:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))


# -- pytest side ------------------------------------------------------------------------------
import pytest  # noqa: E402
from jobs import JOB_SECRET, without_launch_vars  # noqa: E402

pytest.importorskip("mpi4py")
from meshcomm_mpi.environment import launch_reason, unavailable_reason  # noqa: E402

if unavailable_reason() is not None:  # pragma: no cover - depends on the machine
    pytest.skip(f"mpi backend unavailable: {unavailable_reason()}", allow_module_level=True)

from meshcomm_mpi.discover import find_library  # noqa: E402
from meshcomm_mpi.launcher import job_command, mpiexec_command  # noqa: E402


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without MPI launcher or meshcomm variables."""
    # MESHCOMM_JOB_SECRET: as meshcomm launch gives every job (object payloads need it)
    return without_launch_vars(PYTHONUNBUFFERED="1", MESHCOMM_JOB_SECRET=JOB_SECRET, **extra)


def _mpirun(n: int, argv: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = mpiexec_command(n, argv)
    return subprocess.run(
        cmd, env=_clean_env(**env), capture_output=True, text=True, timeout=timeout, cwd=HERE.parent.parent
    )


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_contract(n: int) -> None:
    """The whole API contract, every check on every rank, on a real MPI job (on 3 ranks on
    the pure-Python call path and the backend's pure-Python steps, as where no compiler
    built the extensions; else the compiled ones)."""
    path = "pure-Python" if n == 3 else "compiled"
    res = _mpirun(
        n,
        [sys.executable, "-m", "meshcomm.testing.contract", "--backend", "mpi", "--more"],
        timeout=150,
        MESHCOMM_COMPILED="0" if n == 3 else "1",
        MESHCOMM_MPI_COMPILED="0" if n == 3 else "1",
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"contract failed on {n} ranks:\n{out[-6000:]}"
    for r in range(n):
        assert f"rank {r}/{n} on mpi: " in out, out[-3000:]
    assert out.count(f" passed, 0 failed ({path} call path)") == n, out[-3000:]


def test_contract_with_debug_checks() -> None:
    """MLX_DEBUG=1 adds the core's cross-rank checks, which themselves run over MPI."""
    res = _mpirun(
        3, [sys.executable, "-m", "meshcomm.testing.contract", "--backend", "mpi", "--more"], timeout=150, MLX_DEBUG="1"
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0 and out.count(": 20 passed, 0 failed") == 3, out[-6000:]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_mpi_specific(n: int) -> None:
    """Wrap-around, half floats, bool/complex, NaN, split, error translation, `any` selection."""
    res = _mpirun(n, [sys.executable, str(HERE), *SPECIFIC], timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"MPI checks failed on {n} ranks:\n{out[-6000:]}"
    for name in SPECIFIC:
        for r in range(n):
            assert f"RANKCHECK ok {name} rank {r} " in out, f"{name} did not pass on rank {r}:\n{out[-4000:]}"


def test_ring_threshold_and_setting() -> None:
    """MESHCOMM_MPI_RING_FROM: auto gives 64 KiB on 2 ranks and 64 KiB per rank on more; off and
    a single rank never switch; a byte count is taken as given; nonsense is a ConfigError."""
    from meshcomm.plugin import ConfigError, load_settings

    mpi_before = "mpi4py.MPI" in sys.modules
    from meshcomm_mpi.algorithms import algorithm_for, ring_threshold
    from meshcomm_mpi.settings import MPISettings

    # importing it must not start MPI in this process (a singleton MPI leaves /dev/shm files)
    assert mpi_before or "mpi4py.MPI" not in sys.modules

    assert [ring_threshold(n, "auto") for n in (1, 2, 3, 4, 64)] == [None, 65536, 3 * 65536, 4 * 65536, 64 * 65536]
    assert ring_threshold(2, "off") is None and ring_threshold(8, 1000) == 1000
    # below the ring, 4+ ranks run one fixed algorithm (libnbc's own choice would depend on in
    # place): binomial (2) below 256 KiB, Rabenseifner's (3) from there; fewer ranks: libnbc's (0)
    kib = 1024
    assert [algorithm_for(4, b, 256 * kib) for b in (64 * kib - 1, 64 * kib, 256 * kib - 1, 256 * kib)] == [0, 2, 2, 1]
    assert [algorithm_for(8, b, 512 * kib) for b in (128 * kib, 256 * kib, 512 * kib)] == [2, 3, 1]
    assert [algorithm_for(3, b, 192 * kib) for b in (64 * kib, 192 * kib)] == [0, 1]
    assert load_settings(MPISettings, environ={"MESHCOMM_MPI_RING_FROM": "65536"}).ring_from == 65536
    for bad in ("-1", "ring", "1.5"):
        with pytest.raises(ConfigError, match="MESHCOMM_MPI_RING_FROM"):
            load_settings(MPISettings, environ={"MESHCOMM_MPI_RING_FROM": bad})


@pytest.mark.skipif(find_library().flavor != "openmpi", reason="an Open MPI variable")
def test_users_algorithm_choice_is_kept() -> None:
    """An algorithm the user set with Open MPI's own variable stays in force on every call."""
    res = _mpirun(
        2,
        [sys.executable, str(HERE), "rank_user_algorithm_kept"],
        timeout=60,
        OMPI_MCA_coll_libnbc_iallreduce_algorithm="2",
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0 and out.count("RANKCHECK ok rank_user_algorithm_kept") == 2, out[-3000:]


def test_mismatch_is_caught_beside_the_collective() -> None:
    """A persistent all-reduce met by a plain one, two shapes of one element count in one
    MPI all-reduce, and a small all_sum carried in the call check met by other calls: every
    rank raises
    CollectiveMismatchError naming both calls instead of returning sums of unrelated elements;
    the job then ends with exit status 1 (the communicator holds collectives MPI cannot cancel)."""
    checks = ["rank_carried_check_meets_other_calls", "rank_other_shape_same_count"]
    res = _mpirun(3, [sys.executable, str(HERE), *checks], timeout=120)
    out = res.stdout + res.stderr
    for r in range(3):
        for check in checks:
            assert f"RANKCHECK ok {check} rank {r} " in out, out[-4000:]
    assert res.returncode == 1, f"exit status {res.returncode}; want 1\n{out[-3000:]}"


def test_meshcomm_launch_uses_mpiexec() -> None:
    """`meshcomm launch --backend mpi` runs the job through this MPI's mpiexec, output tagged by rank."""
    code = "import meshcomm as mc; g = mc.init(strict=True); print('GROUP', g.backend, g.rank(), g.size())"
    # `-c CODE` (not `python -c CODE`): the launcher runs it with its rank runner, which keeps
    # lines whole and prefixed on every MPI flavour (MPICH's Hydra prefixes each write)
    res = subprocess.run(
        [sys.executable, "-m", "meshcomm", "launch", "-n", "2", "--backend", "mpi", "--", "-c", code],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE.parent.parent,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    lines = [x for x in res.stdout.splitlines() if "GROUP" in x]
    assert sorted(x.split("GROUP", 1)[1].strip() for x in lines) == ["mpi 0 2", "mpi 1 2"], out[-3000:]
    assert all(x.split("GROUP")[0].strip() for x in lines), f"output lines are not tagged with the rank: {lines}"


def test_dead_rank_ends_the_job() -> None:
    """Killing one rank ends the whole job within a bounded time (mpiexec kills the others)."""
    t0 = time.monotonic()
    try:
        res = _mpirun(3, [sys.executable, str(HERE), "rank_die_after_barrier"], timeout=90)
    except subprocess.TimeoutExpired as exc:  # pragma: no cover - the failure this test exists for
        raise AssertionError(f"job still running 90 s after a rank died:\n{exc.stdout}") from None
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert "RANKCHECK alive rank 2" in out, out[-3000:]
    assert res.returncode != 0, f"mpiexec exited 0 although a rank was killed:\n{out[-3000:]}"
    assert "RANKCHECK survived" not in out, out[-3000:]
    assert took < 60, f"the job took {took:.1f} s to end after a rank died"


def test_any_does_not_pick_mpi_without_launcher() -> None:
    """Outside mpiexec, `any` must not start a size-1 MPI world (nor even initialise MPI)."""
    code = (
        "import sys, meshcomm as mc\n"
        "g = mc.init()\n"
        "info = {b.name: b for b in mc.backends()}['mpi']\n"
        "print('RESULT', g.backend, g.size(), 'mpi4py.MPI' in sys.modules, info.available, info.configured)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT"))
    _, backend, size, mpi_loaded, available, configured = line.split()
    assert backend != "mpi" and size == "1", line
    assert mpi_loaded == "False", "init()/backends() initialised MPI in a process not started by mpiexec"
    assert available == "True" and configured == "False", line


def test_world_size_mismatch_is_an_error(tmp_path: Path) -> None:
    """A launcher that announces 2 ranks while MPI sees 1 (wrong mpiexec) raises, never runs alone."""
    code = (
        "import meshcomm as mc\n"
        "try:\n"
        "    mc.init(backend='mpi')\n"
        "except mc.BackendUnavailableError as exc:\n"
        "    print('RAISED', exc)\n"
    )
    # PMI_*: MPICH's variables, which Open MPI ignores; TMPDIR: where Open MPI's singleton makes
    # its session directory, which it leaves when init fails
    env = _clean_env(PMI_RANK="0", PMI_SIZE="2", TMPDIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    lib_is_mpich = (
        "mpich"
        in subprocess.run(
            [sys.executable, "-m", "meshcomm_mpi.launcher", "--which"],
            capture_output=True,
            text=True,
            env=_clean_env(),
            timeout=60,
        )
        .stdout.split("flavor:")[1]
        .split()[0]
    )
    if lib_is_mpich:  # pragma: no cover - MPICH would try to contact a PMI server instead
        pytest.skip("mpi4py loads MPICH; its singleton reads PMI_* itself")
    assert "RAISED" in res.stdout and "for 2 ranks" in res.stdout and "world of 1" in res.stdout, (
        res.stdout + res.stderr
    )


def test_unloadable_library_is_reported() -> None:
    """`available` says why when the MPI library cannot load (and the plugin still imports)."""
    code = (
        "import meshcomm as mc\n"
        "info = {b.name: b for b in mc.backends()}['mpi']\n"
        "print('RESULT', info.available, info.reason)\n"
    )
    env = _clean_env(MPI4PY_LIBMPI="/nonexistent/libmpi.so")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT"))
    assert line.startswith("RESULT False") and "cannot load" in line and "/nonexistent/libmpi.so" in line, line


def test_plugin_imports_fast_without_mpi() -> None:
    """plugin.py loads neither mpi4py nor MPI; importing it adds little to the core's import."""
    code = (
        "import sys, time\n"
        "import meshcomm.runtime.config, meshcomm.protocol.backend, meshcomm.runtime.hookspecs\n"  # the core's own cost
        "t = time.perf_counter()\n"
        "import meshcomm_mpi.plugin\n"
        "print('RESULT', time.perf_counter() - t, 'mpi4py' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=60)
    _, took, mpi4py_loaded = next(x for x in res.stdout.splitlines() if x.startswith("RESULT")).split()
    assert mpi4py_loaded == "False"
    assert float(took) < 0.25, f"import meshcomm_mpi.plugin took {took} s on top of the core"


def test_environment_detection() -> None:
    """The `environment` callback: None under Open MPI, PMIx or Hydra variables, else a reason."""
    assert launch_reason(environ={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}) is None
    assert launch_reason(environ={"PMIX_RANK": "1"}) is None
    assert launch_reason(environ={"PMI_RANK": "0", "PMI_SIZE": "4"}) is None
    reason = launch_reason(environ={"PATH": "/usr/bin"})
    assert reason is not None and "mpiexec" in reason and "OMPI_COMM_WORLD_SIZE" in reason


def test_mpiexec_command_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Open MPI: root flag, --oversubscribe beyond the cores, -x K=V; MPICH: -genv K V, -hosts."""
    import meshcomm_mpi.launcher as L

    cmd = mpiexec_command(64, ["prog", "a"], {"MLX_BACKEND": "mpi"})
    exe = Path(cmd[0])
    assert exe.is_file() and os.access(exe, os.X_OK), cmd
    assert cmd[1:3] == ["-n", "64"] and cmd[-2:] == ["prog", "a"]
    flavor = L.resolve_mpiexec()[1]
    if flavor == "openmpi":
        assert "--oversubscribe" in cmd and ["-x", "MLX_BACKEND=mpi"] == cmd[cmd.index("-x") : cmd.index("-x") + 2]
        assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
        assert "--oversubscribe" not in mpiexec_command(1, ["prog"])
    monkeypatch.setattr(L, "resolve_mpiexec", lambda settings=None: (Path("/opt/mpich/bin/mpiexec"), "mpich"))
    cmd = mpiexec_command(2, ["prog"], {"A": "1"}, hosts=[("h1", 1), ("h2", 1)])
    assert cmd == ["/opt/mpich/bin/mpiexec", "-n", "2", "-hosts", "h1:1,h2:1", "-genv", "A", "1", "prog"]
    with pytest.raises(ValueError, match="n=0"):
        mpiexec_command(0, ["prog"])


def test_job_command_places_ranks_on_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """external_command: a JobSpec's places become --host a:k,b:m (local jobs get no --host)."""
    from types import SimpleNamespace

    import meshcomm_mpi.launcher as L
    from meshcomm.runtime.launchspec import RankPlace
    from meshcomm_mpi.plugin import MPILauncher

    monkeypatch.setattr(L, "resolve_mpiexec", lambda settings=None: (Path("/x/mpiexec"), "openmpi"))
    places = [RankPlace(0, "a", "10.0.0.1", 0), RankPlace(1, "a", "10.0.0.1", 1), RankPlace(2, "b", "10.0.0.2", 0)]
    job = SimpleNamespace(nranks=3, places=places, job_id="j", secret="s", verbose=False)
    cmd = MPILauncher().external_command(job, ["prog"], {"MLX_BACKEND": "mpi"})  # type: ignore[arg-type]
    assert cmd[cmd.index("--host") + 1] == "a:2,b:1", cmd
    assert cmd[-1] == "prog" and "MLX_BACKEND=mpi" in cmd
    local = SimpleNamespace(nranks=2, places=[RankPlace(i, None, "127.0.0.1", i) for i in range(2)])
    assert "--host" not in job_command(local, ["prog"], {})


def test_control_notices_carry_plain_data_only(tmp_path: Path) -> None:
    """The control channel's notices load as plain data; a pickle that would call code (what
    someone writing into MPI's unauthenticated TCP traffic could send) is refused, not run."""
    import pickle

    from meshcomm_mpi.notices import NoticeError, decode, encode

    plain = {"qid": 3, "state": {"world": (4, {1: 2}, {}, "all_sum #4")}, "counts": (1, 2, 3), "x": [1.5, None, b"b"]}
    assert decode(encode(plain)) == plain
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    with pytest.raises(NoticeError, match="plain data only"):
        decode(pickle.dumps({"qid": 1, "state": Evil()}))
    assert not marker.exists()
