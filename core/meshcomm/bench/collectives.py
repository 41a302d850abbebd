"""What each benchmarked operation sends, what it must return, and its bus-bandwidth factor.

Sizes follow nccl-tests: ``size`` is the whole buffer of the operation — the input of
``all_sum``/``sum_scatter``/``broadcast``/``sendrecv``/``reduce``/``all_to_all``/``scatter``
(root's) and the *output* of ``all_gather``/``gather`` (each rank contributes ``size / n``).
Element counts are rounded down so they split evenly over the ranks (at least one element
per rank), so the bytes actually moved can differ slightly from the size asked for; results
report the actual size.

Inputs are small integers (``i % 7 + rank``) so every sum is exact in every dtype and the
expected result can be compared bit for bit; a buffer whose elements are all equal would
hide reordering bugs, so the pattern varies along the array.

Bus bandwidth (nccl-tests' ``busbw``) rescales algorithm bandwidth ``size / time`` to
what each link must carry, so results are comparable across rank counts:
``all_sum`` 2(n-1)/n, ``all_gather``, ``sum_scatter``, ``all_to_all``, ``gather`` and
``scatter`` (n-1)/n, ``broadcast``, ``reduce`` and ``sendrecv`` 1. The rooted operations
use root 0; a non-root's ``gather``/``reduce`` must return None. ``sendrecv`` sends
``size`` bytes to rank r+1 while receiving from rank r-1; meshcomm's ``send`` blocks until
the transport has the data, so even ranks send first and odd ranks receive first (no
deadlock, but on two ranks the two directions run one after the other).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..api.group import Group
from ..protocol import operations

__all__ = ["Collective", "Case", "OPS", "bus_factor", "rank_input", "describe_mismatch"]


def rank_input(count: int, dtype: np.dtype, rank: int) -> np.ndarray:
    """The buffer rank ``rank`` sends: ``i % 7 + rank`` in ``dtype`` (exact sums, varying values)."""
    return (np.arange(count, dtype=np.int64) % 7 + rank).astype(dtype)


def describe_mismatch(got: Any, expected: np.ndarray) -> str | None:
    """None when ``got`` equals ``expected`` bit for bit in shape, dtype and values; else why not."""
    if not isinstance(got, np.ndarray):
        return f"got a {type(got).__name__}, expected a NumPy array"
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype}, expected {expected.dtype}"
    if got.shape != expected.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    g = np.ascontiguousarray(got).reshape(-1)
    e = np.ascontiguousarray(expected).reshape(-1)
    differs = (g.view(np.uint8).reshape(g.size, -1) != e.view(np.uint8).reshape(e.size, -1)).any(axis=1)
    wrong = np.flatnonzero(differs)
    if wrong.size == 0:
        return None
    i = int(wrong[0])
    return f"{wrong.size} of {e.size} elements differ; first at index {i}: got {g[i]!r}, expected {e[i]!r}"


@dataclass(frozen=True)
class Case:
    """One operation at one size on one rank: the call to time and how to check its result."""

    nbytes: int  #: the operation's whole buffer, as nccl-tests counts it (see module doc)
    count: int  #: elements of that buffer
    call: Callable[[], Any]
    expected: np.ndarray | None  #: what this rank must get back (None: nothing to check)
    none_off_root: bool = False  #: with ``expected`` None: the result must be None (gather, reduce)

    def check(self, result: Any) -> str | None:
        """None if ``result`` is right, else a description of what is wrong."""
        if self.expected is None:
            if self.none_off_root and result is not None:
                return f"got a {type(result).__name__} on a non-root rank, expected None"
            return None
        return describe_mismatch(result, self.expected)


def _meshcomm_op(name: str) -> Callable[..., Any]:
    """``meshcomm.<name>`` as it is when the case is made (so tests can substitute a broken one
    before a sweep), called directly: the timed call costs what the user's call costs, as
    the peers' timed calls do."""
    import meshcomm

    op: Callable[..., Any] = getattr(meshcomm, name)
    return op


