"""What every contract check builds on: each rank's input, NumPy's expected result, and
assertions that name the rank and what differed.

Both rounds of checks (:mod:`meshcomm.testing.contract_first` and
:mod:`meshcomm.testing.contract_more`) use these, so they live below both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing

import meshcomm as mc
from meshcomm.protocol.dtypes import SUPPORTED, UFUNCS

__all__ = ["SHAPES", "LARGE", "rank_input"]

SHAPES: list[tuple[int, ...]] = [(), (1,), (7,), (3, 5), (1031, 3)]
LARGE = (1 << 18) + 13  # elements: past every chunk size, not a multiple of anything


def rank_input(rank: int, shape: tuple[int, ...], dtype: np.typing.DTypeLike, salt: int = 0) -> np.ndarray:
    """Deterministic input of ``rank``: small integers, so float sums are exact.

    Element ``i`` is ``v(i) = (i * (rank + 3) + 7 * rank + salt) % 17 - 8``, made into the
    dtype's kind below. ``v`` repeats every 17 elements (and the signed kind's factor every 31),
    so one period is computed and tiled: each rank builds every rank's input, and the large
    shapes made this a third of a contract run's time.
    """
    n = int(np.prod(shape, dtype=np.int64))
    dt = np.dtype(dtype)
    period = 17 * 31 if dt.kind == "i" else 17
    i = np.arange(min(n, period), dtype=np.int64)
    v = (i * (rank + 3) + 7 * rank + salt) % 17 - 8
    if dt == np.bool_:
        one = (v % 3) == 0
    elif dt.kind == "u":
        # not periodic: the index itself makes large values, so that sums wrap
        i = np.arange(n, dtype=np.int64)
        return (_tiled(v + 8, n) + i * 37 * (rank + 1)).astype(dt).reshape(shape)
    elif dt.kind == "i":
        one = (v * (1 + i % 31) * 4).astype(dt)
    elif dt.kind == "c":
        one = (v + 1j * ((v * 5 + rank) % 7 - 3)).astype(dt)
    else:
        one = v.astype(dt)
    return _tiled(one, n).reshape(shape)


def _tiled(period: np.ndarray, n: int) -> np.ndarray:
    """``period`` repeated to ``n`` elements, written in one broadcast copy."""
    out = np.empty(n, period.dtype)
    if n == 0:
        return out
    whole = n - n % len(period)
    out[:whole].reshape(-1, len(period))[:] = period
    out[whole:] = period[: n - whole]
    return out


def _expect(op: str, inputs: list[np.ndarray]) -> np.ndarray:
    """NumPy's result of reducing ``inputs`` with ``op``, in their dtype (wrapping as the backends do)."""
    f = UFUNCS[op]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        acc = f(acc, x).astype(acc.dtype)
    return acc


def _same(got: np.ndarray, want: np.ndarray, what: str, rank: int) -> None:
    """``got`` is an ndarray of ``want``'s dtype, shape and values (NaN equal to NaN)."""
    assert isinstance(got, np.ndarray), f"rank {rank}: {what} returned {type(got).__name__}, not ndarray"
    assert got.dtype == want.dtype, f"rank {rank}: {what} dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"rank {rank}: {what} shape {got.shape}, expected {want.shape}"
    if not np.array_equal(got, want, equal_nan=want.dtype.kind in "fc"):
        bad = np.argwhere(got != want)[:3].tolist() if got.ndim else "scalar"
        raise AssertionError(
            f"rank {rank}: {what} differs from NumPy at {bad}: got {got.ravel()[:6]}, expected {want.ravel()[:6]}"
        )


def _identical_everywhere(g: mc.Group, x: np.ndarray, what: str) -> None:
    """Every rank holds the same bytes of ``x`` (a replicated result must stay replicated)."""
    raw = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    allb = mc.all_gather(raw, group=g).reshape(g.size(), -1)
    assert (allb == allb[0]).all(), f"rank {g.rank()}: {what} is not bit-identical on every rank"


def _dtypes() -> Iterator[np.dtype]:
    """Every dtype meshcomm supports, the ones each check runs over."""
    yield from SUPPORTED


def _raises(exc: type[BaseException], fn: Callable[[], object], what: str) -> None:
    """``fn()`` raises ``exc``; AssertionError naming ``what`` if it raises nothing or something else."""
    try:
        fn()
    except exc:
        return
    except Exception as other:
        raise AssertionError(f"{what}: raised {type(other).__name__}: {other}, expected {exc.__name__}") from None
    raise AssertionError(f"{what}: no {exc.__name__} raised")
