"""The optional PNG of a sweep: median time and bus bandwidth against size, log scales.

matplotlib is an optional extra (``pip install "meshcomm[bench]"``); it is imported only
when a plot is asked for, and its absence is a clear error, not an ImportError trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .runner import Result

__all__ = ["MissingMatplotlib", "pyplot", "plot_results"]


class MissingMatplotlib(RuntimeError):
    """matplotlib is needed for a plot and is not installed."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` with the non-interactive Agg backend, or :class:`MissingMatplotlib`."""
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib(
            "plotting needs matplotlib, which is not installed; install it with "
            'pip install "meshcomm[bench]" (or pip install matplotlib), or drop --plot'
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_results(results: Sequence[Result], path: str | Path, *, title: str = "") -> None:
    """Two panels (time, busbw) with one line per operation; wrong rows are left out."""
    plt = pyplot()
    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for op in dict.fromkeys(r.op for r in results):
        rows = [r for r in results if r.op == op and r.ok and r.stats is not None and r.nbytes > 0]
        if not rows:
            continue
        x = [r.nbytes for r in rows]
        ax_t.plot(x, [r.stats.median * 1e6 for r in rows if r.stats], marker="o", label=op)
        ax_t.fill_between(
            x, [r.stats.p10 * 1e6 for r in rows if r.stats], [r.stats.p90 * 1e6 for r in rows if r.stats], alpha=0.2
        )
        ax_bw.plot(x, [(r.busbw or 0) / 1e9 for r in rows], marker="o", label=op)
    for ax in (ax_t, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_t.set_yscale("log")
    ax_t.set_ylabel("median time (µs), band p10-p90")
    ax_bw.set_ylabel("bus bandwidth (GB/s)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
