"""An in-process, point-to-point-only transport: one thread per rank, one queue per pair.

It implements only ``send``/``recv`` (and ``sendrecv`` through the base class), so every
collective it runs comes from the core's generic algorithms. Use it to unit-test code
that calls meshcomm without starting processes::

    results = run_threaded(4, lambda g: mc.all_sum(np.arange(3) * g.rank(), group=g))
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ..api.group import Group
from ..api.guard import new_guard
from ..protocol.backend import Backend
from ..protocol.errors import CommTimeoutError, DistributedError

__all__ = ["ThreadedBackend", "make_threaded_groups", "run_threaded"]

T = TypeVar("T")


class _Fabric:
    """The shared queues of one threaded job."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.queues: dict[tuple[int, int], queue.Queue[bytes]] = {
            (s, d): queue.Queue() for s in range(n) for d in range(n) if s != d
        }


class ThreadedBackend(Backend):
    """Rank ``rank`` of an in-process job; messages are copied through queues."""

    #: the generic algorithms accept the caller's out= buffers (see Backend.direct_out)
    direct_out = True
    #: every rank is a thread of this process (object payloads need no job secret)
    in_process = True

    def __init__(self, fabric: _Fabric, rank: int, timeout: float = 30.0) -> None:
        self._fabric = fabric
        self._rank = rank
        self.timeout = timeout

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._fabric.n

    def send(self, buf: np.ndarray, dst: int) -> None:
        self._fabric.queues[(self._rank, dst)].put(buf.tobytes())

    def recv(self, buf: np.ndarray, src: int) -> None:
        try:
            data = self._fabric.queues[(src, self._rank)].get(timeout=self.timeout)
        except queue.Empty:
            raise CommTimeoutError(
                f"[threaded] rank {self._rank}: no message from rank {src} within {self.timeout} s",
                peer=src,
            ) from None
        if len(data) != buf.nbytes:
            raise DistributedError(
                f"[threaded] rank {self._rank}: expected {buf.nbytes} bytes from rank {src}, got {len(data)}"
            )
        buf.view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)


def make_threaded_groups(
    n: int, *, timeout: float = 30.0, debug: bool = False, check_calls: bool = True, compiled: bool = True
) -> list[Group]:
    """``n`` groups, one per rank, of one in-process job (``compiled``: their worlds' guards
    are the compiled ones when installed, as ``MESHCOMM_COMPILED`` picks for ``init``)."""
    fabric = _Fabric(n)
    return [
        Group(
            ThreadedBackend(fabric, r, timeout),
            "threaded",
            debug=debug,
            check_calls=check_calls,
            guard=new_guard(compiled),
        )
        for r in range(n)
    ]


def run_threaded(
    n: int,
    fn: Callable[[Group], T],
    *,
    timeout: float = 30.0,
    debug: bool = False,
    check_calls: bool = True,
    compiled: bool = True,
) -> list[T]:
    """Run ``fn(group)`` on ``n`` threads, one per rank; return results in rank order
    (``compiled``: as for :func:`make_threaded_groups`).

    The first exception raised by any rank is re-raised here (after all threads end).
    """
    groups = make_threaded_groups(n, timeout=timeout, debug=debug, check_calls=check_calls, compiled=compiled)
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []

    def body(r: int) -> None:
        try:
            results[r] = fn(groups[r])
        except BaseException as exc:
            errors.append((r, exc))

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    if any(t.is_alive() for t in threads):
        raise DistributedError(f"threaded job of {n} ranks did not finish within {timeout * 4} s")
    if errors:
        errors.sort(key=lambda e: e[0])
        raise errors[0][1]
    return results
