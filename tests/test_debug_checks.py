"""MLX_DEBUG: ranks that disagree on the call get the same clear error, before any payload."""

from __future__ import annotations

import meshcomm as mc
import numpy as np
import pytest
from meshcomm.testing.threaded import run_threaded


def _errors(n, body):
    out = []

    def wrapped(g):
        try:
            body(g)
        except mc.CollectiveMismatchError as exc:
            return str(exc)
        return None

    out = run_threaded(n, wrapped, debug=True, timeout=10)
    return out


def test_different_shapes_raise_on_every_rank():
    msgs = _errors(3, lambda g: mc.all_sum(np.zeros(4 + (g.rank() == 2), np.float32), group=g))
    assert all(m is not None for m in msgs)
    assert len(set(msgs)) == 1, "every rank must raise the same error"
    assert "ranks 0, 1 called all_sum #1 (shape=(4,), dtype=float32)" in msgs[0]
    assert "rank 2 called all_sum #1 (shape=(5,), dtype=float32)" in msgs[0]


def test_different_operations_raise():
    def body(g):
        x = np.ones(3)
        (mc.all_gather if g.rank() == 0 else mc.all_sum)(x, group=g)

    msgs = _errors(2, body)
    assert all(m and "all_gather" in m and "all_sum" in m for m in msgs)


def test_different_dtypes_and_roots_raise():
    msgs = _errors(2, lambda g: mc.all_max(np.ones(2, np.int32 if g.rank() else np.int64), group=g))
    assert all(m and "int32" in m and "int64" in m for m in msgs)
    msgs = _errors(2, lambda g: mc.broadcast(np.ones(2), root=g.rank(), group=g))
    assert all(m and "root=0" in m and "root=1" in m for m in msgs)


def test_send_recv_shape_mismatch_raises_on_both_sides():
    def body(g):
        if g.rank() == 0:
            mc.send(np.ones(3), 1, group=g)
        else:
            mc.recv((4,), np.float64, 0, group=g)

    msgs = _errors(2, body)
    assert msgs[0] and msgs[1]
    assert "send #1 (shape=(3,)" in msgs[1] and "recv #1 (shape=(4,)" in msgs[1]


def test_send_met_by_a_collective_is_detected():
    def body(g):
        if g.rank() == 0:
            mc.send(np.ones(3), 1, group=g)
        else:
            mc.all_sum(np.ones(3), group=g)

    msgs = _errors(2, body)
    assert msgs[1] and "send" in msgs[1] and "all_sum" in msgs[1]


def test_matching_calls_pass_in_debug_mode():
    from meshcomm.testing.contract import run_checks

    assert run_threaded(3, run_checks, debug=True, timeout=120) == [[], [], []]


@pytest.mark.parametrize("value", ["1", "true"])
def test_mlx_debug_turns_it_on(value, monkeypatch):
    monkeypatch.setenv("MLX_DEBUG", value)
    assert mc.Config.load().debug is True
