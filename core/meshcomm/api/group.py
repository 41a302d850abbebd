"""``Group``: a set of ranks on one backend, and the checks every operation shares.

All argument checking, dtype and layout handling, output allocation, debug checks and
error translation happen here, once; backends only see contiguous 1-D buffers.

Every operation goes the same way: arguments are checked on the caller's thread (a
ValueError or TypeError before any communication), then the operation is *issued*
(:meth:`Group._submit`): admitted by the world's one-thread guard, and run either at once
on the caller's thread or, for ``async_op=True`` and for anything issued behind an
asynchronous operation, on the world's worker thread in issue order (:mod:`meshcomm.api.work`).
Running it means the cross-rank call check (:meth:`Group._check`) and then the backend.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import numpy as np

from ..protocol.backend import SHAPE_KEYS, Backend
from ..protocol.dtypes import BASE_SUPPORTED, check_dtype
from ..protocol.errors import CallsDiffer, DistributedError, NotSupportedError
from ..protocol.operations import REDUCTIONS
from ..runtime import exits
from ..runtime.single_backend import SingleBackend
from . import debug as _debug
from . import objects
from . import observer as _observer
from .frameworks import MappedWork, result_type, to_numpy
from .guard import Guard, Ticket, compiled_path, new_guard
from .objects import ObjectSeal
from .persistent import Persistent
from .work import Work, WorldWorker

__all__ = ["Group", "as_array", "world_ident", "DEFAULT_MAX_OBJECT_BYTES"]

T = TypeVar("T")

#: the dtypes as_array passes through without further checks
_MOVABLE = frozenset(BASE_SUPPORTED)
#: the operation name of each reduction's all-reduce
_ALL_NAMES = {op: f"all_{op}" for op in REDUCTIONS}
#: the compiled call path (None: pure Python); its lanes run a blocking all-reduce's steps
_compiled = compiled_path()

#: the object collectives' size limit when neither the config nor the group sets one
DEFAULT_MAX_OBJECT_BYTES = 1 << 30


def as_array(x: Any, what: str = "x") -> np.ndarray:
    """``np.asarray(x)`` with a supported dtype, else a ValueError saying what is wrong."""
    if type(x) is np.ndarray and x.dtype in _MOVABLE:  # the common case: one type and one set test
        return x
    try:
        a = np.asarray(x)
    except Exception as exc:
        raise ValueError(f"{what} cannot be converted to a NumPy array: {exc}") from None
    if a.dtype == object:
        raise ValueError(f"{what} is an object array (ragged list or Python objects); pass numbers")
    check_dtype(a.dtype, what=what)
    return a


if _compiled is not None:
    _compiled.setup(_MOVABLE, SHAPE_KEYS, CallsDiffer, (DistributedError, ValueError, TypeError))


def _flat(a: np.ndarray) -> np.ndarray:
    """A C-contiguous 1-D view of ``a`` (a copy only if ``a`` is not contiguous; ``a``
    itself when it already is one: a reshape costs more than the rest of a small call's checks)."""
    if a.flags.c_contiguous:
        return a if a.ndim == 1 else a.reshape(-1)
    return np.ascontiguousarray(a).reshape(-1)


def _index(value: Any, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


class _World:
    """What a world shares with every group split from it: the one-thread guard, the
    worker thread of asynchronous operations, and whether the world was closed."""

    def __init__(self, name: str, guard: Guard | None) -> None:
        self.guard = guard if guard is not None else new_guard()
        self.worker = WorldWorker(name)
        self.closed = False
        self.lock = threading.Lock()
        #: told (old world, new world) when shrink() replaces the world (meshcomm.init's registry)
        self.replaced: Callable[[Group, Group], None] | None = None


def _same_array(out: np.ndarray, x: np.ndarray) -> bool:
    """``out`` is ``x`` under another name: a view of exactly its memory, shape and dtype
    (``x[...]``, or what a framework's tensor gives each time it is read as NumPy)."""
    return (
        out.shape == x.shape
        and out.strides == x.strides
        and out.dtype == x.dtype
        and out.__array_interface__["data"][0] == x.__array_interface__["data"][0]
    )


class Group:
    """The ranks that take part in a collective. Get one from ``meshcomm.init()`` or ``split``.

    ``with mc.init() as world: ...`` closes the world at the end (see :meth:`close`).
    """

    def __init__(
        self,
        backend: Backend,
        name: str,
        *,
        debug: bool = False,
        label: str = "world",
        check_calls: bool = True,
        guard: Guard | None = None,
        max_object_bytes: int | None = None,
        _world: _World | None = None,
        _ident: str = "world",
    ) -> None:
        self._b = backend
        self._size = int(backend.size())
        #: what moves this group's data: the backend, or for a group of one rank (a world of
        #: one, a split that kept one rank) the size-1 backend, whose collectives are copies
        self._moves: Backend = backend if self._size > 1 else SingleBackend(float(backend.timeout))
        self._name = name
        self._debug = debug
        self._label = label
        self._rank = int(backend.rank())
        # The core compares calls across ranks only where the transport does not (MLX_DEBUG
        # does the full comparison everywhere).
        self._check_calls = check_calls
        self._is_world = _world is None
        self._world = _world if _world is not None else _World(name, guard)
        self._guard = self._world.guard
        self._max_object_bytes = max_object_bytes
        self._closed = False
        self._who = f"[{name}] rank {self._rank}"
        self._native: dict[str, bool] = {}
        #: the all-reduce needs no core check (see :meth:`_check`)
        self._plain_reduce = self._size == 1 or (
            not debug and (not check_calls or self._natively_checked("all_reduce"))
        )
        #: the backend compares calls in-band: it is told each collective's shape key
        self._keyed = bool(self._moves.checks_calls)
        #: the backend carries the core's call check with the data (Backend.pipelines_calls);
        #: the call whose key is in flight, for naming a mismatch
        self._piped = self._size > 1 and not debug and check_calls and bool(self._moves.pipelines_calls)
        self._in_flight: tuple[str, tuple[int, ...], np.dtype | None, int, str | None] | None = None
        #: names this group the same on every member, distinct from its parent's other splits
        #: (object payloads are sealed over it); splits made so far; object calls made so far
        self._ident = _ident
        self._splits = 0
        self._object_calls = 0
        self._seal: ObjectSeal | None = None
        #: the user's calls so far, numbered as every message and the trace name them:
        #: collectives on this group; sends to and receives from each peer
        self._calls = 0
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        #: the compiled blocking all-reduce into a new result or out= (x, 0 sum / 1 max / 2 min
        #: [, out]: what :meth:`_all_reduce`, :meth:`_submit` and :meth:`_execute` do for it)
        #: when the world runs the compiled guard (MESHCOMM_COMPILED), else None. It holds this group's
        #: backend, world and worker: they are fixed for the group's life.
        self._lane: Callable[..., np.ndarray] | None = None
        #: how a persistent all-reduce of this group starts: the lane's start, or _start_persistent
        self._starter: Callable[[Persistent], np.ndarray] = self._start_persistent
        #: the compiled blocking barrier (what _submit_barrier does), or None
        self._barrier_lane: Callable[[], None] | None = None
        if _compiled is not None and type(self._guard) is _compiled.Guard:
            lane = _compiled.Lane(
                self,
                self._guard,
                self._world,
                self._world.worker,
                self._b,
                self._moves,
                self._who,
                _observer,
                self._plain_reduce,
                self._keyed,
                self._piped,
            )
            self._lane, self._starter, self._barrier_lane = lane.run, lane.start, lane.barrier

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

    @property
    def closed(self) -> bool:
        """True once this group (or the world it was split from) was closed."""
        return self._closed or self._world.closed

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return f"Group(backend={self._name!r}, rank={self._rank}, size={self._size}, {self._label}{state})"

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the group's resources; later calls on it raise DistributedError.

        Operations already issued (``async_op=True``) run to completion first (for up to
        the backend's timeout). Closing the world closes its backend (connections, memory,
        sub-communicators) and so every group split from it. Closing twice does nothing.
        """
        with self._world.lock:
            if self._closed:
                return
            self._closed = True
            world_was_closed = self._world.closed
            if self._is_world:
                self._world.closed = True
        if world_was_closed:
            return  # the world's close already released everything split from it
        # after this rank's program failed (the peers were told), do not wait on them
        timeout = 0.0 if exits.has_ended() else float(self._b.timeout)
        if self._is_world:
            self._world.worker.stop(timeout)
        else:
            self._world.worker.drain(timeout)
        try:
            self._b.close()
        except Exception as exc:
            raise DistributedError(f"{self._who}: closing {self._where()} failed: {type(exc).__name__}: {exc}") from exc

    # -- group operations -------------------------------------------------------------
    @overload
    def split(self, color: int, key: int = -1, *, async_op: Literal[False] = False) -> Group: ...

    @overload
    def split(self, color: int, key: int = -1, *, async_op: Literal[True]) -> Work[Group]: ...

    @overload
    def split(self, color: int, key: int = -1, *, async_op: bool) -> Group | Work[Group]: ...

    def split(self, color: int, key: int = -1, *, async_op: bool = False) -> Group | Work[Group]:
        """Ranks passing equal ``color`` form a new group, ordered by ``key`` then old rank."""
        color, key = _index(color, "color"), _index(key, "key")

        def run() -> Group:
            self._check("split", (), None, 0, "split")
            sub = self._b.split(color, key)
            self._splits += 1
            return Group(
                sub,
                self._name,
                debug=self._debug,
                label=f"split of {self._label} (color={color})",
                check_calls=self._check_calls,
                max_object_bytes=self._max_object_bytes,
                _world=self._world,
                _ident=f"{self._ident}/{self._splits}:{color}",
            )

        return self._submit("split", run, async_op, None, color)

    # -- survivors continue -------------------------------------------------------------
    def agree(self, flag: bool | int = True) -> Any:
        """Fault-tolerant agreement: the AND of ``flag`` over every rank still alive, the
        same on each of them even when ranks fail before or during the call (a bool gives a
        bool; integers in ``[0, 2**32)`` are ANDed bitwise). Every rank must call it; it
        works on a group that already failed, and ranks it finds lost make the group's later
        operations raise until :meth:`shrink`. Raises CommTimeoutError on a rank the others
        gave up on (stopped or cut off past ``MLX_TIMEOUT``); NotSupportedError on a backend
        that cannot (see :attr:`Backend.survives_failures`)."""
        value = _flag(flag)

        def run() -> int:
            if self._size == 1:
                return value
            self._survivable("agree")
            return int(self._b.agree(value)[0])

        agreed = self._submit("agree", run, False)
        return bool(agreed) if isinstance(flag, bool) else agreed

    def shrink(self) -> Group:
        """The world of the ranks still alive, renumbered in their old order: call it on every
        survivor after a failure (a PeerLostError or CommTimeoutError). The survivors first
        agree on who is left (as :meth:`agree`), so they all build the same world even when
        they saw different failures. This world and its splits are closed; split the new one
        again. Raises CommTimeoutError on a rank the others gave up on, NotSupportedError on
        a split (shrink the world) or a backend that cannot."""
        if not self._is_world:
            raise NotSupportedError(
                f"{self._who}: shrink() is called on the world, not on {self._where()}; shrink the world, "
                "then split the new world again"
            )
        if self._size == 1:
            return self
        self._survivable("shrink")
        return self._replace_by(self._submit("shrink", self._b.shrink, False))

    def grow(self) -> Group:
        """Admit the newcomers waiting to join this world (processes that called
        ``mc.init(join=True)``, e.g. replacements ``meshcomm launch --restart-lost`` started):
        the larger world, the old ranks first in their order, the newcomers after them. Every
        rank of the world calls it at a point of its choosing (say, between epochs); with
        nobody waiting it returns this world at once. Like :meth:`shrink` it replaces the
        world (the old one and its splits are closed). A process without the job's secret
        cannot join."""
        if not self._is_world:
            raise NotSupportedError(f"{self._who}: grow() is called on the world, not on {self._where()}")
        if self._size == 1 and not self._b.survives_failures:  # a process on its own: nobody can join it
            return self
        self._survivable("grow")
        backend = self._submit("grow", self._b.grow, False)
        return self if backend is None else self._replace_by(backend)

    def _replace_by(self, backend: Backend) -> Group:
        """The world of ``backend``, in this world's place: this one and its splits closed."""
        root = self._ident.split("/epoch", 1)[0]
        new = Group(
            backend,
            self._name,
            debug=self._debug,
            label=self._label,
            check_calls=self._check_calls,
            max_object_bytes=self._max_object_bytes,
            _ident=world_ident(root, backend),
        )
        with self._world.lock:
            self._closed = self._world.closed = True
        self._world.worker.stop(0.0)
        if self._world.replaced is not None:
            self._world.replaced(self, new)
        return new

    def _survivable(self, op: str) -> None:
        if not self._b.survives_failures:
            raise NotSupportedError(
                f"{self._who}: {op}() needs a backend whose survivors can go on after a failure, and "
                f"{self._name} cannot: {self._b.survival_hint or 'it does not offer agree and shrink'}. "
                "The sockets backend can."
            )

    @overload
    def barrier(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def barrier(self, *, async_op: Literal[True]) -> Work[None]: ...

    @overload
    def barrier(self, *, async_op: bool) -> Work[None] | None: ...

    def barrier(self, *, async_op: bool = False) -> None | Work[None]:
        """Return on each rank only after every rank of the group has entered the barrier."""

        if not async_op and (lane := self._barrier_lane) is not None:
            return lane()
        return self._submit_barrier(async_op)

    def _submit_barrier(self, async_op: bool) -> None | Work[None]:
        """The barrier's pure-Python path (the compiled lane's too, for what it hands back)."""
        return self._submit("barrier", self._barrier_run, async_op)

    def _barrier_run(self) -> None:
        # The call check is an all-reduce, which no rank leaves before every rank entered
        # it: when it runs, it is the barrier.
        if not self._check("barrier", (), None, 0, "barrier"):
            self._moves.barrier()

    # -- reductions ---------------------------------------------------------------------
    def all_sum(self, x: Any, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """Element-wise sum over ranks (integers wrap, bool is logical or); same shape and dtype."""
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.all_sum, x, out=out, async_op=async_op)
        if not async_op and (lane := self._lane) is not None:
            return lane(x, 0) if out is None else lane(x, 0, out)
        return self._all_reduce("sum", x, out, async_op)

    def all_max(self, x: Any, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """Element-wise maximum over ranks."""
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.all_max, x, out=out, async_op=async_op)
        if not async_op and (lane := self._lane) is not None:
            return lane(x, 1) if out is None else lane(x, 1, out)
        return self._all_reduce("max", x, out, async_op)

    def all_min(self, x: Any, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """Element-wise minimum over ranks."""
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.all_min, x, out=out, async_op=async_op)
        if not async_op and (lane := self._lane) is not None:
            return lane(x, 2) if out is None else lane(x, 2, out)
        return self._all_reduce("min", x, out, async_op)

    def _all_reduce(self, op: str, x: Any, out: np.ndarray | None, async_op: bool) -> Any:
        """all_sum, all_max and all_min: the latency path of small calls, so the checks that
        do not apply (no core call check when the backend checks calls in-band) cost no call."""
        name = _ALL_NAMES[op]
        a = as_array(x)
        o = None if out is None else self._out(name, out, a.shape, a.dtype, x, in_place=True)
        send = _flat(a)
        moves = self._moves
        plain = self._plain_reduce
        # a blocking call's new result may be the backend's own kind of array (Backend.empty)
        fresh = moves.empty if not async_op and a.nbytes >= moves.EMPTY_MIN_BYTES else np.empty

        def run() -> np.ndarray:
            if not plain:
                self._check(name, a.shape, a.dtype, 0, "all_reduce")
            elif self._keyed:
                moves.shape_key = 0 if a.ndim == 1 else SHAPE_KEYS[a.shape]
            if o is not None and moves.direct_out:
                res = o
            else:
                res = np.empty(a.shape, a.dtype) if o is not None else fresh(a.shape, a.dtype)
            if a.size:
                moves.all_reduce(send, res if res.ndim == 1 else res.reshape(-1), op)
            if o is None or res is o:
                return res
            o[...] = res
            return o

        return self._submit(name, run, async_op, a)

    def all_reduce_init(self, x: np.ndarray, op: str = "sum", *, out: np.ndarray | None = None) -> Persistent:
        """A persistent all-reduce (``op`` "sum", "max" or "min") of ``x``: checked and set up
        once, then each call of the returned :class:`~meshcomm.api.persistent.Persistent`
        reduces ``x``'s current contents into the same result (``out``, or an array made here).

        ``x`` is read in place at every start, so it must be a C-contiguous NumPy array the
        caller updates in place. No communication happens here.
        """
        who = f"all_reduce_init on rank {self._rank}"
        if type(x) is not np.ndarray:
            raise TypeError(
                f"{who}: x must be a NumPy array (it is read in place at every start), got {type(x).__name__}; "
                "pass an array and update it in place between starts"
            )
        as_array(x)  # a supported dtype
        if not x.flags.c_contiguous:
            raise ValueError(f"{who}: x must be C-contiguous (it is read in place); pass np.ascontiguousarray(x)")
        if op not in REDUCTIONS:
            raise ValueError(f"{who}: unknown op={op!r}; expected one of {', '.join(REDUCTIONS)}")
        if self._closed or self._world.closed:
            raise DistributedError(f"{self._who}: all_reduce_init called on {self._where()} after it was closed")
        o = self._out("all_reduce_init", out, x.shape, x.dtype, x, in_place=True)
        if o is None:
            o = np.empty(x.shape, x.dtype)
        if x.size == 0:
            return Persistent(self._starter, self._who, op, x, o, lambda: None)
        start = self._moves.all_reduce_init(_flat(x), o.reshape(-1), op)
        return Persistent(self._starter, self._who, op, x, o, start)

    def _start_persistent(self, p: Persistent) -> np.ndarray:
        """One start of ``p``, as a collective of this group (guard, numbering, call check)."""
        return self._submit("all_reduce_init", lambda: self._persistent_run(p), False, p.x)

    def _persistent_run(self, p: Persistent) -> np.ndarray:
        """What a start of ``p`` runs inside its guard and numbering (here or in the compiled
        lane): the call check, then the backend's start; returns ``p.out``."""
        # a backend that does not override all_reduce_init runs its all_reduce, which is
        # the method whose in-band check counts
        method = "all_reduce_init" if self._overrides("all_reduce_init") else "all_reduce"
        x = p.x
        self._check("all_reduce_init", x.shape, x.dtype, 0, method, reduction=p.op)
        p._start()
        return p.out

    def reduce(
        self, x: Any, root: int = 0, *, op: str = "sum", out: np.ndarray | None = None, async_op: bool = False
    ) -> Any:
        """The reduction ``op`` ("sum", "max", "min") of every rank's ``x`` on ``root``; None elsewhere.

        Bit-identical to ``all_sum`` & co. on the same inputs (it is the backend's
        all-reduce unless the backend implements ``reduce`` itself with that guarantee).
        """
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.reduce, x, root, op=op, out=out, async_op=async_op)
        a = as_array(x)
        root = self._peer(root, "root", allow_self=True)
        if op not in REDUCTIONS:
            raise ValueError(f"reduce: unknown op={op!r} on rank {self._rank}; expected one of {', '.join(REDUCTIONS)}")
        o = self._out("reduce", out, a.shape, a.dtype, x)
        send = _flat(a)
        me = self._rank == root

        def run() -> np.ndarray | None:
            self._check("reduce", a.shape, a.dtype, root, "reduce", reduction=op)
            if not a.size:
                return self._into(o, a.shape, a.dtype, None) if me else None
            if me:
                return self._into(o, a.shape, a.dtype, lambda buf: self._moves.reduce(send, buf, op, root))
            self._moves.reduce(send, None, op, root)
            return None

        return self._submit("reduce", run, async_op, a)

    def sum_scatter(self, x: Any, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """The sum over ranks split along axis 0; rank r returns block r."""
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.sum_scatter, x, out=out, async_op=async_op)
        a = as_array(x)
        self._divisible("sum_scatter", a)
        shape = (a.shape[0] // self._size, *a.shape[1:])
        o = self._out("sum_scatter", out, shape, a.dtype, x)
        send = _flat(a)

        def run() -> np.ndarray:
            self._check("sum_scatter", a.shape, a.dtype, 0, "reduce_scatter")
            return self._into(
                o, shape, a.dtype, (lambda buf: self._moves.reduce_scatter(send, buf, "sum")) if a.size else None
            )

        return self._submit("sum_scatter", run, async_op, a)

    # -- data movement ------------------------------------------------------------------
    def all_gather(self, x: Any, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """Every rank's ``x`` concatenated along axis 0 in rank order (0-d gives shape ``(size,)``)."""
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.all_gather, x, out=out, async_op=async_op)
        a = as_array(x)
        shape = self._gathered_shape(a)
        o = self._out("all_gather", out, shape, a.dtype, x)
        send = _flat(a)

        def run() -> np.ndarray:
            self._check("all_gather", a.shape, a.dtype, 0, "all_gather")
            return self._into(o, shape, a.dtype, (lambda buf: self._moves.all_gather(send, buf)) if a.size else None)

        return self._submit("all_gather", run, async_op, a)

    def gather(self, x: Any, root: int = 0, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """On ``root``: every rank's ``x`` concatenated along axis 0 in rank order; elsewhere None."""
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.gather, x, root, out=out, async_op=async_op)
        a = as_array(x)
        root = self._peer(root, "root", allow_self=True)
        shape = self._gathered_shape(a)
        o = self._out("gather", out, shape, a.dtype, x)
        send = _flat(a)
        me = self._rank == root

        def run() -> np.ndarray | None:
            self._check("gather", a.shape, a.dtype, root, "gather")
            if me:
                return self._into(
                    o, shape, a.dtype, (lambda buf: self._moves.gather(send, buf, root)) if a.size else None
                )
            if a.size:
                self._moves.gather(send, None, root)
            return None

        return self._submit("gather", run, async_op, a)

    def scatter(self, x: Any, root: int = 0, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """Root's ``x`` split along axis 0 into ``size`` blocks; rank r returns block r.

        Every rank passes an array of the same shape and dtype; only root's contents matter.
        """
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.scatter, x, root, out=out, async_op=async_op)
        a = as_array(x)
        root = self._peer(root, "root", allow_self=True)
        self._divisible("scatter", a)
        shape = (a.shape[0] // self._size, *a.shape[1:])
        o = self._out("scatter", out, shape, a.dtype, x)
        me = self._rank == root
        send = _flat(a) if me else None

        def run() -> np.ndarray:
            self._check("scatter", a.shape, a.dtype, root, "scatter")
            return self._into(o, shape, a.dtype, (lambda buf: self._moves.scatter(send, buf, root)) if a.size else None)

        return self._submit("scatter", run, async_op, a)

    def all_to_all(self, x: Any, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """Block j of this rank's ``x`` (axis 0 in ``size`` blocks) goes to rank j; block i of
        the result comes from rank i. Same shape and dtype as ``x``."""
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.all_to_all, x, out=out, async_op=async_op)
        a = as_array(x)
        self._divisible("all_to_all", a)
        o = self._out("all_to_all", out, a.shape, a.dtype, x)
        send = _flat(a)

        def run() -> np.ndarray:
            self._check("all_to_all", a.shape, a.dtype, 0, "all_to_all")
            return self._into(o, a.shape, a.dtype, (lambda buf: self._moves.all_to_all(send, buf)) if a.size else None)

        return self._submit("all_to_all", run, async_op, a)

    def broadcast(self, x: Any, root: int = 0, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """Root's ``x`` on every rank; other ranks pass an array of the same shape and dtype."""
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.broadcast, x, root, out=out, async_op=async_op)
        a = as_array(x)
        root = self._peer(root, "root", allow_self=True)
        o = self._out("broadcast", out, a.shape, a.dtype, x, in_place=True)
        me = self._rank == root

        def run() -> np.ndarray:
            self._check("broadcast", a.shape, a.dtype, root, "broadcast")
            direct = o is not None and self._moves.direct_out
            buf = o if direct else np.empty(a.shape, a.dtype)
            assert buf is not None
            if me and buf is not a:
                buf[...] = a
            if a.size:
                self._moves.broadcast(buf.reshape(-1), root)
            if o is not None and buf is not o:
                o[...] = buf
                return o
            return buf

        return self._submit("broadcast", run, async_op, a)

    # -- point-to-point -----------------------------------------------------------------
    def send(self, x: Any, dst: int, *, async_op: bool = False) -> Any:
        """Send ``x`` to rank ``dst``; received in order by ``recv``/``recv_like`` from this rank.

        Returns ``x`` itself once it is sent (as MLX's ``send`` returns its array, so code that
        orders work by the returned value ports unchanged); ``Work`` whose ``wait()`` returns
        ``x`` when ``async_op``."""
        a = as_array(x) if type(x) is np.ndarray or result_type(x) is None else as_array(to_numpy(x))
        dst = self._peer(dst, "dst")
        flat = _flat(a)

        def run() -> Any:
            if self._debug:
                _debug.check_send(self._b, self._where(), a.shape, flat.dtype, dst)
            self._b.send(flat, dst)
            return x

        return self._submit("send", run, async_op, a, dst)

    def recv(self, shape: Any, dtype: Any, src: int, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """Receive a new array of ``shape`` and ``dtype`` from rank ``src`` (or into ``out``)."""
        shp = _shape(shape)
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"recv: dtype {dtype!r} is not a NumPy dtype") from None
        check_dtype(dt, what="recv")
        src = self._peer(src, "src")
        o = self._out("recv", out, shp, dt, None)

        def run() -> np.ndarray:
            if self._debug:
                _debug.check_recv(self._b, self._where(), shp, dt, src)
            return self._into(o, shp, dt, lambda buf: self._b.recv(buf, src))

        return self._submit("recv", run, async_op, (shp, dt), src)

    def recv_like(self, x: Any, src: int, *, out: np.ndarray | None = None, async_op: bool = False) -> Any:
        """Receive an array shaped and typed like ``x`` from rank ``src``."""
        if type(x) is not np.ndarray and (back := result_type(x)) is not None:
            return self._foreign(back, self.recv_like, x, src, out=out, async_op=async_op)
        a = np.asarray(x)
        return self.recv(a.shape, a.dtype, src, out=out, async_op=async_op)

    # -- Python objects -------------------------------------------------------------------
    def all_gather_object(self, obj: Any, *, async_op: bool = False) -> Any:
        """Every rank's picklable ``obj``, in rank order (a list of unpickled copies).

        Uses pickle, which runs code when loading: only for ranks of one job that trust
        each other, over authenticated transports.
        """
        op = "all_gather_object"
        data, failure = objects.dumps(obj)
        limit = self._object_limit()
        seal = self._object_seal(op)

        def run() -> list[Any]:
            self._check(op, (), None, 0, None)
            self._object_calls += 1
            mine = np.array([objects.size_code(data, failure), limit], np.int64)
            table = np.empty(2 * self._size, np.int64)
            self._moves.all_gather(mine, table)
            sizes = self._object_sizes(op, table.reshape(self._size, 2), failure, None)
            sealed = seal.seal(self._ident, self._object_calls, self._rank, data)
            width = max(sizes) + seal.tag_bytes
            pad = np.zeros(width, np.uint8)
            pad[: len(sealed)] = np.frombuffer(sealed, np.uint8)
            every = np.empty(width * self._size, np.uint8)
            self._moves.all_gather(pad, every)
            got = [
                seal.open(
                    self._ident,
                    self._object_calls,
                    q,
                    every[q * width : q * width + sizes[q] + seal.tag_bytes].tobytes(),
                    self._who,
                    op,
                )
                for q in range(self._size)
            ]  # every payload checked before any is unpickled
            return [objects.loads(d, q, op, self._who) for q, d in enumerate(got)]

        return self._submit("all_gather_object", run, async_op, data)

    def broadcast_object(self, obj: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Root's picklable ``obj`` on every rank (other ranks pass anything, e.g. None).

        The root gets its own object back; the others an unpickled copy. Uses pickle,
        which runs code when loading: only for ranks of one job that trust each other.
        """
        op = "broadcast_object"
        root = self._peer(root, "root", allow_self=True)
        me = self._rank == root
        data, failure = objects.dumps(obj) if me else (b"", None)
        limit = self._object_limit()
        seal = self._object_seal(op)

        def run() -> Any:
            self._check(op, (), None, root, None)
            self._object_calls += 1
            mine = np.array([objects.size_code(data, failure) if me else 0, limit], np.int64)
            table = np.empty(2 * self._size, np.int64)
            self._moves.all_gather(mine, table)
            size = self._object_sizes(op, table.reshape(self._size, 2), failure, root)[root] + seal.tag_bytes
            if me:
                buf = np.frombuffer(seal.seal(self._ident, self._object_calls, root, data), np.uint8).copy()
            else:
                buf = np.empty(size, np.uint8)
            self._moves.broadcast(buf, root)
            if me:
                return obj
            got = seal.open(self._ident, self._object_calls, root, buf.tobytes(), self._who, op)
            return objects.loads(got, root, op, self._who)

        return self._submit("broadcast_object", run, async_op, data)

    def _object_seal(self, op: str) -> ObjectSeal:
        """This process's object seal (from the job secret); refuses, before any
        communication, when nothing would authenticate other ranks' objects."""
        if self._seal is None:
            self._seal = ObjectSeal.for_job(
                in_process=bool(getattr(self._b, "in_process", False)), local_key=getattr(self._b, "local_key", None)
            )
        if self._size > 1:
            self._seal.require(self._who, op)
        return self._seal

    def _object_limit(self) -> int:
        if self._max_object_bytes is None:
            from ..runtime.config import Config

            self._max_object_bytes = int(getattr(Config(), "max_object_bytes", DEFAULT_MAX_OBJECT_BYTES))
        return self._max_object_bytes

    def _object_sizes(self, op: str, table: np.ndarray, failure: BaseException | None, root: int | None) -> list[int]:
        """Every rank's pickled size from the (size, limit) table, or the same ValueError on
        every rank when one could not pickle or one object exceeds the smallest limit."""
        limit = int(table[:, 1].min())
        ranks = range(len(table)) if root is None else [root]
        for q in ranks:
            size = int(table[q, 0])
            if size == objects.UNPICKLABLE:
                if q == self._rank and failure is not None:
                    raise ValueError(
                        f"{self._who}: {op}: the object cannot be pickled: {type(failure).__name__}: {failure}"
                    ) from failure
                raise ValueError(
                    f"{self._who}: {op}: rank {q}'s object cannot be pickled (rank {q} raises the details)"
                )
            if size > limit:
                raise ValueError(
                    f"{self._who}: {op}: rank {q}'s object is {size} bytes pickled, more than the limit of "
                    f"{limit} bytes (MESHCOMM_MAX_OBJECT_BYTES, smallest on any rank); raise the "
                    "setting, or send large data as arrays"
                )
        return [int(s) for s in table[:, 0]]

    # -- helpers ------------------------------------------------------------------------
    def _foreign(
        self,
        back: Callable[[np.ndarray], Any],
        method: Callable[..., Any],
        x: Any,
        *args: Any,
        out: Any = None,
        async_op: bool = False,
        **kw: Any,
    ) -> Any:
        """``method`` on a torch/MLX/JAX array ``x`` (read as NumPy, without a copy where its
        framework allows), its result given back in ``x``'s framework (an ``out=`` of that
        framework is written in place and returned as given)."""
        a = to_numpy(x)
        given = out
        if out is not None and type(out) is not np.ndarray:
            out = to_numpy(out, "out")
            if not out.flags.writeable:
                raise ValueError(
                    f"{self._who}: out= is a {type(given).__name__}, whose memory cannot be written "
                    "in place (MLX and JAX arrays are immutable): leave out= out and use the result"
                )
        res = method(a, *args, out=out, async_op=async_op, **kw)
        if async_op:
            return MappedWork(res, (lambda r: given) if given is not None else back)
        if res is None:
            return None
        return given if given is not None else back(res)

    def _where(self) -> str:
        return f"the {self._label} group on {self._name!r}"

    def _peer(self, value: Any, what: str, *, allow_self: bool = False) -> int:
        peer = _index(value, what)
        if self._size == 1 and not allow_self:
            alone = (
                " This process runs alone (nothing started it as one rank of a job): start several "
                "ranks with 'meshcomm launch -n N program.py', or mpirun/srun/torchrun (docs/launch.md)"
                if self._label == "world"
                else ""
            )
            raise ValueError(f"cannot use {what}={peer} in a group of size 1: there is no other rank.{alone}")
        if not 0 <= peer < self._size:
            raise ValueError(
                f"invalid {what}={peer} for a group of size {self._size} (rank {self._rank}); "
                f"expected 0 <= {what} < {self._size}"
            )
        if peer == self._rank and not allow_self:
            raise ValueError(f"rank {self._rank} cannot {'send to' if what == 'dst' else 'receive from'} itself")
        return peer

    def _divisible(self, op: str, a: np.ndarray) -> None:
        if a.ndim == 0 or a.shape[0] % self._size:
            raise ValueError(
                f"{op}: invalid shape {a.shape} on rank {self._rank} for a group of size {self._size}: "
                f"axis 0 must be divisible by {self._size}"
            )

    def _gathered_shape(self, a: np.ndarray) -> tuple[int, ...]:
        return (self._size,) if a.ndim == 0 else (self._size * a.shape[0], *a.shape[1:])

    def _out(
        self, op: str, out: Any, shape: tuple[int, ...], dtype: np.dtype, x: Any, *, in_place: bool = False
    ) -> np.ndarray | None:
        """``out`` if it can take the result (exact shape and dtype, C-contiguous, writable,
        not overlapping ``x`` unless ``in_place`` allows ``out=x``: ``x`` itself or another view of
        exactly its memory, such as ``t.numpy()`` of the tensor passed as ``x``), else a ValueError."""
        if out is None:
            return None

        def fix() -> str:  # built only for an error: a dtype's name costs microseconds
            return f"pass out=np.empty({tuple(shape)}, dtype=np.{np.dtype(dtype).name}) or leave out=None"

        if not isinstance(out, np.ndarray):
            raise ValueError(f"{op}: out must be a NumPy array on rank {self._rank}, got {type(out).__name__}; {fix()}")
        if out.shape != tuple(shape) or out.dtype != dtype:
            raise ValueError(
                f"{op}: out has shape {out.shape} and dtype {out.dtype} on rank {self._rank}, but the "
                f"result has shape {tuple(shape)} and dtype {np.dtype(dtype)}; {fix()}"
            )
        if not out.flags.c_contiguous:
            raise ValueError(f"{op}: out is not C-contiguous on rank {self._rank}; {fix()}")
        if not out.flags.writeable:
            raise ValueError(f"{op}: out is read-only on rank {self._rank}; {fix()}")
        if out is x or (isinstance(x, np.ndarray) and _same_array(out, x)):
            if not in_place:
                raise ValueError(
                    f"{op}: out cannot be x itself (only all_sum, all_max, all_min and broadcast "
                    f"work in place); {fix()}"
                )
        elif isinstance(x, np.ndarray) and np.may_share_memory(out, x):
            raise ValueError(
                f"{op}: out overlaps x on rank {self._rank}; "
                f"{'pass out=x itself or ' if in_place else ''}use a separate array"
            )
        return out

    def _into(
        self, o: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype, fill: Callable[[np.ndarray], None] | None
    ) -> np.ndarray:
        """Run ``fill(buf)`` on a flat receive buffer: ``out`` itself when the backend takes
        callers' buffers (``direct_out``), else a fresh array (copied into ``out`` if given)."""
        if o is not None and self._moves.direct_out:
            if fill is not None:
                fill(o.reshape(-1))
            return o
        res = np.empty(shape, dtype)
        if fill is not None:
            fill(res.reshape(-1))
        if o is None:
            return res
        o[...] = res
        return o

    def _natively_checked(self, method: str | None) -> bool:
        """True when the backend itself checks ``method``'s calls (it says so, and overrides it)."""
        return self._b.checks_calls and self._overrides(method)

    def _overrides(self, method: str | None) -> bool:
        """True when the backend implements ``method`` itself (not the generic default)."""
        if method is None:
            return False
        known = self._native.get(method)
        if known is None:
            known = self._native[method] = getattr(type(self._b), method, None) is not getattr(Backend, method, None)
        return known

    def _check(
        self,
        op: str,
        shape: tuple[int, ...],
        dtype: np.dtype | None,
        arg: int,
        method: str | None,
        *,
        reduction: str | None = None,
    ) -> bool:
        """The cross-rank call check of ``op`` (full under MLX_DEBUG, else the quick one unless
        the backend checks ``method`` in-band); True if a check ran (a check is a barrier).
        A backend that checks calls in-band is given the shape's key first (Backend.shape_key)."""
        if self._keyed:
            self._moves.shape_key = SHAPE_KEYS[shape]
        if self._size > 1 and (self._debug or (self._check_calls and not self._natively_checked(method))):
            # the backend sends the key with the data; a call of no elements never reaches the
            # backend (it would drop the key unchecked), so it is checked apart
            if self._piped and self._overrides(method) and 0 not in shape:
                self._moves.call_key = _debug.call_key(op, shape, dtype, arg, reduction=reduction)
                self._in_flight = (op, shape, dtype, arg, reduction)
                return False
            check = _debug.check_collective if self._debug else _debug.quick_check
            self._b.user_step = "the call check"  # messages name the user's call, not the check's all-reduce
            try:
                check(self._b, self._where(), op, shape, dtype, arg, reduction=reduction)
            finally:
                self._b.user_step = ""
            return True
        return False

    def _submit(
        self, op: str, run: Callable[[], T], async_op: bool, payload: _observer.Payload = None, arg: int = -1
    ) -> Any:
        """Issue ``op``: refused on a closed group or from a second thread; then ``run()`` here,
        or on the world's worker when ``async_op`` (a handle is returned) or when earlier
        asynchronous operations are still queued (the call then waits for its turn).

        ``payload`` and ``arg`` describe the operation to the recorder, which only reads them
        when tracing or the stall inspector is on: what this rank passes (see
        :data:`meshcomm.api.observer.Payload`), and the peer of ``send``/``recv`` or the
        color of ``split``. Callers pass values they already hold (only ``recv`` pairs its
        shape and dtype), so with the recorder off they cost two passed arguments.
        """
        if self._closed or self._world.closed:
            raise DistributedError(
                f"{self._who}: {op} called on {self._where()} after it was closed"
                f"{'' if self._closed else ' (the world it was split from was closed)'}; "
                "make every call before close(), or start a new world with meshcomm.init()"
            )
        ticket = self._guard.enter(op, self._who)
        worker = self._world.worker
        if not async_op and not worker.pending():
            return self._execute(op, ticket, run, payload, arg)
        work: Work[T] = Work(op, self._who)
        worker.submit(work, lambda: self._execute(op, ticket, run, payload, arg))
        return work if async_op else work.wait()

    def _execute(self, op: str, ticket: Ticket, run: Callable[[], T], payload: _observer.Payload, arg: int) -> T:
        """``run()`` as operation ``op``, with unexpected exceptions turned into a
        DistributedError naming the rank; then the guard lets the world go."""
        if op == "send":
            n = self._sent[arg] = self._sent.get(arg, 0) + 1
        elif op == "recv":
            n = self._received[arg] = self._received.get(arg, 0) + 1
        else:
            n = self._calls = self._calls + 1
        b = self._b
        b.user_op = op
        b.user_no = n
        ok = False
        try:
            result = run() if _observer.active is None else _observer.active.call(self, op, run, payload, arg, n)
            ok = True
            return result
        except CallsDiffer as exc:
            raise self._calls_differ(exc) from None
        except (DistributedError, ValueError, TypeError):
            raise
        except Exception as exc:
            raise self._unexpected(op, exc) from exc
        finally:
            if self._piped:  # a key no collective carried (an argument error) must not reach the next call
                self._moves.call_key = None
            self._guard.leave(ticket, op, self._who, ok)

    def _calls_differ(self, exc: CallsDiffer) -> DistributedError:
        """What to raise when the backend found that the ranks' calls differ (every rank
        raises it at this call): the comparison of what each called, when the core's key
        went with the data, else the backend's own error."""
        if self._in_flight is None:
            return exc
        op, shape, dtype, arg, reduction = self._in_flight
        return _debug.name_mismatch(self._b, exc, self._where(), op, shape, dtype, arg, reduction=reduction)

    def _unexpected(self, op: str, exc: Exception) -> DistributedError:
        """An exception no layer expected, as a DistributedError naming the rank."""
        return DistributedError(f"{self._who}: {op} failed: {type(exc).__name__}: {exc}")


def world_ident(root: str, backend: Backend) -> str:
    """A world's name for sealed object payloads, the same on all its ranks: ``root`` names
    the job's world (``sockets/world1``), the backend's epoch how often it was rebuilt, so a
    newcomer's world is named as the others' (``sockets/world1/epoch2``)."""
    return f"{root}/epoch{backend.epoch}" if backend.epoch else root


def _flag(flag: Any) -> int:
    """``agree``'s flag as an unsigned 32-bit integer (ValueError/TypeError otherwise)."""
    if isinstance(flag, (bool, np.bool_)):
        return int(bool(flag))
    value = _index(flag, "agree's flag")
    if not 0 <= value < 1 << 32:
        raise ValueError(f"agree: flag {value} is outside [0, 2**32); pass a bool or a 32-bit unsigned integer")
    return value


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    if not isinstance(shape, Sequence) and not isinstance(shape, np.ndarray):
        raise TypeError(f"recv: shape must be a tuple of integers, got {shape!r}")
    dims = tuple(_index(d, "shape entry") for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"recv: shape {dims} has a negative dimension")
    return dims
