"""Time one call pattern across ranks the way nccl-tests does, for meshcomm or any library.

Every timed iteration starts with a barrier, so all ranks enter the call together, and
is timed on each rank with ``time.perf_counter``. After the loop, the per-iteration
times are reduced with a maximum over ranks: an iteration lasts until its slowest rank
is done, which is what the application sees. The statistics (median, p10/p90, min/max)
are taken over those per-iteration maxima.

The number of iterations adapts to the message size unless given: the warm-up calls
estimate the time of one call, the ranks agree on the largest estimate, and enough
iterations run to fill ``min_time`` seconds, between ``min_iters`` and ``max_iters``.
Only :class:`Sync` (a barrier and an element-wise max over ranks) ties this module to
a library, so ``bench/compare.py`` measures raw mpi4py, torch and MLX with the same code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["Sync", "Stats", "Timing", "plan_iters", "time_op"]


class Sync(Protocol):
    """What the timer needs from a communication library besides the call it times."""

    def barrier(self) -> None:
        """Return once every rank has entered."""
        ...

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        """Element-wise maximum of a float64 array over all ranks (every rank gets it)."""
        ...


@dataclass(frozen=True)
class Stats:
    """Seconds per call over the timed iterations (each the slowest rank's time)."""

    iters: int
    median: float
    p10: float
    p90: float
    min: float
    max: float
    mean: float

    @classmethod
    def from_times(cls, times: np.ndarray) -> Stats:
        """Summarize per-iteration times (seconds); at least one is needed."""
        t = np.asarray(times, dtype=np.float64)
        if t.size == 0:
            raise ValueError("no timed iterations")
        p10, med, p90 = np.percentile(t, [10, 50, 90])
        return cls(int(t.size), float(med), float(p10), float(p90), float(t.min()), float(t.max()), float(t.mean()))

    def as_dict(self) -> dict[str, float]:
        """The fields as a plain dict (for JSON)."""
        return asdict(self)


@dataclass(frozen=True)
class Timing:
    """What :func:`time_op` measured, with the first and the last result for checking."""

    stats: Stats
    first: Any
    last: Any


def plan_iters(estimate: float, *, min_time: float, min_iters: int, max_iters: int) -> int:
    """Iterations that fill ``min_time`` seconds at ``estimate`` seconds per call, clamped."""
    if estimate <= 0 or not math.isfinite(estimate):
        return max_iters
    return int(min(max_iters, max(min_iters, math.ceil(min_time / estimate))))


def time_op(
    op: Callable[[], Any],
    sync: Sync,
    *,
    iters: int | None = None,
    warmup: int = 3,
    min_time: float = 0.3,
    min_iters: int = 5,
    max_iters: int = 1000,
) -> Timing:
    """Warm up, then time ``op`` in barrier-aligned iterations; every rank must call this.

    Args:
        op: the call to time (one collective); its return value is kept for checking.
        sync: barrier and max-over-ranks of the library under test.
        iters: timed iterations; None adapts them to the call's duration (see module doc).
        warmup: untimed calls first (at least one is made when ``iters`` is None, to estimate).
        min_time, min_iters, max_iters: the adaptive plan.
    """
    if iters is not None and iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    n_warm = max(warmup, 1 if iters is None else 0)
    first: Any = None
    warm: list[float] = []
    for i in range(n_warm):
        sync.barrier()
        t0 = time.perf_counter()
        out = op()
        warm.append(time.perf_counter() - t0)
        if i == 0:
            first = out
    if iters is None:
        # the first call pays for connections and page faults; estimate from the fastest of
        # the rest (one stall in a short warm-up must not cut the timed iterations short)
        sample = warm[1:] or warm
        estimate = float(sync.max_over_ranks(np.array([min(sample)]))[0])
        iters = plan_iters(estimate, min_time=min_time, min_iters=min_iters, max_iters=max_iters)
    times = np.empty(iters, dtype=np.float64)
    last: Any = None
    for i in range(iters):
        sync.barrier()
        t0 = time.perf_counter()
        last = op()
        times[i] = time.perf_counter() - t0
    if n_warm == 0:
        first = last
    slowest = sync.max_over_ranks(times)
    return Timing(Stats.from_times(slowest), first, last)
