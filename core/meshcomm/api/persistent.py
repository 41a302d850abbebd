"""Persistent operations: an all-reduce set up once and started many times.

``Group.all_reduce_init(x, op)`` checks its arguments and sets the operation up once (a
backend with persistent operations may set up its own: ``Backend.all_reduce_init``); each
call of the returned :class:`Persistent` reduces the *current* contents of ``x`` into the
same result array. A training loop that all-reduces the same buffer every step pays the
argument checks and the result allocation once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..protocol.errors import DistributedError

__all__ = ["Persistent"]


class Persistent:
    """A persistent all-reduce of one group (made by :meth:`meshcomm.Group.all_reduce_init`).

    ``p()`` runs one all-reduce of ``p.x``'s current contents and returns ``p.out``, the same
    array every time (copy it to keep a result across calls). Every rank of the group must
    start it in the same order as its other collectives, like any collective. ``close()``
    (or leaving a ``with`` block) frees it; after the group is closed, a start raises.
    """

    def __init__(
        self,
        run: Callable[[Persistent], np.ndarray],
        who: str,
        op: str,
        x: np.ndarray,
        out: np.ndarray,
        start: Callable[[], None],
    ) -> None:
        """``run(self)`` starts it as a collective of its group (the group's guard and call
        check around ``start``, the backend's start); ``who`` names the rank in errors."""
        self._run = run
        self._who = who
        self.op = op
        #: the array reduced at every start (read in place)
        self.x = x
        #: the result, written at every start
        self.out = out
        self._start = start
        self._closed = False

    def __call__(self) -> np.ndarray:
        """Reduce ``x``'s current contents over the group into ``out``; returns ``out``."""
        if self._closed:
            raise DistributedError(
                f"{self._who}: a persistent all_reduce (op={self.op!r}) was started after close(); "
                "make a new one with all_reduce_init"
            )
        return self._run(self)

    def close(self) -> None:
        """Free the operation (the backend's persistent request, if it made one). Safe to repeat."""
        if self._closed:
            return
        self._closed = True
        close = getattr(self._start, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Persistent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Persistent(all_reduce op={self.op!r}, shape={self.x.shape}, dtype={self.x.dtype}, {state})"
