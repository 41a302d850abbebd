"""Merge the ranks' files into one trace in the Chrome/Perfetto trace-event JSON format.

The merged file (``DIR/trace.json``) opens in https://ui.perfetto.dev or chrome://tracing:
one process per rank (``rank R (host)``), named and sorted by rank, with one track of
*complete* events (``"ph": "X"``), one per operation, and inside each a ``waiting`` slice
for the time the rank spent waiting for its peers. ``ts``/``dur`` are microseconds from the
earliest recorded start; ``otherData.meshcomm`` keeps that origin (Unix seconds) and each
rank's host, pid and dropped-event count.

*Waiting for peers*, the same definition on every backend: the core cannot see inside a
transport, so the wait of a rank in one operation is the time from its own start to the
latest start among all the ranks of that operation (capped at its own duration). The
ranks of an operation are the records with the same group and sequence number (for send
and recv: the same pair of ranks and pair sequence). The last rank to arrive waits 0; an
operation some rank did not record (its ring dropped it, or it died) gets the wait the
recorded ranks imply.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime.private_files import write_atomic
from .recorder import RANK_FILE_FORMAT

__all__ = ["Op", "load_rank_files", "operations", "chrome_trace", "merge_dir", "MERGED_NAME", "load_trace"]

#: the merged file's name in the trace directory
MERGED_NAME = "trace.json"


@dataclass
class Op:
    """One rank's record of one operation, with its wait once the ranks are paired."""

    rank: int  #: world rank
    group: str
    group_rank: int
    group_size: int
    seq: int
    op: str
    peer: int  #: group rank of the peer of a send/recv, -1 for collectives
    nbytes: int
    dtype: str
    start: float  #: Unix seconds
    end: float
    ok: bool
    wait: float = 0.0

    @property
    def key(self) -> tuple[Any, ...]:
        """What the ranks of one operation share: group and sequence (and the pair, for send/recv)."""
        if self.peer < 0:
            return (self.group, self.seq)
        src, dst = (self.group_rank, self.peer) if self.op == "send" else (self.peer, self.group_rank)
        return (self.group, "p2p", src, dst, self.seq)

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)


def load_rank_files(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank file in ``folder`` (``rank-R.json``), by rank; unreadable ones are skipped with a note."""
    out = []
    for path in sorted(Path(folder).glob("rank-*.json"), key=lambda p: p.name):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            import sys

            sys.stderr.write(f"meshcomm trace: skipping {path}: {exc}\n")
            continue
        if data.get("format") == RANK_FILE_FORMAT:
            out.append(data)
    out.sort(key=lambda d: int(d["rank"]))
    return out


def operations(ranks: Iterable[dict[str, Any]]) -> list[Op]:
    """Every rank's operations with their waits (see the module docstring), ordered by start."""
    ops: list[Op] = []
    for data in ranks:
        groups = data.get("groups", {})
        for group, seq, op, peer, nbytes, dtype, start, end, ok in data["events"]:
            g = groups.get(group, {})
            ops.append(
                Op(
                    int(data["rank"]),
                    group,
                    int(g.get("rank", -1)),
                    int(g.get("size", 0)),
                    int(seq),
                    op,
                    int(peer),
                    int(nbytes),
                    dtype,
                    float(start),
                    float(end),
                    bool(ok),
                )
            )
    latest: dict[tuple[Any, ...], float] = {}
    for o in ops:
        k = o.key
        latest[k] = max(latest.get(k, o.start), o.start)
    for o in ops:
        o.wait = min(max(0.0, latest[o.key] - o.start), o.duration)
    ops.sort(key=lambda o: (o.start, o.rank))
    return ops


def chrome_trace(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The trace-event JSON object of the ranks' files."""
    ops = operations(ranks)
    origin = min((o.start for o in ops), default=min((float(d.get("started", 0.0)) for d in ranks), default=0.0))

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    for d in ranks:
        r = int(d["rank"])
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": r,
                "tid": 0,
                "args": {"name": f"rank {r} ({d.get('host', '?')})"},
            }
        )
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "operations"}})
    for o in ops:
        name = o.op if o.peer < 0 else f"{o.op} {'to' if o.op == 'send' else 'from'} {o.peer}"
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": "op",
                "pid": o.rank,
                "tid": 0,
                "ts": us(o.start),
                "dur": round(o.duration * 1e6, 3),
                "args": {
                    "op": o.op,
                    "group": o.group,
                    "seq": o.seq,
                    "group_rank": o.group_rank,
                    "peer": o.peer,
                    "bytes": o.nbytes,
                    "dtype": o.dtype,
                    "wait_us": round(o.wait * 1e6, 3),
                    "ok": o.ok,
                },
            }
        )
        if o.wait > 0:
            events.append(
                {
                    "ph": "X",
                    "name": "waiting",
                    "cat": "wait",
                    "pid": o.rank,
                    "tid": 0,
                    "ts": us(o.start),
                    "dur": round(o.wait * 1e6, 3),
                    "args": {"group": o.group, "seq": o.seq},
                }
            )
    meta = {
        "origin": origin,
        "ranks": {
            str(d["rank"]): {
                "host": d.get("host"),
                "pid": d.get("pid"),
                "backend": d.get("backend"),
                "dropped": d.get("dropped", 0),
                "reason": d.get("reason"),
            }
            for d in ranks
        },
        "size": max((int(d.get("size", 0)) for d in ranks), default=0),
        "groups": {name: int(g.get("size", 0)) for d in ranks for name, g in d.get("groups", {}).items()},
        "wait": "time from the rank's start to the latest start among the ranks of the same operation",
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"meshcomm": meta}}


def merge_dir(folder: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> tuple[Path, list[int]]:
    """Merge ``folder``'s rank files into ``out`` (default ``folder/trace.json``).

    Returns the merged file and the ranks that left no file (ranks 0..size-1 expected);
    a ValueError when there is no rank file at all.
    """
    ranks = load_rank_files(folder)
    if not ranks:
        raise ValueError(f"no rank files (rank-R.json) in {folder}: was the job run with MESHCOMM_TRACE={folder}?")
    size = max(int(d.get("size", 0)) for d in ranks)
    missing = sorted(set(range(size)) - {int(d["rank"]) for d in ranks})
    path = Path(out) if out is not None else Path(folder) / MERGED_NAME
    write_atomic(path.parent, path.name, json.dumps(chrome_trace(ranks), separators=(",", ":")).encode())
    return path, missing


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A merged trace (``trace.json``), or the merge of a directory of rank files."""
    p = Path(path)
    if p.is_dir():
        return chrome_trace(load_rank_files(p))
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the trace {p}: {exc}") from None
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise ValueError(
            f"{p} is not a merged meshcomm trace (no traceEvents); merge rank files with 'meshcomm trace merge DIR'"
        )
    return data
