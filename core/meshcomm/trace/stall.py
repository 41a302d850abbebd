"""The stall inspector: a rank that has waited too long in one operation says who is missing.

A watchdog thread looks, about ten times per stall period, at the operation this rank is
in (the recorder's ``current``). Once that one operation has lasted ``after`` seconds, it
logs one warning (logger ``meshcomm.stall``; printed on stderr when logging is not
configured) naming the ranks that have not joined it and what each was last seen doing,
read from their progress records (:mod:`meshcomm.trace.progress`). A collective of group
G number S has been *joined* by a rank whose record shows it started collective S (or a
later one) of G; for a send or recv the line shows the peer's record. Without a job
directory (not started by ``meshcomm launch`` or a PMIx ``mpirun``) the line names only
this rank's wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .progress import Progress, read_progress

__all__ = ["StallInspector", "stall_message", "LOGGER"]

#: the logger the inspector's warnings go to
LOGGER = logging.getLogger("meshcomm.stall")

#: (group, group rank, world rank, group size, sequence, op, peer, start wall time) of the operation in progress
Current = tuple[str, int, int, int, int, str, int, float]


def stall_message(current: Current, others: dict[int, Progress] | None, world_size: int, now: float) -> str:
    """The inspector's line for ``current`` given the other ranks' records (None: none available)."""
    group, grank, wrank, gsize, seq, op, peer, t0 = current
    what = f"{op} #{seq} of group {group}" if peer < 0 else f"{op} with rank {peer} of group {group}"
    head = f"meshcomm: stall: rank {wrank} has waited {now - t0:.1f} s in {what} (group rank {grank} of {gsize})"
    if others is None:
        return head + "; no job directory to learn the other ranks' progress from (start the job with meshcomm launch)"
    missing, joined, unknown = [], [], []
    for r in range(world_size):
        if r == wrank:
            continue
        rec = others.get(r)
        if rec is None:
            unknown.append(f"rank {r}")
            continue
        if peer < 0:
            started = rec.started.get(group)
            if started is None and group != "world":
                continue  # never used this group: not a member (or not there yet)
            if started is not None and started >= seq:
                joined.append(str(r))
                continue
        missing.append(f"rank {r} ({rec.doing(now)})")
    parts = [head]
    if missing:
        parts.append(("not joined: " if peer < 0 else "other ranks: ") + "; ".join(missing))
    if joined:
        parts.append("joined: ranks " + ", ".join(joined))
    if unknown:
        parts.append("no progress record (another host, or not started): " + ", ".join(unknown))
    return "; ".join(parts)


class StallInspector:
    """The watchdog thread (a daemon: it never keeps the process alive)."""

    def __init__(
        self, after: float, current: Callable[[], Current | None], progress: Path | None, world_size: int
    ) -> None:
        self.after = after
        self._current = current
        self._progress = progress
        self._size = world_size
        self._reported: tuple[str, int, str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshcomm-stall-inspector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def check(self, now: float) -> str | None:
        """The warning to log now, if the operation in progress has just become a stall."""
        cur = self._current()
        if cur is None or now - cur[7] < self.after:
            return None
        key = (cur[0], cur[4], cur[5], cur[7])
        if key == self._reported:
            return None
        self._reported = key
        others = read_progress(self._progress) if self._progress is not None else None
        return stall_message(cur, others, self._size, now)

    def _watch(self) -> None:
        period = min(1.0, max(0.02, self.after / 10))
        while not self._stop.wait(period):
            try:
                line = self.check(time.time())
            except Exception as exc:  # noqa: BLE001 - an inspector must never break the rank
                line = f"meshcomm: stall inspector failed: {type(exc).__name__}: {exc}"
                self._stop.set()
            if line is not None:
                LOGGER.warning(line)
