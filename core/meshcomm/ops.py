"""The operations of the public API; each takes an optional ``group`` (default: the world)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .group import Group
from .world import default_group

__all__ = ["all_sum", "all_max", "all_min", "all_gather", "sum_scatter", "broadcast",
           "send", "recv", "recv_like"]


def _g(group: Group | None) -> Group:
    return default_group() if group is None else group


def all_sum(x: Any, *, group: Group | None = None) -> np.ndarray:
    """Element-wise sum over ranks (integers wrap, bool is logical or); same shape and dtype."""
    return _g(group)._reduce("sum", x)


def all_max(x: Any, *, group: Group | None = None) -> np.ndarray:
    """Element-wise maximum over ranks."""
    return _g(group)._reduce("max", x)


def all_min(x: Any, *, group: Group | None = None) -> np.ndarray:
    """Element-wise minimum over ranks."""
    return _g(group)._reduce("min", x)


def all_gather(x: Any, *, group: Group | None = None) -> np.ndarray:
    """Every rank's ``x`` concatenated along axis 0 in rank order (0-d gives shape ``(size,)``)."""
    return _g(group)._all_gather(x)


def sum_scatter(x: Any, *, group: Group | None = None) -> np.ndarray:
    """The sum over ranks split along axis 0; rank r returns block r."""
    return _g(group)._sum_scatter(x)


def broadcast(x: Any, root: int = 0, *, group: Group | None = None) -> np.ndarray:
    """Root's ``x`` on every rank; other ranks pass an array of the same shape and dtype."""
    return _g(group)._broadcast(x, root)


def send(x: Any, dst: int, *, group: Group | None = None) -> None:
    """Send ``x`` to rank ``dst``; received in order by ``recv``/``recv_like`` from this rank."""
    _g(group)._send(x, dst)


def recv(shape: Any, dtype: Any, src: int, *, group: Group | None = None) -> np.ndarray:
    """Receive a new array of ``shape`` and ``dtype`` from rank ``src``."""
    return _g(group)._recv(shape, dtype, src)


def recv_like(x: Any, src: int, *, group: Group | None = None) -> np.ndarray:
    """Receive a new array shaped and typed like ``x`` from rank ``src``."""
    a = np.asarray(x)
    return _g(group)._recv(a.shape, a.dtype, src)
