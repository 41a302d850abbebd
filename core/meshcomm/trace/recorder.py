"""The per-rank recorder: every operation's name, group, sequence, bytes, dtype, start and end.

The groups run each operation through the observer slot (:mod:`meshcomm.api.observer`)
when it is set, handing over what the operation's method already holds: the
:data:`Payload` this rank passes and the peer (send, recv) or color (split).
:meth:`Recorder.call` notes the start, runs the operation, notes the end; the compiled call
path keeps the same record itself for a blocking all-reduce (:meth:`Recorder.lane_record`)
unless events are traced. :func:`start` sets it up from the
world's settings:

* ``MESHCOMM_TRACE=DIR``: events go into a bounded ring (``MESHCOMM_TRACE_EVENTS``; the
  oldest are dropped and counted) written to ``DIR/rank-<R>.json`` at exit, and when the
  rank's program fails (:func:`start` hands :func:`meshcomm.runtime.exits.end_rank` the dump to run
  before it aborts the worlds);
* ``MESHCOMM_STALL_AFTER`` > 0: the stall inspector (:mod:`meshcomm.trace.stall`) and,
  under ``meshcomm launch`` or a PMIx ``mpirun``, this rank's progress record
  (:mod:`meshcomm.trace.progress`).

Sequence numbers let the merge pair one operation's records across ranks: the n-th
collective of a group on every member is number n (every member calls the group's
collectives in the same order), and the n-th send from group rank a to b pairs with b's
n-th recv from a. A group split from another is named ``<parent>/<seq>.<color>``: the
same on every member. Times are wall-clock (``time.time``) so that ranks can be compared;
ranks on different hosts are only as comparable as the hosts' clocks.
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..api import observer
from ..api.observer import Payload
from ..runtime import exits
from ..runtime.private_files import private_dir, write_atomic
from .progress import ProgressWriter, job_progress_dir
from .stall import Current, StallInspector

if TYPE_CHECKING:
    from ..api.group import Group
    from ..runtime.config import Config

__all__ = ["Recorder", "Payload", "active", "start", "attach", "dump", "stop", "RANK_FILE_FORMAT", "rank_file"]

T = TypeVar("T")

_now = time.time  # looked up once: this runs around every operation

#: the ``format`` field of a rank file
RANK_FILE_FORMAT = "meshcomm-trace-rank/1"
#: the recorder in the observer slot, or None (tracing and inspector off)
active: Recorder | None = None
_lock = threading.Lock()

#: one event: group, sequence, op, peer (-1: a collective), bytes, dtype, start, end, ok
Event = tuple[str, int, str, int, int, Any, float, float, bool]


def rank_file(folder: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes its events to."""
    return Path(folder) / f"rank-{rank}.json"


class _GroupState:
    __slots__ = ("name", "rank", "size")

    def __init__(self, name: str, rank: int, size: int) -> None:
        self.name = name
        self.rank = rank
        self.size = size


def _bytes_and_dtype(payload: Payload) -> tuple[int, Any]:
    """Bytes and dtype (a NumPy dtype, "object", or "") of what this rank passes to an
    operation, as :meth:`meshcomm.Group._submit` describes it."""
    if payload is None:
        return 0, ""
    if isinstance(payload, np.ndarray):
        return int(payload.nbytes), payload.dtype
    if isinstance(payload, bytes):
        return len(payload), "object"
    shape, dtype = payload
    return math.prod(shape) * dtype.itemsize, dtype


@functools.cache
def _dtype_name(dt: Any) -> str:
    return dt if isinstance(dt, str) else np.dtype(dt).name


