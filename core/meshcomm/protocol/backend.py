"""The backend protocol: what a transport implements, on contiguous 1-D NumPy buffers.

A backend must implement ``rank``, ``size``, ``send`` and ``recv``. Everything else
has a default built from those (the generic algorithms in :mod:`meshcomm.protocol.algorithms`),
so a point-to-point transport gets every collective, ``split`` and ``barrier`` for
free; a transport with native collectives overrides the methods it does better.

Rules every method may rely on (the core enforces them before calling):

* buffers are C-contiguous, one-dimensional NumPy arrays of a supported dtype;
* send buffers are read-only for the backend; receive buffers are fresh and may be
  written anywhere;
* sizes agree with the contract (``all_gather``: ``len(recv) == size * len(send)``;
  ``reduce_scatter``: ``len(send) == size * len(recv)``);
* ranks are valid and a rank never sends to itself.

Errors: raise :class:`meshcomm.PeerLostError` when a peer goes away and
:class:`meshcomm.CommTimeoutError` when it does not answer within ``timeout``
seconds. Anything else that escapes is wrapped in a :class:`meshcomm.DistributedError`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable

import numpy as np

from . import algorithms
from .errors import NotSupportedError
from .timeouts import DEFAULT_TIMEOUT

__all__ = ["Backend", "SubgroupBackend", "in_place", "shape_key", "SHAPE_KEYS", "DEFAULT_TIMEOUT"]


class _ShapeKeys(dict):
    """shape -> :attr:`Backend.shape_key`, computed on first sight: ``SHAPE_KEYS[a.shape]``
    is one dict lookup on the latency path (~50 ns), the hash runs once per distinct shape."""

    def __missing__(self, shape: tuple[int, ...]) -> int:
        if len(self) >= 4096:  # a program cycling through shapes: start over, never grow
            self.clear()
        key = self[shape] = shape_key(shape)
        return key


def shape_key(shape: tuple[int, ...]) -> int:
    """:attr:`Backend.shape_key` of ``shape``: 0 for 1-D shapes (their length is the element
    count the transport compares anyway), else a 23-bit number, never 0, that differs for
    shapes of the same element count (``()`` vs ``(1,)``, ``(2, 3)`` vs ``(3, 2)``) except
    by a 1 in 8 million chance. The same on every rank and Python version."""
    if len(shape) == 1:
        return 0
    h = len(shape) + 0x9E3779B1
    for d in shape:
        h = ((h ^ d) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return ((h ^ (h >> 29)) & 0x7FFFFF) or 1


#: the keys of the shapes seen so far (what the core reads before each collective)
SHAPE_KEYS: dict[tuple[int, ...], int] = _ShapeKeys()


class Backend(abc.ABC):
    """Base class of every transport. Subclass it and implement the four abstract methods."""

    #: seconds a blocking call waits on a peer before raising CommTimeoutError
    timeout: float = DEFAULT_TIMEOUT

    #: True when the transport itself compares every collective's op, dtype, length and
    #: root across ranks (raising CollectiveMismatchError). When False the core does it
    #: with one small all_reduce before each collective (``MESHCOMM_CHECK_CALLS``). The
    #: core checks an operation itself whenever it runs on an inherited default method
    #: (built from send/recv, which an in-band check cannot tell apart), so a backend
    #: only vouches for the methods it overrides.
    checks_calls: bool = False

    #: True when :meth:`agree` and :meth:`shrink` work: survivors of a failure can agree on
    #: who is left and go on in a smaller world
    survives_failures: bool = False
    #: when :attr:`survives_failures` is False: what is missing, for the error users see
    survival_hint: str = ""
    #: how many times the job's world was rebuilt (shrink, grow) before this one: the same on
    #: every rank of a world, a newcomer's too
    epoch: int = 0

    #: True when the transport carries the core's call check with the data instead of the
    #: core running it as a separate all-reduce before each collective: before a collective
    #: the backend overrides, the core sets :attr:`call_key`; the backend reduces it (max)
    #: alongside the operation (e.g. both non-blocking), compares the result with its own
    #: key before it waits for the data, and raises :class:`CallsDiffer` when they differ.
    #: The check costs the overlap of two operations instead of a second round trip.
    pipelines_calls: bool = False

    #: Set by the core before a collective on a backend that ``pipelines_calls``: a read-only
    #: int64 array [h, -h] for a hash h of the user's call (op, shape, dtype, root). The
    #: ranks made the same call exactly when the element-wise max over ranks equals it. The
    #: backend sends it with the next collective it runs and sets it back to None; None
    #: means no check for this call.
    call_key: np.ndarray | None = None

    #: Set by the core before each collective on a backend that ``checks_calls``: a number
    #: that tells apart two shapes of the same element count (0 for 1-D arrays, else
    #: :func:`shape_key` of the caller's shape, below 2**23). The backend sees flat buffers
    #: only, so without it a (2, 3) and a (3, 2) array would meet as 6 elements and each rank
    #: reinterpret the other's data; an in-band check must compare it with op, dtype and length.
    shape_key: int = 0

    #: Set by the core before each operation, for error messages: the user's call in flight
    #: (``user_op``, e.g. "all_sum") and its number (``user_no``: collectives counted per
    #: group, sends and receives per pair of ranks, from 1, as the trace numbers them), and
    #: ``user_step`` = "the call check" while the core's cross-rank check of it runs. Name the
    #: operation with :meth:`call_text`: users never see a backend's own numbering, which
    #: counts meshcomm's internal calls too. ``user_op`` is "" outside the core (start-up, or
    #: a backend driven directly).
    user_op: str = ""
    user_no: int = 0
    user_step: str = ""

    #: True only when every rank is a thread of this one process (a test transport): no
    #: other process can be on its links, so object payloads need no job secret.
    in_process: bool = False

    #: The per-user key (:mod:`meshcomm.runtime.userkey`) when the transport authenticated with it
    #: because the job has no MESHCOMM_JOB_SECRET; the core then seals objects with it.
    local_key: bytes | None = None

    #: True when receive buffers may be the caller's own ``out=`` array instead of a fresh
    #: one: written in place, possibly the *same memory* as the send buffer (``all_reduce``
    #: and ``broadcast`` with ``out=x``), and left undefined if the call fails. When False
    #: (the default, so existing transports need no change) the core receives into a fresh
    #: buffer and copies the result into ``out``. The generic algorithms allow it.
    direct_out: bool = False

    def call_text(self, internal: str) -> str:
        """The operation in flight as a user should read it: the user's call and number
        (``all_sum #2``), naming the backend's own step ``internal`` when it is another
        operation (``all_gather_object #1 (its all_gather)``, ``all_sum #2 (the call check
        before it)``); just ``internal`` when no user call is known."""
        op = self.user_op
        if not op:
            return internal
        if self.user_step:
            return f"{op} #{self.user_no} ({self.user_step} before it)"
        if internal.split(" ", 1)[0] in (op, ""):
            return f"{op} #{self.user_no}"
        return f"{op} #{self.user_no} (its {internal.split(' #', 1)[0]})"

    # -- required -------------------------------------------------------------------
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank in ``[0, size)``."""

    @abc.abstractmethod
    def size(self) -> int:
        """Number of ranks in the group."""

    @abc.abstractmethod
    def send(self, buf: np.ndarray, dst: int) -> None:
        """Send all of ``buf`` to rank ``dst``; messages between two ranks arrive in order."""

    @abc.abstractmethod
    def recv(self, buf: np.ndarray, src: int) -> None:
        """Fill ``buf`` with the next message from rank ``src`` (its length is known)."""

    # -- point-to-point with a default -------------------------------------------------
    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None:
        """Send to ``dst`` and receive from ``src`` at the same time (no deadlock if both block).

        The default sends on a helper thread; override it when the transport can do
        both without a thread. An error on the helper thread is raised here.
        """
        errors: list[BaseException] = []

        def _send() -> None:
            try:
                self.send(sendbuf, dst)
            except BaseException as exc:  # handed to the caller below
                errors.append(exc)

        t = threading.Thread(target=_send, name="meshcomm-sendrecv", daemon=True)
        t.start()
        try:
            self.recv(recvbuf, src)
        finally:
            t.join()
        if errors:
            raise errors[0]

    #: results of at least this many bytes are allocated with :meth:`empty`; smaller ones
    #: with ``np.empty`` (the core skips the method call on small, latency-bound calls). A
    #: backend whose :meth:`empty` only matters from some larger size raises it (a class
    #: constant: the compiled call path reads it once per group)
    EMPTY_MIN_BYTES = 256 * 1024

    #: An entry the core's compiled call path calls before :meth:`all_reduce` for a blocking
    #: ``all_sum`` into a new result or the caller's ``out=`` array, which never overlaps
    #: the input (shape key set, result made): ``sum_now(sendbuf, recvbuf)`` returns True
    #: when it did that sum, False when it does not apply and has sent
    #: nothing (the core then calls ``all_reduce``). For a transport whose small sums have a
    #: shorter way than its general all_reduce (the sockets backend: one call into its compiled
    #: shared-memory step). None: always ``all_reduce``.
    sum_now: Callable[[np.ndarray, np.ndarray], bool] | None = None

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A new array for the result of an ``all_reduce`` that the core returns to the
        caller (its receive buffer, flattened); the core calls it for results of at least
        :attr:`EMPTY_MIN_BYTES`. The default is ``np.empty``; a transport may place the
        result where its peers can write into it (the sockets backend: shared memory). It
        must be a writable C-contiguous array the caller may keep and use like any other."""
        return np.empty(shape, dtype)

    # -- collectives with generic defaults -----------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """``recvbuf`` = reduction ``op`` ("sum", "max", "min") of every rank's ``sendbuf``.

        Every rank must end with bit-identical bytes.
        """
        algorithms.all_reduce(self, sendbuf, recvbuf, op)

    def check_key(self, key: np.ndarray, out: np.ndarray) -> None:
        """The core's call check: ``out`` = the element-wise max over ranks of ``key`` (int64
        [h, -h] for a hash h of this rank's call). The default is :meth:`all_reduce`; a
        transport whose every collective costs a slow round may carry it on a cheaper channel
        of its own (gloo does), as long as a rank that waits in it past the timeout raises."""
        self.all_reduce(key, out, "max")

    def all_reduce_init(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> Callable[[], None]:
        """A persistent all-reduce: set up once, then each call of the returned ``start()``
        runs one ``all_reduce`` of ``sendbuf``'s current contents into ``recvbuf`` (the same
        buffers every time). The core sets :attr:`call_key` or :attr:`shape_key` before each
        start as before an ``all_reduce``. The default calls :meth:`all_reduce`; a transport
        with persistent operations (MPI's ``MPI_Allreduce_init``) sets them up here, and may
        give ``start`` a ``close()`` method, which the core calls once when the user closes it.
        """

        def start() -> None:
            self.all_reduce(sendbuf, recvbuf, op)

        return start

    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """``recvbuf`` = every rank's ``sendbuf`` concatenated in rank order."""
        algorithms.all_gather(self, sendbuf, recvbuf)

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """``recvbuf`` = block ``rank`` of the reduction of every rank's ``sendbuf``."""
        algorithms.reduce_scatter(self, sendbuf, recvbuf, op)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Every rank's ``buf`` becomes root's ``buf`` (written in place on non-roots)."""
        algorithms.broadcast(self, buf, root)

    def all_to_all(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """Block j of ``sendbuf`` goes to rank j; block i of ``recvbuf`` comes from rank i.

        Both have ``size * m`` elements (``m`` may be 0).
        """
        algorithms.all_to_all(self, sendbuf, recvbuf)

    def gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> None:
        """On ``root``, ``recvbuf`` = every rank's ``sendbuf`` in rank order; elsewhere it is None."""
        algorithms.gather(self, sendbuf, recvbuf, root)

    def scatter(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> None:
        """``recvbuf`` of rank r = block r of root's ``sendbuf`` (None on other ranks)."""
        algorithms.scatter(self, sendbuf, recvbuf, root)

    def reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, op: str, root: int) -> None:
        """On ``root``, ``recvbuf`` = reduction ``op`` of every rank's ``sendbuf`` (None elsewhere).

        The result must be bit-identical to what :meth:`all_reduce` gives; the default
        runs ``all_reduce`` and keeps the root's copy.
        """
        algorithms.reduce(self, sendbuf, recvbuf, op, root)

    def barrier(self) -> None:
        """Return only once every rank has entered the barrier."""
        algorithms.barrier(self)

    def split(self, color: int, key: int) -> Backend:
        """The backend of the subgroup of ranks sharing ``color``, ordered by (key, rank):
        by default a :class:`SubgroupBackend` over this backend's links."""
        return SubgroupBackend(self, algorithms.split_members(self, color, key))

    def agree(self, flag: int) -> tuple[int, frozenset[int]]:
        """Fault-tolerant agreement: the bitwise AND of ``flag`` (0 <= flag < 2**32) over the
        ranks still alive, and the set of ranks this call found lost, the same on every
        survivor even when they saw different failures. Works on a group that failed. The
        default raises :class:`NotSupportedError`: a transport that offers it says so with
        :attr:`survives_failures`."""
        raise NotSupportedError(f"the {type(self).__name__} transport cannot agree across a failure")

    def shrink(self) -> Backend:
        """A new world of the ranks still alive (agreed as in :meth:`agree`), renumbered in
        their old order; this backend is spent. Only on a world, not on a split of one. The
        default raises :class:`NotSupportedError`."""
        raise NotSupportedError(f"the {type(self).__name__} transport cannot shrink a group after a failure")

    def grow(self) -> Backend | None:
        """Admit the newcomers waiting to join (processes started with ``join=True``): the
        larger world, old ranks first in their order, or None when nobody waits (this world
        goes on). Every rank of a world calls it; this backend is spent when it returns a
        world. The default raises :class:`NotSupportedError`."""
        raise NotSupportedError(f"the {type(self).__name__} transport cannot admit new ranks")

    def abort(self, code: int, reason: str) -> None:
        """This rank's program failed (an uncaught exception, or exit code ``code``).

        Tell the peers, so that each raises PeerLostError naming this rank, and end the job
        with ``code`` if the transport needs that (MPI: MPI_Abort). Called once, on the way
        out, by the core's exit handling. The default does nothing: the process exits and
        the peers see its connections close.
        """
        return None

    def close(self) -> None:
        """Release connections and threads; called once, when the group is destroyed."""
        return None


class SubgroupBackend(Backend):
    """Ranks ``members`` of ``parent`` as a group of their own; collectives come from the
    generic algorithms over the parent's send/recv, with ranks translated."""

    #: the generic algorithms accept the caller's out= buffers (see Backend.direct_out)
    direct_out = True

    def __init__(self, parent: Backend, members: list[int]) -> None:
        self.parent = parent
        self.members = list(members)
        self._rank = self.members.index(parent.rank())
        self.timeout = parent.timeout

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.members)

    def send(self, buf: np.ndarray, dst: int) -> None:
        self.parent.send(buf, self.members[dst])

    def recv(self, buf: np.ndarray, src: int) -> None:
        self.parent.recv(buf, self.members[src])

    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None:
        self.parent.sendrecv(sendbuf, self.members[dst], recvbuf, self.members[src])


def in_place(sendbuf: np.ndarray, recvbuf: np.ndarray) -> bool:
    """True when a ``direct_out`` backend was handed ``out=x``: the receive buffer *is* the
    send buffer (the core allows no other overlap), so the transport must work in place
    (MPI_IN_PLACE, no copy of the input into the output). Bounds first: reading an
    array's address costs microseconds, far more than most calls can spare."""
    return bool(np.may_share_memory(sendbuf, recvbuf)) and sendbuf.ctypes.data == recvbuf.ctypes.data
