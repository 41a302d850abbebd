"""``meshcomm trace summary``: a table per operation and size, and the stragglers of slow operations.

From a merged trace, the records of one operation on its ranks (same group and sequence)
form an *instance*. Per operation and size bucket (bytes this rank passed, rounded up to
a power of two) the table shows:

* ``count``: instances; ``total ms`` and ``median us``: of the instances' time, from the
  first rank's start to the last rank's end;
* ``busbw GB/s``: bytes x nccl-tests' bus factor / the median *transfer* time, from the
  last rank's start to the last rank's end (time after everyone arrived; for all_gather
  and gather the bytes are the whole output);
* ``wait %``: the ranks' summed waits over their summed durations.

A *slow* instance takes more than twice its bucket's median; its *straggler* is the rank
that started it last, and ``late`` is by how much after the first.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..protocol.operations import bus_factor

__all__ = ["Instance", "Row", "instances", "table", "slow", "format_summary", "bucket"]


def bucket(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (0 stays 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


@dataclass
class Instance:
    """One operation across its ranks (from the merged trace's events)."""

    op: str
    group: str
    seq: int
    nbytes: int
    ranks: dict[int, tuple[float, float, float]]  #: world rank -> (start, end, wait), seconds
    size: int  #: group size

    @property
    def first(self) -> float:
        return min(s for s, _, _ in self.ranks.values())

    @property
    def last_start(self) -> float:
        return max(s for s, _, _ in self.ranks.values())

    @property
    def last_end(self) -> float:
        return max(e for _, e, _ in self.ranks.values())

    @property
    def time(self) -> float:
        return self.last_end - self.first

    @property
    def transfer(self) -> float:
        return max(0.0, self.last_end - self.last_start)

    @property
    def straggler(self) -> int:
        return max(self.ranks, key=lambda r: (self.ranks[r][0], r))


def instances(trace: dict[str, Any]) -> list[Instance]:
    """The instances of a merged trace, in order of their first start (a send and its
    recv are one ``send/recv`` instance of their two ranks)."""
    sizes = trace.get("otherData", {}).get("meshcomm", {}).get("groups", {})
    found: dict[tuple[Any, ...], Instance] = {}
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X" or ev.get("cat") != "op":
            continue
        a = ev["args"]
        if a["peer"] < 0:
            key: tuple[Any, ...] = (a["group"], a["seq"])
            op, size = a["op"], int(sizes.get(a["group"], 0))
        else:
            pair = (a["group_rank"], a["peer"]) if a["op"] == "send" else (a["peer"], a["group_rank"])
            key, op, size = (a["group"], pair, a["seq"]), "send/recv", 2
        inst = found.get(key)
        if inst is None:
            inst = found[key] = Instance(op, a["group"], a["seq"], int(a["bytes"]), {}, size)
        t0 = ev["ts"] / 1e6
        inst.ranks[int(ev["pid"])] = (t0, t0 + ev["dur"] / 1e6, a["wait_us"] / 1e6)
        inst.nbytes = max(inst.nbytes, int(a["bytes"]))
    out = list(found.values())
    for inst in out:
        if inst.size <= 0:
            inst.size = len(inst.ranks)
    out.sort(key=lambda i: i.first)
    return out


@dataclass
class Row:
    """One line of the table."""

    op: str
    bucket: int
    count: int
    total: float
    median: float
    busbw: float | None
    wait_share: float


def table(insts: Iterable[Instance]) -> list[Row]:
    """One row per operation and size bucket, operations in order of first appearance."""
    groups: dict[tuple[str, int], list[Instance]] = {}
    for inst in insts:
        groups.setdefault((inst.op, bucket(inst.nbytes)), []).append(inst)
    rows = []
    for (op, b), items in groups.items():
        try:
            factor = bus_factor(op, items[0].size)
        except ValueError:  # an operation this version does not know (a newer version's trace)
            factor = 0.0
        moved = statistics.median(i.nbytes * (i.size if op in ("all_gather", "gather") else 1) for i in items)
        transfer = statistics.median(i.transfer for i in items)
        busbw = moved * factor / transfer / 1e9 if factor and transfer > 0 else None
        waited = sum(w for i in items for _, _, w in i.ranks.values())
        spent = sum(e - s for i in items for s, e, _ in i.ranks.values())
        rows.append(
            Row(
                op,
                b,
                len(items),
                sum(i.time for i in items),
                statistics.median(i.time for i in items),
                busbw,
                waited / spent if spent > 0 else 0.0,
            )
        )
    return rows


def slow(insts: list[Instance], limit: int = 10) -> list[Instance]:
    """Instances more than twice their bucket's median time, slowest first (at most ``limit``)."""
    medians: dict[tuple[str, int], float] = {}
    by: dict[tuple[str, int], list[float]] = {}
    for i in insts:
        by.setdefault((i.op, bucket(i.nbytes)), []).append(i.time)
    for k, v in by.items():
        medians[k] = statistics.median(v)
    out = [i for i in insts if len(i.ranks) > 1 and i.time > 2 * medians[(i.op, bucket(i.nbytes))]]
    out.sort(key=lambda i: i.time, reverse=True)
    return out[:limit]


def format_summary(trace: dict[str, Any], limit: int = 10) -> str:
    """The text ``meshcomm trace summary`` prints."""
    insts = instances(trace)
    meta = trace.get("otherData", {}).get("meshcomm", {})
    ranks = meta.get("ranks", {})
    dropped = sum(int(r.get("dropped") or 0) for r in ranks.values())
    lines = [
        f"{len(insts)} operations on {len(ranks) or '?'} ranks"
        + (f"; {dropped} events dropped by full rings (MESHCOMM_TRACE_EVENTS)" if dropped else "")
    ]
    lines.append(
        f"{'operation':<18} {'size':>9} {'count':>7} {'total ms':>10} {'median us':>10} "
        f"{'busbw GB/s':>10} {'wait %':>7}"
    )
    for r in table(insts):
        bw = f"{r.busbw:10.4g}" if r.busbw is not None else f"{'-':>10}"
        lines.append(
            f"{r.op:<18} {'<= ' + _size(r.bucket) if r.bucket else '0 B':>9} {r.count:>7} "
            f"{r.total * 1e3:10.3f} {r.median * 1e6:10.1f} {bw} {r.wait_share * 100:7.1f}"
        )
    worst = slow(insts, limit)
    if worst:
        lines.append("")
        lines.append("slow operations (more than twice their size's median): straggler = the rank that started last")
        lines.append(f"{'operation':<18} {'group':<12} {'seq':>6} {'time us':>10} {'straggler':>9} {'late us':>10}")
        for i in worst:
            lines.append(
                f"{i.op:<18} {i.group:<12} {i.seq:>6} {i.time * 1e6:10.1f} {'rank ' + str(i.straggler):>9} "
                f"{(i.last_start - i.first) * 1e6:10.1f}"
            )
    return "\n".join(lines)
