"""One thread at a time in a world: a second thread entering a busy world is an error.

Ranks pair operations by their order on each rank. If two threads of a rank call
operations on one world at the same time, nothing makes the other ranks pick the same
order, so calls of different threads could be paired and their data mixed. Instead of
serialising in an order no rank can know, the guard refuses the second thread at once,
and the operations already in flight raise when they end (their peers may have paired
them with the other thread's call), so none returns data that may be wrong.

An operation is *in flight* from the moment a thread issues it until it ends: for a
blocking call that is the call itself, for ``async_op=True`` it lasts until the
operation completes on the world's worker thread. The thread that issued the operations
in flight may issue more (they queue behind them, in order); any other thread is
refused until they have all ended.
"""

from __future__ import annotations

import threading
from _thread import get_ident

from .errors import DistributedError

__all__ = ["WorldGuard", "Ticket"]


def _thread_name(ident: int) -> str:
    """The name of the thread ``ident`` (for messages; threads not made by ``threading`` get one too)."""
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"thread-{ident}"


class Ticket:
    """One operation in flight: who issued it, and who intruded while it ran (if anyone)."""

    __slots__ = ("op", "thread", "intruder")

    def __init__(self, op: str, thread: int) -> None:
        self.op = op
        self.thread = thread  #: the issuing thread's ident (its name is looked up for messages only)
        self.intruder: str | None = None


class WorldGuard:
    """Admits the operations of one thread at a time into a world and its splits."""

    __slots__ = ("_mutex", "_active")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._active: list[Ticket] = []

    def enter(self, op: str, who: str) -> Ticket:
        """Register ``op`` as in flight; raise DistributedError if another thread's are."""
        ticket = Ticket(op, get_ident())
        mutex = self._mutex
        mutex.acquire()  # not ``with``: this runs on every call, and the fast path is short
        try:
            active = self._active
            if not active:  # the common case: nothing in flight
                active.append(ticket)
                return ticket
            me = ticket.thread
            others = [t for t in active if t.thread != me]
            if not others:
                active.append(ticket)
                return ticket
            name = _thread_name(me)
            for t in active:
                if t.intruder is None:
                    t.intruder = f"thread {name!r} called {op}"
            running, holder = others[0].op, _thread_name(others[0].thread)
        finally:
            mutex.release()
        raise DistributedError(
            f"{who}: {op} was called from thread {name!r} while thread {holder!r} is inside {running} "
            "on the same world. A world (and the groups split from it) runs one operation at a "
            "time: ranks pair calls by their order, and two threads' calls could be paired "
            f"differently on other ranks and mix their data, so {running} fails too. Make the "
            "calls from one thread, or serialise them with one lock, taken in the same order on "
            "every rank."
        )

    def leave(self, ticket: Ticket, who: str, ok: bool) -> None:
        """``ticket``'s operation ended; if another thread intruded and ``ok``, raise for it."""
        mutex = self._mutex
        mutex.acquire()
        try:
            self._active.remove(ticket)
        except ValueError:  # pragma: no cover - left twice
            pass
        finally:
            mutex.release()
        if ticket.intruder is not None and ok:
            raise DistributedError(
                f"{who}: the result of {ticket.op} (thread {_thread_name(ticket.thread)!r}) is discarded: "
                f"{ticket.intruder} on the same world while it ran, so other ranks may have paired "
                "a different call with it. Make every call on a world from one thread, or serialise "
                "the threads' calls with one lock taken in the same order on every rank."
            )
