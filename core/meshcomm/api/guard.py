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

import importlib
import threading
from _thread import get_ident
from types import ModuleType
from typing import Protocol

from ..protocol.errors import DistributedError

__all__ = ["Guard", "WorldGuard", "Ticket", "compiled_path", "compiled_guard", "new_guard"]

#: an operation in flight, as :meth:`WorldGuard.enter` numbers it (1, 2, ... per world)
Ticket = int


class Guard(Protocol):
    """What a world's guard does: :class:`WorldGuard` in Python, or its compiled twin
    (``meshcomm.api._callpath.Guard``, the same bookkeeping and messages)."""

    def enter(self, op: str, who: str) -> Ticket:
        """Register ``op`` as in flight; raise DistributedError if another thread's are."""
        ...

    def leave(self, ticket: Ticket, op: str, who: str, ok: bool) -> None:
        """``op`` (``ticket``) ended; raise DistributedError if another thread intruded while
        it was in flight and ``ok``."""
        ...


def _thread_name(ident: int) -> str:
    """The name of the thread ``ident`` (for messages; threads not made by ``threading`` get one too)."""
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"thread-{ident}"


class WorldGuard:
    """Admits the operations of one thread at a time into a world and its splits.

    Runs on every call, so it keeps counts, not a list: operations are numbered as they
    enter; while any is in flight they all belong to one thread (the others are refused);
    an intrusion marks every number issued so far, and an operation that leaves with a
    marked number (it was in flight then) raises. No per-call object, one lock round."""

    __slots__ = ("_mutex", "_issued", "_inflight", "_owner", "_first_op", "_marked", "_intruder")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._issued = 0  #: tickets handed out
        self._inflight = 0  #: operations entered and not yet left
        self._owner = 0  #: the thread whose operations are in flight (when any are)
        self._first_op = ""  #: the operation that was first in flight since the guard was last idle
        self._marked = 0  #: tickets up to this one were in flight when another thread intruded
        self._intruder = ""  #: what that thread did

    def enter(self, op: str, who: str) -> Ticket:
        """Register ``op`` as in flight; raise DistributedError if another thread's are."""
        me = get_ident()
        mutex = self._mutex
        mutex.acquire()  # not ``with``: this runs on every call, and the fast path is short
        if not self._inflight:  # the common case: nothing in flight
            self._owner, self._first_op = me, op
        elif self._owner != me:
            if self._marked < self._issued:
                self._marked, self._intruder = self._issued, _intrusion(me, op)
            holder, running = self._owner, self._first_op
            mutex.release()
            raise _refusal(op, who, me, holder, running)
        self._inflight += 1
        self._issued = ticket = self._issued + 1
        mutex.release()
        return ticket

    def leave(self, ticket: Ticket, op: str, who: str, ok: bool) -> None:
        """Operation ``op`` (``ticket``) ended; if another thread intruded while it was in
        flight and ``ok``, raise for it (its peers may have paired another call with it)."""
        mutex = self._mutex
        mutex.acquire()
        self._inflight -= 1
        intruder = self._intruder if ticket <= self._marked else ""
        issuer = self._owner  # the thread that issued it (async operations end on the worker)
        mutex.release()
        if intruder and ok:
            raise _discarded(who, op, issuer, intruder)


def _intrusion(ident: int, op: str) -> str:
    """What intruding thread ``ident`` did, as a discarded result names it."""
    return f"thread {_thread_name(ident)!r} called {op}"


def _refusal(op: str, who: str, ident: int, holder: int, running: str) -> DistributedError:
    """The error of thread ``ident`` refused ``op`` while thread ``holder`` is inside ``running``."""
    name, holder_name = _thread_name(ident), _thread_name(holder)
    return DistributedError(
        f"{who}: {op} was called from thread {name!r} while thread {holder_name!r} is inside {running} "
        "on the same world. A world (and the groups split from it) runs one operation at a "
        "time: ranks pair calls by their order, and two threads' calls could be paired "
        f"differently on other ranks and mix their data, so {running} fails too. Make the "
        "calls from one thread, or serialise them with one lock, taken in the same order on "
        "every rank."
    )


def _discarded(who: str, op: str, issuer: int, intruder: str) -> DistributedError:
    """The error of ``op`` (issued by thread ``issuer``) ending well after ``intruder``."""
    return DistributedError(
        f"{who}: the result of {op} (thread {_thread_name(issuer)!r}) is discarded: "
        f"{intruder} on the same world while it ran, so other ranks may have paired "
        "a different call with it. Make every call on a world from one thread, or serialise "
        "the threads' calls with one lock taken in the same order on every rank."
    )


def compiled_path() -> ModuleType | None:
    """This installation's compiled call path (``meshcomm.api._callpath``), or None (a build
    without a C compiler)."""
    try:
        return importlib.import_module("meshcomm.api._callpath")
    except ImportError:
        return None


def compiled_guard() -> type[Guard] | None:
    """The compiled guard class of this installation, or None (a build without a C compiler)."""
    path = compiled_path()
    return None if path is None else path.Guard


def new_guard(compiled: bool = True) -> Guard:
    """A guard for a new world: the compiled one when ``compiled`` and installed, else :class:`WorldGuard`."""
    cls = compiled_guard() if compiled else None
    return cls() if cls is not None else WorldGuard()
