"""The core's generic collectives, over a point-to-point-only transport, match NumPy on 1-8 ranks."""

from __future__ import annotations

import meshcomm as mc
import numpy as np
import pytest
from meshcomm.protocol import algorithms
from meshcomm.testing.contract import CHECKS, run_checks
from meshcomm.testing.threaded import make_threaded_groups, run_threaded


@pytest.mark.parametrize("n", range(1, 9))
def test_whole_contract_on_generic_algorithms(n: int) -> None:
    failures = run_threaded(n, run_checks, timeout=120)
    assert failures == [[]] * n


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("nbytes", [4, 4 * 1000, algorithms.SMALL_BYTES + 4, 3 * algorithms.SMALL_BYTES + 12])
def test_both_all_reduce_paths_agree_with_numpy(n: int, nbytes: int) -> None:
    size = nbytes // 4
    inputs = [np.random.default_rng(q).standard_normal(size).astype(np.float32) for q in range(n)]
    results = run_threaded(n, lambda g: mc.all_sum(inputs[g.rank()], group=g))
    want = np.sum(np.stack(inputs).astype(np.float64), axis=0)
    for got in results:
        assert got.tobytes() == results[0].tobytes(), "ranks disagree bit-for-bit"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_generic_backend_only_implements_point_to_point() -> None:
    groups = make_threaded_groups(3)
    backend_type = type(groups[0].transport)
    for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "split"):
        assert name not in backend_type.__dict__, f"threaded backend overrides {name}"


def test_split_subgroups_are_independent() -> None:
    def body(g: mc.Group) -> tuple[int, int, list[int]]:
        sub = g.split(g.rank() // 3)
        total = mc.all_sum(np.array([g.rank()]), group=sub)
        return sub.rank(), sub.size(), total.tolist()

    res = run_threaded(7, body)
    assert res == [(0, 3, [3]), (1, 3, [3]), (2, 3, [3]), (0, 3, [12]), (1, 3, [12]), (2, 3, [12]), (0, 1, [6])]


def test_contract_checks_catch_a_wrong_backend() -> None:
    """The conformance checks must fail on a backend that returns wrong sums."""
    from meshcomm.testing.threaded import ThreadedBackend

    class OffByOne(ThreadedBackend):
        def all_reduce(self, sendbuf, recvbuf, op):  # type: ignore[no-untyped-def]
            algorithms.all_reduce(self, sendbuf, recvbuf, op)
            if recvbuf.dtype.kind in "iuf" and recvbuf.size > 3:
                recvbuf[3] += 1

    # groups over the wrong backend, on the fabric of a threaded job
    groups = [mc.Group(OffByOne(g._b._fabric, g.rank()), "threaded") for g in make_threaded_groups(2)]  # type: ignore[attr-defined]
    import threading

    out: list = [None, None]

    def run(r: int) -> None:
        out[r] = run_checks(groups[r], [c for c in CHECKS if c.__name__ == "check_reductions"])

    ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert out[0] and "differs from NumPy" in out[0][0][1]


def test_split_plan_orders_by_key_then_rank_and_indexes_colours() -> None:
    def plan(g: mc.Group) -> algorithms.SplitPlan:
        r = g.rank()
        return algorithms.split_plan(g._b, color=[7, -3, 7, 7][r], key=[5, 0, -1, 5][r])

    plans = run_threaded(4, plan)
    # colour 7: ranks 0 (key 5), 2 (key -1: sorts as its rank, 2) and 3 (key 5): 2 first, then 0, 3
    assert [p.members for p in plans] == [[2, 0, 3], [1], [2, 0, 3], [2, 0, 3]]
    assert [p.rank for p in plans] == [1, 0, 0, 2]
    assert [p.color_index for p in plans] == [1, 0, 1, 1]  # colours sorted: -3, 7


def test_split_with_a_colour_beyond_64_bits_raises_on_every_rank() -> None:
    def split(g: mc.Group) -> str:
        try:
            algorithms.split_plan(g._b, 1 << 70 if g.rank() == 1 else 0, -1)
        except ValueError as exc:
            return str(exc)
        return "no error"

    msgs = run_threaded(3, split, timeout=10)
    assert all("rank 1 passed a colour or key outside the 64-bit range" in m for m in msgs), msgs
