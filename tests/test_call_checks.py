"""The default call check (no MLX_DEBUG): on a transport that cannot compare calls in-band,
ranks that disagree on op, shape, dtype or root get the same CollectiveMismatchError, never
wrong data; ``MESHCOMM_CHECK_CALLS=0`` turns it off."""

from __future__ import annotations

import meshcomm as mc
import numpy as np
import pytest
from meshcomm.testing.threaded import run_threaded


def _outcomes(n, body, **kw):
    def wrapped(g):
        try:
            return ("ok", body(g))
        except mc.CollectiveMismatchError as exc:
            return ("mismatch", str(exc))

    return run_threaded(n, wrapped, timeout=10, **kw)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize(
    "case,body,words",
    [
        ("shape", lambda g: mc.all_sum(np.ones(4 + (g.rank() == 1), np.float32), group=g), ["(4,)", "(5,)"]),
        (
            "dtype",
            lambda g: mc.all_sum(np.ones(4, np.float64 if g.rank() == 1 else np.float32), group=g),
            ["float32", "float64"],
        ),
        ("op", lambda g: (mc.all_max if g.rank() == 1 else mc.all_sum)(np.ones(4), group=g), ["all_max", "all_sum"]),
        ("root", lambda g: mc.broadcast(np.full(4, g.rank()), root=int(g.rank() == 1), group=g), ["root=0", "root=1"]),
        (
            "gather vs scatter",
            lambda g: (mc.sum_scatter if g.rank() == 1 else mc.all_gather)(np.ones(g.size() * 2), group=g),
            ["sum_scatter", "all_gather"],
        ),
        (
            "barrier vs all_sum",
            lambda g: g.barrier() if g.rank() == 1 else mc.all_sum(np.ones(2), group=g),
            ["barrier #1", "all_sum #1 (shape=(2,)"],
        ),
        ("empty vs full", lambda g: mc.all_sum(np.ones(0 if g.rank() == 1 else 3), group=g), ["(0,)", "(3,)"]),
    ],
)
def test_mismatched_calls_raise_the_same_error_on_every_rank(n, case, body, words):
    results = _outcomes(n, body)
    kinds = [k for k, _ in results]
    assert kinds == ["mismatch"] * n, f"{case}: {results}"
    messages = {m for _, m in results}
    assert len(messages) == 1, "every rank must raise the same error"
    msg = messages.pop()
    assert "MLX_DEBUG" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_matching_calls_pass_and_barrier_still_synchronises():
    def body(g):
        total = mc.all_sum(np.arange(4.0) + g.rank(), group=g)
        g.barrier()
        return total, mc.broadcast(np.full(2, g.rank()), root=2, group=g)

    for total, b in run_threaded(3, body):
        np.testing.assert_array_equal(total, np.arange(4.0) * 3 + 3)
        np.testing.assert_array_equal(b, [2, 2])


def test_check_off_means_root_mismatch_goes_unseen():
    # The setting really turns the check off: nothing compares roots any more (documented trade).
    results = _outcomes(2, lambda g: mc.broadcast(np.full(2, g.rank()), root=g.rank(), group=g), check_calls=False)
    assert [k for k, _ in results] == ["ok", "ok"]


def test_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESHCOMM_CHECK_CALLS", "0")
    assert mc.Config().check_calls is False
    monkeypatch.setenv("MESHCOMM_CHECK_CALLS", "sometimes")
    with pytest.raises(mc.ConfigError, match="MESHCOMM_CHECK_CALLS='sometimes'"):
        mc.Config()
