"""One thread at a time in a world: a second thread entering a busy world is an error.

Ranks pair operations by their order on each rank. If two threads of a rank call
operations on one world at the same time, nothing makes the other ranks pick the same
order, so calls of different threads could be paired and their data mixed. Instead of
serialising in an order no rank can know, the guard refuses the second thread at once,
and the operation already in flight raises when it ends (its peers may have paired it
with the other thread's call), so neither returns data that may be wrong.
"""

from __future__ import annotations

import threading

from .errors import DistributedError

__all__ = ["WorldGuard"]


class WorldGuard:
    """Admits one operation at a time into a world and every group split from it."""

    __slots__ = ("_mutex", "_busy", "_thread", "_op", "_intruder")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._busy = False
        self._thread = ""
        self._op = ""
        self._intruder: str | None = None

    def enter(self, op: str, who: str) -> None:
        """Mark the world busy with ``op``; raise DistributedError if it already is."""
        me = threading.current_thread().name
        with self._mutex:
            if not self._busy:
                self._busy, self._thread, self._op = True, me, op
                return
            if self._intruder is None:
                self._intruder = f"thread {me!r} called {op}"
            running, holder = self._op, self._thread
        raise DistributedError(
            f"{who}: {op} was called from thread {me!r} while thread {holder!r} is inside {running} "
            "on the same world. A world (and the groups split from it) runs one operation at a "
            "time: ranks pair calls by their order, and two threads' calls could be paired "
            f"differently on other ranks and mix their data, so {running} fails too. Make the "
            "calls from one thread, or serialise them with one lock, taken in the same order on "
            "every rank."
        )

    def leave(self, who: str, ok: bool) -> None:
        """Mark the world free; if another thread intruded and ``ok``, raise for this operation."""
        with self._mutex:
            intruder, op, thread = self._intruder, self._op, self._thread
            self._busy, self._intruder = False, None
        if intruder is not None and ok:
            raise DistributedError(
                f"{who}: the result of {op} (thread {thread!r}) is discarded: {intruder} on the "
                "same world while it ran, so other ranks may have paired a different call with it. "
                "Make every call on a world from one thread, or serialise the threads' calls with "
                "one lock taken in the same order on every rank."
            )
