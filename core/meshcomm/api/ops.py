"""The operations of the public API; each takes an optional ``group`` (default: the world).

Every operation also takes ``async_op=True`` (returns a :class:`meshcomm.api.work.Work` handle:
``wait(timeout=None)``, ``is_completed()``), and every one that returns an array takes
``out=`` (a writable C-contiguous array of exactly the result's shape and dtype; for
``all_sum``/``all_max``/``all_min``/``broadcast`` it may be ``x`` itself).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .group import Group
from .persistent import Persistent
from .world import default_group

__all__ = [
    "all_sum",
    "all_max",
    "all_min",
    "all_reduce_init",
    "all_gather",
    "sum_scatter",
    "broadcast",
    "send",
    "recv",
    "recv_like",
    "all_to_all",
    "gather",
    "scatter",
    "reduce",
    "all_gather_object",
    "broadcast_object",
    "barrier",
]

Out = np.ndarray | None


def _g(group: Group | None) -> Group:
    return default_group() if group is None else group


def all_sum(x: Any, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """Element-wise sum over ranks (integers wrap, bool is logical or); same shape and dtype."""
    return _g(group).all_sum(x, out=out, async_op=async_op)


def all_max(x: Any, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """Element-wise maximum over ranks."""
    return _g(group).all_max(x, out=out, async_op=async_op)


def all_min(x: Any, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """Element-wise minimum over ranks."""
    return _g(group).all_min(x, out=out, async_op=async_op)


def all_reduce_init(x: np.ndarray, op: str = "sum", *, group: Group | None = None, out: Out = None) -> Persistent:
    """A persistent all-reduce of ``x``: set up once; each call of the result reduces ``x``'s
    current contents into the same array (see :meth:`meshcomm.Group.all_reduce_init`)."""
    return _g(group).all_reduce_init(x, op, out=out)


def all_gather(x: Any, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """Every rank's ``x`` concatenated along axis 0 in rank order (0-d gives shape ``(size,)``)."""
    return _g(group).all_gather(x, out=out, async_op=async_op)


def sum_scatter(x: Any, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """The sum over ranks split along axis 0; rank r returns block r."""
    return _g(group).sum_scatter(x, out=out, async_op=async_op)


def broadcast(x: Any, root: int = 0, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """Root's ``x`` on every rank; other ranks pass an array of the same shape and dtype."""
    return _g(group).broadcast(x, root, out=out, async_op=async_op)


def send(x: Any, dst: int, *, group: Group | None = None, async_op: bool = False) -> Any:
    """Send ``x`` to rank ``dst``; received in order by ``recv``/``recv_like`` from this rank.
    Returns ``x`` once sent (like MLX's ``send``), or ``Work`` when ``async_op``."""
    return _g(group).send(x, dst, async_op=async_op)


def recv(
    shape: Any, dtype: Any, src: int, *, group: Group | None = None, out: Out = None, async_op: bool = False
) -> Any:
    """Receive a new array of ``shape`` and ``dtype`` from rank ``src``."""
    return _g(group).recv(shape, dtype, src, out=out, async_op=async_op)


def recv_like(x: Any, src: int, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """Receive a new array shaped and typed like ``x`` from rank ``src``."""
    return _g(group).recv_like(x, src, out=out, async_op=async_op)


def all_to_all(x: Any, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """Block j of rank i's ``x`` (axis 0 in ``size`` blocks) ends up as block i of rank j."""
    return _g(group).all_to_all(x, out=out, async_op=async_op)


def gather(x: Any, root: int = 0, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """Root returns every rank's ``x`` concatenated along axis 0 in rank order; others None."""
    return _g(group).gather(x, root, out=out, async_op=async_op)


def scatter(x: Any, root: int = 0, *, group: Group | None = None, out: Out = None, async_op: bool = False) -> Any:
    """Root's ``x`` split along axis 0 into ``size`` blocks; rank r returns block r."""
    return _g(group).scatter(x, root, out=out, async_op=async_op)


def reduce(
    x: Any, root: int = 0, *, op: str = "sum", group: Group | None = None, out: Out = None, async_op: bool = False
) -> Any:
    """Root returns the reduction ``op`` ("sum", "max", "min") of every rank's ``x``; others None."""
    return _g(group).reduce(x, root, op=op, out=out, async_op=async_op)


def all_gather_object(obj: Any, *, group: Group | None = None, async_op: bool = False) -> Any:
    """Every rank's picklable object, in rank order (pickle: ranks of one trusted job only)."""
    return _g(group).all_gather_object(obj, async_op=async_op)


def broadcast_object(obj: Any, root: int = 0, *, group: Group | None = None, async_op: bool = False) -> Any:
    """Root's picklable object on every rank (pickle: ranks of one trusted job only)."""
    return _g(group).broadcast_object(obj, root, async_op=async_op)


def barrier(*, group: Group | None = None, async_op: bool = False) -> Any:
    """Return once every rank of the group has entered the barrier."""
    return _g(group).barrier(async_op=async_op)