def _summed(g: Group, nbytes: int, dtype: np.dtype) -> tuple[int, np.ndarray, np.ndarray]:
    """(elements, this rank's input, the sum of every rank's input) for the reductions."""
    count = max(1, nbytes // dtype.itemsize)
    total = functools.reduce(np.add, (rank_input(count, dtype, k) for k in range(g.size())))
    return count, rank_input(count, dtype, g.rank()), np.asarray(total, dtype=dtype)


def _all_sum(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    count, x, expected = _summed(g, nbytes, dtype)
    op = _meshcomm_op("all_sum")
    return Case(count * dtype.itemsize, count, lambda: op(x, group=g), expected)


def _all_gather(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    n, r = g.size(), g.rank()
    per = max(1, nbytes // dtype.itemsize // n)
    x = rank_input(per, dtype, r)
    expected = np.concatenate([rank_input(per, dtype, k) for k in range(n)])
    op = _meshcomm_op("all_gather")
    return Case(per * n * dtype.itemsize, per * n, lambda: op(x, group=g), expected)


def _sum_scatter(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    n, r = g.size(), g.rank()
    per = max(1, nbytes // dtype.itemsize // n)
    x = rank_input(per * n, dtype, r)
    total = functools.reduce(np.add, (rank_input(per * n, dtype, k) for k in range(n)))
    expected = np.asarray(total, dtype=dtype)[r * per : (r + 1) * per].copy()
    op = _meshcomm_op("sum_scatter")
    return Case(per * n * dtype.itemsize, per * n, lambda: op(x, group=g), expected)


def _broadcast(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    count = max(1, nbytes // dtype.itemsize)
    x = rank_input(count, dtype, g.rank())  # non-root contents differ, so a wrong copy shows
    op = _meshcomm_op("broadcast")
    return Case(count * dtype.itemsize, count, lambda: op(x, 0, group=g), rank_input(count, dtype, 0))


def _sendrecv(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    n, r = g.size(), g.rank()
    count = max(1, nbytes // dtype.itemsize)
    x = rank_input(count, dtype, r)
    dst, src = (r + 1) % n, (r - 1) % n
    send, recv_like = _meshcomm_op("send"), _meshcomm_op("recv_like")

    def call() -> Any:
        if r % 2 == 0:
            send(x, dst, group=g)
            return recv_like(x, src, group=g)
        got = recv_like(x, src, group=g)
        send(x, dst, group=g)
        return got

    return Case(count * dtype.itemsize, count, call, rank_input(count, dtype, src))


def _all_to_all(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    n, r = g.size(), g.rank()
    per = max(1, nbytes // dtype.itemsize // n)
    x = rank_input(per * n, dtype, r)
    expected = np.concatenate([rank_input(per * n, dtype, k)[r * per : (r + 1) * per] for k in range(n)])
    op = _meshcomm_op("all_to_all")
    return Case(per * n * dtype.itemsize, per * n, lambda: op(x, group=g), expected)


def _gather(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    n, r = g.size(), g.rank()
    per = max(1, nbytes // dtype.itemsize // n)
    x = rank_input(per, dtype, r)
    expected = np.concatenate([rank_input(per, dtype, k) for k in range(n)]) if r == 0 else None
    op = _meshcomm_op("gather")
    return Case(per * n * dtype.itemsize, per * n, lambda: op(x, 0, group=g), expected, none_off_root=True)


def _scatter(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    n, r = g.size(), g.rank()
    per = max(1, nbytes // dtype.itemsize // n)
    x = rank_input(per * n, dtype, r)  # non-root contents differ, so a block not from root shows
    expected = rank_input(per * n, dtype, 0)[r * per : (r + 1) * per].copy()
    op = _meshcomm_op("scatter")
    return Case(per * n * dtype.itemsize, per * n, lambda: op(x, 0, group=g), expected)


def _reduce(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    count, x, total = _summed(g, nbytes, dtype)
    op = _meshcomm_op("reduce")
    expected = total if g.rank() == 0 else None
    return Case(count * dtype.itemsize, count, lambda: op(x, 0, group=g), expected, none_off_root=True)


def _barrier(g: Group, nbytes: int, dtype: np.dtype) -> Case:
    return Case(0, 0, g.barrier, None)


@dataclass(frozen=True)
class Collective:
    """A benchmarked operation: how to build a :class:`Case` and how to scale bus bandwidth."""

    name: str
    make: Callable[[Group, int, np.dtype], Case]
    sized: bool = True  #: False for barrier (one row, no bandwidth)
    min_ranks: int = 1

    def bus_factor(self, n: int) -> float:
        """busbw / algbw for ``n`` ranks (nccl-tests convention)."""
        return bus_factor(self.name, n)


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw of ``op`` on ``n`` ranks (:func:`meshcomm.protocol.operations.bus_factor`, the
    nccl-tests convention), for the operations ``meshcomm bench`` times."""
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}; known: {', '.join(OPS)}")
    return operations.bus_factor(op, n)


#: every operation ``meshcomm bench --op`` knows, in display order
OPS: dict[str, Collective] = {
    c.name: c
    for c in (
        Collective("all_sum", _all_sum),
        Collective("all_gather", _all_gather),
        Collective("sum_scatter", _sum_scatter),
        Collective("broadcast", _broadcast),
        Collective("all_to_all", _all_to_all),
        Collective("gather", _gather),
        Collective("scatter", _scatter),
        Collective("reduce", _reduce),
        Collective("sendrecv", _sendrecv, min_ranks=2),
        Collective("barrier", _barrier, sized=False),
    )
}
