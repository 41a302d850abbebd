"""Human and machine output of a sweep: progress lines, the table, the JSON document.

Times are shown in microseconds and bandwidths in GB/s (10^9 bytes per second, as
nccl-tests prints them); the JSON keeps seconds and bytes per second. Each operation's
table ends like an nccl-tests run: ``# Out of bounds values : N OK`` (here: sizes whose
result was wrong) and ``# Avg bus bandwidth    : X GB/s``, the mean of the checked sizes'
bus bandwidths (:func:`avg_busbw`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .runner import Result
from .sizes import format_size

__all__ = ["progress_line", "format_table", "avg_busbw", "environment", "to_json", "write_json"]


def _gbs(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e9:.3f}"


def progress_line(r: Result) -> str:
    """One line per measured size for stderr."""
    if not r.ok or r.stats is None:
        return f"{r.op:<11} {format_size(r.nbytes):>9}  WRONG RESULT: {r.error}"
    return (
        f"{r.op:<11} {format_size(r.nbytes):>9}  median {r.stats.median * 1e6:10.1f} us  "
        f"busbw {_gbs(r.busbw):>7} GB/s  ({r.stats.iters} iters)"
    )


def avg_busbw(results: Iterable[Result]) -> float | None:
    """Mean bus bandwidth (bytes/s) over the rows that have one, as nccl-tests' summary line
    averages every size it ran; None when no row has one (barrier, or every size wrong)."""
    values = [r.busbw for r in results if r.ok and r.busbw is not None]
    return sum(values) / len(values) if values else None


def format_table(results: Sequence[Result], *, title: str = "") -> str:
    """A fixed-width table per operation; wrong rows say WRONG and carry no figures."""
    out: list[str] = []
    ops = list(dict.fromkeys(r.op for r in results))
    head = (
        f"{'size':>10} {'count':>10} {'type':>8} {'time(us)':>11} {'p10(us)':>11} {'p90(us)':>11} "
        f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'iters':>6}  check"
    )
    for op in ops:
        rows = [r for r in results if r.op == op]
        first = rows[0]
        out.append(
            f"# {op}: {first.ranks} ranks, backend {first.backend}, {first.dtype}" + (f", {title}" if title else "")
        )
        out.append("#" + head[1:])
        for r in rows:
            if r.ok and r.stats is not None:
                s = r.stats
                out.append(
                    f"{format_size(r.nbytes):>10} {r.count:>10} {r.dtype:>8} {s.median * 1e6:>11.1f} "
                    f"{s.p10 * 1e6:>11.1f} {s.p90 * 1e6:>11.1f} {_gbs(r.algbw):>11} "
                    f"{_gbs(r.busbw):>11} {s.iters:>6}  ok"
                )
            else:
                out.append(
                    f"{format_size(r.nbytes):>10} {r.count:>10} {r.dtype:>8} {'-':>11} {'-':>11} "
                    f"{'-':>11} {'-':>11} {'-':>11} {'-':>6}  WRONG (ranks {r.wrong_ranks})"
                )
        wrong = sum(1 for r in rows if not r.ok)
        out.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        avg = avg_busbw(rows)
        if avg is not None:
            out.append(f"# Avg bus bandwidth    : {_gbs(avg)} GB/s")
        out.append("")
    return "\n".join(out)


def environment() -> dict[str, Any]:
    """Where the numbers come from: host, cores, load, versions, time."""
    import numpy

    from .. import __version__

    try:
        load = list(os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        load = None
    return {
        "meshcomm": __version__,
        "numpy": numpy.__version__,
        "python": sys.version.split()[0],
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "loadavg": load,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def to_json(results: Iterable[Result], **meta: Any) -> dict[str, Any]:
    """The JSON document: ``meta`` and the environment, ``ok`` and every row."""
    rows = list(results)
    return {**environment(), **meta, "ok": all(r.ok for r in rows), "results": [r.as_dict() for r in rows]}


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` (parent folders must exist)."""
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
