"""``Group``: a set of ranks on one backend, and the checks every operation shares.

All argument checking, dtype and layout handling, output allocation, debug checks and
error translation happen here, once; backends only see contiguous 1-D buffers.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from . import debug as _debug
from .backend import Backend
from .dtypes import check_dtype
from .errors import DistributedError
from .guard import WorldGuard

__all__ = ["Group", "as_array"]

T = TypeVar("T")


def as_array(x: Any, what: str = "x") -> np.ndarray:
    """``np.asarray(x)`` with a supported dtype, else a ValueError saying what is wrong."""
    try:
        a = np.asarray(x)
    except Exception as exc:
        raise ValueError(f"{what} cannot be converted to a NumPy array: {exc}") from None
    if a.dtype == object:
        raise ValueError(f"{what} is an object array (ragged list or Python objects); pass numbers")
    check_dtype(a.dtype, what=what)
    return a


def _flat(a: np.ndarray) -> np.ndarray:
    """A C-contiguous 1-D view of ``a`` (a copy only if ``a`` is not contiguous)."""
    if a.flags.c_contiguous:
        return a.reshape(-1)
    return np.ascontiguousarray(a).reshape(-1)


def _index(value: Any, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


class Group:
    """The ranks that take part in a collective. Get one from ``meshcomm.init()`` or ``split``."""

    def __init__(self, backend: Backend, name: str, *, debug: bool = False, label: str = "world",
                 check_calls: bool = True, guard: WorldGuard | None = None) -> None:
        self._b = backend
        self._name = name
        self._debug = debug
        self._label = label
        self._rank = int(backend.rank())
        self._size = int(backend.size())
        # The core compares calls across ranks only where the transport does not (MLX_DEBUG
        # does the full comparison everywhere).
        self._check_calls = check_calls
        self._quick = check_calls and not debug and not backend.checks_calls
        self._guard = guard if guard is not None else WorldGuard()
        self._who = f"[{name}] rank {self._rank}"

    # -- identity ---------------------------------------------------------------------
    def rank(self) -> int:
        """This process's rank in the group, in ``[0, size)``."""
        return self._rank

    def size(self) -> int:
        """How many ranks the group has."""
        return self._size

    @property
    def backend(self) -> str:
        """Name of the backend carrying this group's messages."""
        return self._name

    @property
    def transport(self) -> Backend:
        """The backend object itself (for plugin authors and tests)."""
        return self._b

    def __repr__(self) -> str:
        return f"Group(backend={self._name!r}, rank={self._rank}, size={self._size}, {self._label})"

    # -- group operations -------------------------------------------------------------
    def split(self, color: int, key: int = -1) -> Group:
        """Ranks passing equal ``color`` form a new group, ordered by ``key`` then old rank."""
        color, key = _index(color, "color"), _index(key, "key")
        sub = cast(Backend, self._collective("split", (), None, 0, self._b.split, color, key))
        return Group(sub, self._name, debug=self._debug, label=f"split of {self._label} (color={color})",
                     check_calls=self._check_calls, guard=self._guard)

    def barrier(self) -> None:
        """Return on each rank only after every rank of the group has entered the barrier."""
        if self._size == 1:
            return
        # The call check is an all-reduce, which no rank leaves before every rank entered it:
        # when it runs, it is the barrier.
        self._collective("barrier", (), None, 0, None if self._quick else self._b.barrier)

    # -- used by meshcomm.ops -----------------------------------------------------------
    def _reduce(self, op: str, x: Any) -> np.ndarray:
        a = as_array(x)
        if self._size == 1:
            return np.array(a, copy=True)
        out = np.empty(a.shape, a.dtype)
        self._collective(f"all_{op}", a.shape, a.dtype, 0,
                         self._b.all_reduce if a.size else None, _flat(a), out.reshape(-1), op)
        return out

    def _all_gather(self, x: Any) -> np.ndarray:
        a = as_array(x)
        shape = (self._size,) if a.ndim == 0 else (self._size * a.shape[0], *a.shape[1:])
        if self._size == 1:
            return np.array(a, copy=True).reshape(shape)
        out = np.empty(shape, a.dtype)
        self._collective("all_gather", a.shape, a.dtype, 0,
                         self._b.all_gather if a.size else None, _flat(a), out.reshape(-1))
        return out

    def _sum_scatter(self, x: Any) -> np.ndarray:
        a = as_array(x)
        if a.ndim == 0 or a.shape[0] % self._size:
            raise ValueError(
                f"sum_scatter: invalid shape {a.shape} for a group of size {self._size}: "
                f"axis 0 must be divisible by {self._size}"
            )
        if self._size == 1:
            return np.array(a, copy=True)
        out = np.empty((a.shape[0] // self._size, *a.shape[1:]), a.dtype)
        self._collective("sum_scatter", a.shape, a.dtype, 0,
                         self._b.reduce_scatter if a.size else None, _flat(a), out.reshape(-1), "sum")
        return out

    def _broadcast(self, x: Any, root: Any) -> np.ndarray:
        a = as_array(x)
        root = self._peer(root, "root", allow_self=True)
        out = np.array(a, copy=True, order="C")
        if self._size == 1:
            return out
        self._collective("broadcast", a.shape, a.dtype, root,
                         self._b.broadcast if a.size else None, out.reshape(-1), root)
        return out

    def _send(self, x: Any, dst: Any) -> None:
        a = as_array(x)
        dst = self._peer(dst, "dst")
        if self._debug:
            self._run("send", self._checked_send, _flat(a), a.shape, dst)
        else:
            self._run("send", self._b.send, _flat(a), dst)

    def _recv(self, shape: Any, dtype: Any, src: Any) -> np.ndarray:
        shp = _shape(shape)
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"recv: dtype {dtype!r} is not a NumPy dtype") from None
        check_dtype(dt, what="recv")
        src = self._peer(src, "src")
        out = np.empty(shp, dt)
        if self._debug:
            self._run("recv", self._checked_recv, out, src)
        else:
            self._run("recv", self._b.recv, out.reshape(-1), src)
        return out

    # -- helpers ------------------------------------------------------------------------
    def _where(self) -> str:
        return f"the {self._label} group on {self._name!r}"

    def _peer(self, value: Any, what: str, *, allow_self: bool = False) -> int:
        peer = _index(value, what)
        if self._size == 1 and not allow_self:
            raise ValueError(f"cannot use {what}={peer} in a group of size 1: there is no other rank")
        if not 0 <= peer < self._size:
            raise ValueError(
                f"invalid {what}={peer} for a group of size {self._size} (rank {self._rank}); "
                f"expected 0 <= {what} < {self._size}"
            )
        if peer == self._rank and not allow_self:
            raise ValueError(f"rank {self._rank} cannot {'send to' if what == 'dst' else 'receive from'} itself")
        return peer

    def _collective(self, op: str, shape: tuple[int, ...], dtype: np.dtype | None, arg: int,
                    fn: Callable[..., T] | None, *args: Any) -> T | None:
        """Run collective ``op``: the cross-rank call check (when on), then ``fn(*args)``."""
        return self._run(op, self._checked, op, shape, dtype, arg, fn, args)

    def _checked(self, op: str, shape: tuple[int, ...], dtype: np.dtype | None, arg: int,
                 fn: Callable[..., T] | None, args: tuple[Any, ...]) -> T | None:
        if self._debug:
            _debug.check_collective(self._b, self._where(), op, shape, dtype, arg)
        elif self._quick:
            _debug.quick_check(self._b, self._where(), op, shape, dtype, arg)
        return None if fn is None else fn(*args)

    def _checked_send(self, flat: np.ndarray, shape: tuple[int, ...], dst: int) -> None:
        _debug.check_send(self._b, self._where(), shape, flat.dtype, dst)
        self._b.send(flat, dst)

    def _checked_recv(self, out: np.ndarray, src: int) -> None:
        _debug.check_recv(self._b, self._where(), out.shape, out.dtype, src)
        self._b.recv(out.reshape(-1), src)

    def _run(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` as operation ``op``: alone in this world (see :mod:`meshcomm.guard`),
        with unexpected exceptions turned into DistributedError naming the rank."""
        self._guard.enter(op, self._who)
        ok = False
        try:
            result = fn(*args)
            ok = True
            return result
        except (DistributedError, ValueError, TypeError):
            raise
        except Exception as exc:
            raise DistributedError(f"{self._who}: {op} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._guard.leave(self._who, ok)


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    if not isinstance(shape, Sequence) and not isinstance(shape, np.ndarray):
        raise TypeError(f"recv: shape must be a tuple of integers, got {shape!r}")
    dims = tuple(_index(d, "shape entry") for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"recv: shape {dims} has a negative dimension")
    return dims
