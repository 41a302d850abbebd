"""The slot through which a tool watches every operation of every group.

``Group._execute`` runs each operation through :data:`active` when it is set (one ``None``
check when it is not), handing over what the operation's method already holds. The tracer
and the stall inspector (:mod:`meshcomm.trace.recorder`) fill the slot when the world starts
with them on; the groups know only this module, not the tool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

__all__ = ["Payload", "CallObserver", "active", "attach", "detach"]

T = TypeVar("T")

#: what a rank passes to an operation, as the core hands it over: the array (its bytes and
#: dtype are recorded), the pickled object (bytes), recv's (shape, dtype), or None
Payload = np.ndarray | bytes | tuple[tuple[int, ...], np.dtype[Any]] | None


class CallObserver(Protocol):
    """A tool that runs each operation itself, to note what it does."""

    def call(
        self, group: Any, op: str, run: Callable[[], T], payload: Payload = None, arg: int = -1, seq: int = 0
    ) -> T:
        """Run ``run()`` (operation ``op`` on ``group``, the group's call number ``seq``) and
        note it; ``payload`` is what this rank passes, ``arg`` the peer of ``send``/``recv``
        or the color of ``split``."""
        ...


# An observer may also offer ``lane_record(group, op)``: the compiled call path
# (``meshcomm.api._callpath.Lane``, a group's blocking all_sum/all_max/all_min and barrier)
# then does not call :meth:`CallObserver.call` but keeps the record itself. It returns None
# (run every such operation through ``call``) or ``(prefix, buffer, op_bytes, group_bytes,
# slot, running)``: for the operation's duration the call path keeps in ``running`` (a
# ``meshcomm.api._callpath.Running``, whose ``current()`` is then ``prefix + (seq, op, -1,
# start time)``, None after) what it runs, and when ``buffer`` is not None writes the
# progress record's fields into it (the layout of :mod:`meshcomm.trace.progress`). An
# observer without the method runs every operation through ``call``.


#: the observer every operation runs through, or None (nothing watches)
active: CallObserver | None = None


def attach(observer: CallObserver) -> None:
    """Run every later operation of every group through ``observer``."""
    global active
    active = observer


def detach() -> CallObserver | None:
    """Empty the slot; returns the observer that was in it."""
    global active
    observer, active = active, None
    return observer
