"""``meshcomm trace summary FILE --plot PNG``: the timeline and each rank's waiting, as a picture.

Top: one row per rank, one bar per operation (coloured by operation, the waiting part
hatched) against time since the first start. Bottom: each rank's total time in
operations, split into waiting for peers and the rest. matplotlib is optional (the
``bench`` or ``nn`` extra); without it the error says how to install it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_trace"]


def plot_trace(trace: dict[str, Any], path: str | Path, *, title: str = "") -> None:
    """Write the PNG of a merged trace to ``path``."""
    from ..bench.plot import pyplot

    plt = pyplot()
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "op"]
    ranks = sorted({int(e["pid"]) for e in ops})
    names = list(dict.fromkeys(e["args"]["op"] for e in ops))
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, (ax_t, ax_w) = plt.subplots(
        2, 1, figsize=(12, 2.2 + 0.9 * max(len(ranks), 1) * 2), gridspec_kw={"height_ratios": [3, 2]}
    )
    for e in ops:
        y = int(e["pid"])
        start_ms, dur_ms = e["ts"] / 1e3, e["dur"] / 1e3
        wait_ms = min(e["args"]["wait_us"] / 1e3, dur_ms)
        ax_t.broken_barh(
            [(start_ms, max(dur_ms, 1e-4))], (y - 0.35, 0.7), facecolors=colours[e["args"]["op"]], edgecolor="none"
        )
        if wait_ms > 0:
            ax_t.broken_barh(
                [(start_ms, wait_ms)], (y - 0.35, 0.7), facecolors="none", edgecolor="black", hatch="///", linewidth=0
            )
    ax_t.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax_t.invert_yaxis()
    ax_t.set_xlabel("time since the first operation started (ms)")
    ax_t.set_title("timeline (hatched: waiting for peers)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    ax_t.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    waited = {r: sum(min(e["args"]["wait_us"], e["dur"]) for e in ops if e["pid"] == r) / 1e3 for r in ranks}
    spent = {r: sum(e["dur"] for e in ops if e["pid"] == r) / 1e3 for r in ranks}
    ax_w.barh(ranks, [waited[r] for r in ranks], color="tab:red", label="waiting for peers")
    ax_w.barh(
        ranks,
        [spent[r] - waited[r] for r in ranks],
        left=[waited[r] for r in ranks],
        color="tab:gray",
        label="rest of the operations",
    )
    ax_w.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax_w.invert_yaxis()
    ax_w.set_xlabel("time in operations (ms)")
    ax_w.set_title("per-rank time in operations")
    ax_w.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
