"""Sweep operations and sizes over a meshcomm group, checking every result.

Every size of every operation is timed with :func:`.measure.time_op` and the first and
last results are compared with what the operation must return (:mod:`.collectives`).
The ranks then agree, with an ``all_gather`` of one flag each, on whether any rank got
a wrong answer; a wrong size is kept as a :class:`Result` with ``ok=False`` and **no
figures**, so no time or bandwidth ever comes from a wrong run. :func:`require_ok`
turns such results into a :class:`ResultCheckError`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api import ops as _ops
from ..api.group import Group
from .collectives import OPS
from .measure import Stats, time_op
from .sizes import format_size

__all__ = ["Result", "ResultCheckError", "GroupSync", "run_sweep", "require_ok"]

# bound at import: the bench's own bookkeeping must not go through a substituted op
_all_max = _ops.all_max
_all_gather = _ops.all_gather


class ResultCheckError(RuntimeError):
    """An operation returned a wrong result during the benchmark; its figures are void."""


@dataclass(frozen=True)
class GroupSync:
    """:class:`.measure.Sync` over a meshcomm group."""

    group: Group

    def barrier(self) -> None:
        """The group's barrier."""
        self.group.barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        """``all_max`` of ``values`` over the group."""
        return _all_max(np.ascontiguousarray(values, dtype=np.float64), group=self.group)


@dataclass(frozen=True)
class Result:
    """One row: an operation at one size. Figures are None when ``ok`` is False."""

    op: str
    nbytes: int
    count: int
    dtype: str
    ranks: int
    backend: str
    stats: Stats | None
    algbw: float | None  #: bytes per second, size / median time
    busbw: float | None  #: algbw times the operation's bus factor
    ok: bool
    error: str | None = None
    wrong_ranks: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (times in seconds, bandwidths in bytes per second)."""
        return {
            "op": self.op,
            "bytes": self.nbytes,
            "count": self.count,
            "dtype": self.dtype,
            "ranks": self.ranks,
            "backend": self.backend,
            "ok": self.ok,
            "error": self.error,
            "wrong_ranks": self.wrong_ranks,
            "algbw": self.algbw,
            "busbw": self.busbw,
            "time": self.stats.as_dict() if self.stats else None,
        }


def _agree_on_errors(group: Group, error: str | None) -> list[int]:
    """The ranks (in every rank's view) whose local check failed."""
    flags = _all_gather(np.array([1 if error else 0], dtype=np.int8), group=group)
    return [int(r) for r in np.flatnonzero(flags)]


def _sizes_for(op: str, sizes: Iterable[int]) -> list[int]:
    return list(sizes) if OPS[op].sized else [0]


def run_sweep(
    group: Group,
    ops: Iterable[str],
    sizes: Iterable[int],
    dtype: Any = np.float32,
    *,
    iters: int | None = None,
    warmup: int = 3,
    min_time: float = 0.3,
    progress: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Time every operation in ``ops`` at every size; every rank of ``group`` must call it.

    Raises ValueError before any communication for an unknown operation or one that needs
    more ranks than the group has. Returns the rows in order; ``progress`` sees each row.
    """
    dt = np.dtype(dtype)
    op_list = list(ops)
    size_list = list(sizes)
    for name in op_list:
        if name not in OPS:
            raise ValueError(f"unknown operation {name!r}; known: {', '.join(OPS)}")
        if group.size() < OPS[name].min_ranks:
            raise ValueError(f"{name} needs at least {OPS[name].min_ranks} ranks, the group has {group.size()}")
    sync = GroupSync(group)
    n = group.size()
    results: list[Result] = []
    for name in op_list:
        coll = OPS[name]
        done: set[int] = set()
        for requested in _sizes_for(name, size_list):
            case = coll.make(group, requested, dt)
            if case.nbytes in done:  # rounding made two requested sizes the same buffer
                continue
            done.add(case.nbytes)
            timing = time_op(case.call, sync, iters=iters, warmup=warmup, min_time=min_time)
            error = case.check(timing.first) or case.check(timing.last)
            wrong = _agree_on_errors(group, error)
            if error:
                sys.stderr.write(
                    f"meshcomm bench: rank {group.rank()}: {name} at "
                    f"{format_size(case.nbytes)} returned a wrong result: {error}\n"
                )
            if wrong:
                detail = error or "see the stderr of those ranks"
                row = Result(
                    name,
                    case.nbytes,
                    case.count,
                    dt.name,
                    n,
                    group.backend,
                    None,
                    None,
                    None,
                    False,
                    f"wrong result on rank(s) {wrong}: {detail}",
                    wrong,
                )
            else:
                med = timing.stats.median
                algbw = case.nbytes / med if coll.sized and med > 0 else None
                busbw = algbw * coll.bus_factor(n) if algbw is not None else None
                row = Result(name, case.nbytes, case.count, dt.name, n, group.backend, timing.stats, algbw, busbw, True)
            results.append(row)
            if progress is not None:
                progress(row)
            del case, timing
    return results


def require_ok(results: Iterable[Result]) -> None:
    """Raise :class:`ResultCheckError` naming every row whose result was wrong."""
    bad = [r for r in results if not r.ok]
    if bad:
        lines = "; ".join(f"{r.op} at {format_size(r.nbytes)}: {r.error}" for r in bad)
        raise ResultCheckError(f"{len(bad)} measurement(s) returned wrong results, figures discarded: {lines}")