class Recorder:
    """What one rank records (see the module docstring)."""

    def __init__(self, world: Group, *, folder: Path | None, capacity: int, progress: ProgressWriter | None) -> None:
        self.world_rank = world.rank()
        self.world_size = world.size()
        self.backend = world.backend
        self.folder = folder
        self.ring: collections.deque[Event] | None = collections.deque(maxlen=capacity) if folder else None
        self.recorded = 0
        self.progress = progress
        #: the operation the Python path is in (see :attr:`current`)
        self._current: Current | None = None
        #: what the compiled call path's operation in progress is (made when it first asks)
        self._running: Any = None
        self.inspector: StallInspector | None = None
        self.started = time.time()
        self.reason = ""  #: why the file was last written: "exit" or "failure"
        #: id(group) -> (weak reference to it, its state); the reference tells a reused id apart
        self._groups: dict[int, tuple[weakref.ref[Group], _GroupState]] = {}
        self._names: dict[str, _GroupState] = {}
        #: the entry of the group of the last operation (most calls go to the same group)
        self._last = self._add(world, "world")

    def _add(self, group: Group, name: str) -> tuple[weakref.ref[Group], _GroupState]:
        st = self._names[name] = _GroupState(name, group.rank(), group.size())
        entry = self._groups[id(group)] = (weakref.ref(group), st)
        return entry

    def _entry(self, group: Group) -> tuple[weakref.ref[Group], _GroupState]:
        entry = self._groups.get(id(group))
        if entry is not None and entry[0]() is group:
            return entry
        # a group this recorder did not see being made (another world)
        return self._add(group, f"{group.backend}:{group._label}")

    def call(
        self, group: Group, op: str, run: Callable[[], T], payload: Payload = None, arg: int = -1, seq: int = 0
    ) -> T:
        """Run ``run()`` (operation ``op`` on ``group``) and record it; ``payload`` is what this
        rank passes, ``arg`` the peer of ``send``/``recv`` or the color of ``split``, ``seq``
        the call's number (the group counts them)."""
        entry = self._last
        if entry[0]() is not group:
            entry = self._last = self._entry(group)
        st = entry[1]
        peer = arg if op == "send" or op == "recv" else -1
        t0 = _now()
        self._current = (st.name, st.rank, self.world_rank, st.size, seq, op, peer, t0)
        progress = self.progress
        if progress is not None:
            progress.begin(op, st.name, seq, peer, t0)
        ok = False
        try:
            result = run()
            ok = True
        finally:
            t1 = _now()
            self._current = None
            if progress is not None:
                progress.end(ok, t1)
            if self.ring is not None:
                nbytes, dtype = _bytes_and_dtype(payload)
                self.ring.append((st.name, seq, op, peer, nbytes, dtype, t0, t1, ok))
                self.recorded += 1
        if op == "split":
            self._add(result, f"{st.name}/{seq}.{arg}")  # type: ignore[arg-type]
        return result

    @property
    def current(self) -> Current | None:
        """The operation this rank is in: (group, rank, world rank, size, seq, op, peer, start
        time), or None between operations (the stall inspector reads it)."""
        cur = self._current
        if cur is None and self._running is not None:
            return self._running.current()
        return cur

    def lane_record(
        self, group: Group, op: str
    ) -> tuple[tuple[str, int, int, int], Any, bytes, bytes, int, Any] | None:
        """What a compiled call path keeps around ``op`` on ``group`` instead of calling
        :meth:`call` (see :mod:`meshcomm.api.observer`): the first four fields of
        :attr:`current`, the progress record's :meth:`~ProgressWriter.lane_fields` (None,
        b"", b"", 0 without one), and the slot the call path writes the operation in progress
        into (``meshcomm.api._callpath.Running``: the sequence, ``op``, the start time), which
        :attr:`current` reads. None while tracing: the events go into the ring from here."""
        if self.ring is not None:
            return None
        if self._running is None:
            from ..api import _callpath  # only a compiled call path asks

            self._running = _callpath.Running()
        st = self._entry(group)[1]
        prefix = (st.name, st.rank, self.world_rank, st.size)
        fields = (None, b"", b"", 0) if self.progress is None else self.progress.lane_fields(op, st.name)
        return (prefix, *fields, self._running)

    def snapshot(self, reason: str) -> dict[str, Any]:
        """This rank's file content: who it is, its groups, and the events in the ring."""
        events = self.ring.copy() if self.ring is not None else ()  # one C call: safe beside appends
        return {
            "format": RANK_FILE_FORMAT,
            "rank": self.world_rank,
            "size": self.world_size,
            "backend": self.backend,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self.started,
            "written": time.time(),
            "reason": reason,
            "dropped": self.recorded - len(events),
            "groups": {st.name: {"rank": st.rank, "size": st.size} for st in self._names.values()},
            "fields": ["group", "seq", "op", "peer", "bytes", "dtype", "start", "end", "ok"],
            "events": [[*e[:5], _dtype_name(e[5]), *e[6:]] for e in events],
        }

    def dump(self, reason: str) -> Path | None:
        """Write this rank's file (written aside and renamed); its path, or None when not tracing."""
        if self.folder is None:
            return None
        if self.reason == "failure":  # the exit that follows a failure is still a failure
            reason = "failure"
        self.reason = reason
        folder = private_dir(self.folder, "MESHCOMM_TRACE")
        # json.dumps: the C encoder (json.dump encodes in Python)
        data = json.dumps(self.snapshot(reason), separators=(",", ":")).encode()
        return write_atomic(folder, rank_file(folder, self.world_rank).name, data)


def start(config: Config, world: Group) -> Recorder | None:
    """Set up tracing and the stall inspector for ``world`` as ``config`` asks (once per process)."""
    stall = float(config.stall_after)
    if config.trace is None and stall <= 0:
        return None
    with _lock:
        if active is not None:
            return active
        folder = job_progress_dir(os.environ) if stall > 0 else None
        writer = None
        if folder is not None:
            try:
                writer = ProgressWriter(folder, world.rank())
            except OSError as exc:
                import sys

                sys.stderr.write(
                    f"meshcomm: rank {world.rank()}: no progress record for the stall inspector in {folder}: {exc}\n"
                )
                folder = None
        # refused at start, not at exit: a directory another user made or can write into
        trace = private_dir(config.trace, "MESHCOMM_TRACE") if config.trace is not None else None
        rec = Recorder(world, folder=trace, capacity=config.trace_events, progress=writer)
        if stall > 0:
            # before MLX_TIMEOUT fires, whatever the setting says
            after = min(stall, float(config.timeout) / 2)
            rec.inspector = StallInspector(after, lambda: rec.current, folder, world.size())
            rec.inspector.start()
        if rec.folder is not None:
            atexit.register(dump, "exit")
        attach(rec)
        return rec


def attach(rec: Recorder) -> None:
    """Make ``rec`` the active recorder: every operation of every group runs through it (the
    observer slot), and a failing rank writes its file before the worlds abort."""
    global active
    active = rec
    observer.attach(rec)
    exits.before_abort(_dump_failure)


def _dump_failure() -> None:
    dump("failure")


def dump(reason: str = "exit") -> Path | None:
    """Write the active recorder's file now (at exit, or when the rank's program failed)."""
    rec = active
    if rec is None:
        return None
    try:
        return rec.dump(reason)
    except (OSError, ValueError) as exc:  # ValueError: ConfigError, the directory changed hands
        import sys

        sys.stderr.write(f"meshcomm: rank {rec.world_rank}: could not write the trace to {rec.folder}: {exc}\n")
        return None


def stop() -> None:
    """Stop recording (tests; the core never calls it): the inspector ends, the hook goes."""
    global active
    rec, active = active, None
    if rec is not None and observer.active is rec:
        observer.detach()
    if rec is not None:
        if rec.inspector is not None:
            rec.inspector.stop()
        if rec.progress is not None:
            rec.progress.close()
