"""``async_op=True``: handles, and the per-world worker thread that runs operations in order.

Ranks pair operations by the order in which each rank issues them. A world therefore has
one worker thread (started at its first asynchronous operation, shared with its splits)
that runs queued operations one after the other in issue order. A blocking call made
while asynchronous ones are queued or running is queued behind them and waited for, so
blocking and asynchronous calls keep one order; with nothing queued a blocking call runs
on the caller's thread, as it always did.

The worker is a daemon thread: a handle that is never waited on cannot keep the program
alive. At exit (or ``Group.close()``) the world waits up to its timeout for the queued
operations to finish, so peers that take part in them are not left waiting, then closes.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from ..protocol.errors import CommTimeoutError

__all__ = ["Work", "WorldWorker"]

T = TypeVar("T")


class Work(Generic[T]):
    """The handle of an operation started with ``async_op=True``.

    ``wait(timeout=None)`` returns what the blocking call would have returned (or raises
    what it would have raised); ``is_completed()`` tells without blocking.
    """

    __slots__ = ("op", "who", "_done", "_result", "_error", "_observed", "_worker")

    def __init__(self, op: str, who: str, worker: WorldWorker | None = None) -> None:
        self.op = op
        self.who = who
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._worker = worker

    @classmethod
    def completed(cls, op: str, who: str, result: T) -> Work[T]:
        """A handle that is already complete with ``result``."""
        w: Work[T] = cls(op, who)
        w._finish(result, None)
        return w

    def _finish(self, result: T | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def is_completed(self) -> bool:
        """True once the operation has finished (successfully or not); never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation finishes; return its result or raise its error.

        ``timeout`` (seconds): raise :class:`meshcomm.CommTimeoutError` if it has not
        finished by then. The operation keeps running; call ``wait`` again later.
        """
        if timeout is not None:
            try:
                timeout = float(timeout)
            except (TypeError, ValueError):
                raise TypeError(f"wait: timeout must be a number of seconds or None, got {timeout!r}") from None
            if not timeout >= 0:
                raise ValueError(f"wait: timeout must be >= 0 seconds, got {timeout}")
        if not self._done.wait(timeout):
            raise CommTimeoutError(
                f"{self.who}: {self.op} (async) did not complete within wait(timeout={timeout:g}) s; "
                "it is still in progress: call wait() again, or wait without a timeout "
                "(the operation itself raises after MLX_TIMEOUT if a peer does not answer)"
            )
        self._observed = True
        if self._error is not None:
            if self._worker is not None:
                self._worker.observed(self)  # type: ignore[arg-type]
            raise self._error
        return self._result  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error is not None else "completed")
        return f"<meshcomm Work {self.op} {state}>"


class WorldWorker:
    """Runs a world's queued operations, one at a time, in the order they were submitted."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[Work[object], Callable[[], object]]] = collections.deque()
        self._running = 0
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._unobserved: list[Work[object]] = []

    def pending(self) -> bool:
        """True while an operation is queued or running."""
        if self._thread is None:  # nothing was ever queued (submit starts the thread): the blocking path
            return False
        with self._cv:
            return bool(self._queue) or self._running > 0

    def submit(self, work: Work[T], job: Callable[[], T]) -> Work[T]:
        """Queue ``job``; its result or error goes to ``work``."""
        with self._cv:
            if self._stopped:
                raise RuntimeError("the world's worker is stopped")
            self._queue.append((work, job))  # type: ignore[arg-type]
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"meshcomm-worker-{self._name}", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return work

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if not self._queue:
                    return
                work, job = self._queue.popleft()
                self._running += 1
            result: object = None
            error: BaseException | None = None
            try:
                result = job()
            except BaseException as exc:  # handed to whoever waits on the handle
                error = exc
            with self._cv:
                if error is not None:
                    work._worker = self
                    self._unobserved.append(work)
                work._finish(result, error)
                self._running -= 1
                self._cv.notify_all()

    def observed(self, work: Work[object]) -> None:
        """``work``'s error reached the caller (no warning about it at close)."""
        with self._cv:
            if work in self._unobserved:
                self._unobserved.remove(work)

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the queue to empty; True if it did."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and self._running == 0, timeout)

    def stop(self, timeout: float) -> None:
        """Let queued operations finish (up to ``timeout`` s), stop the thread, and warn
        about failed operations whose handles were never waited on."""
        finished = self.drain(timeout)
        with self._cv:
            self._stopped = True
            left = len(self._queue) + self._running
            failed = [w for w in self._unobserved if not w._observed]
            self._unobserved.clear()
            self._cv.notify_all()
        if not finished:
            sys.stderr.write(
                f"meshcomm: [{self._name}] {left} async operation(s) still unfinished after "
                f"{timeout:g} s at close; closing anyway\n"
            )
        for w in failed:
            sys.stderr.write(
                f"meshcomm: {w.who}: async {w.op} failed and was never waited on: "
                f"{type(w._error).__name__}: {w._error}\n"
            )
