"""Which algorithm Open MPI's non-blocking all-reduce runs, chosen per call.

Open MPI runs ``MPI_Iallreduce`` in its ``coll/libnbc`` component, whose own choice has two
faults that meshcomm works around by choosing for it:

* **Speed.** On fewer than 4 ranks libnbc always picks a binomial tree, in which every
  rank reduces the whole array: on 2 ranks that runs at 1.1–1.3× the blocking
  ``MPI_Allreduce`` from 4 KiB up. Its ring algorithm (a reduce-scatter, then an
  all-gather) shares the reduction out and runs at 0.55–0.85× of it from 32 KiB on 2 ranks
  and from about 256 KiB on 4 (docs/backends/mpi.md, "Performance"). Below 64 KiB the
  backend starts persistent operations instead (backend.PLANNED_MAX), which take the
  library's choice.
* **Correctness.** On 4 or more ranks from 64 KiB up libnbc picks the binomial tree where
  the call is in place (``MPI_IN_PLACE``) and Rabenseifner's algorithm where it is not. MPI
  requires in place on all ranks or none, but meshcomm lets each rank pass ``out=x`` or not,
  and ranks running different algorithms sum unrelated pieces (seen: NaNs, then glibc's
  "double free or corruption").

The algorithm is one process-wide MCA variable (``coll_libnbc_iallreduce_algorithm``),
read when an all-reduce starts, which MPI's tool interface (MPI_T) may change between
calls. :class:`AllreduceStarter` sets it for the one start that needs it (ring from the
threshold up; where libnbc's own choice would depend on in place, the binomial tree below
256 KiB, the faster one there on 4 ranks, and Rabenseifner's from 256 KiB) and puts
it back at once, under one process-wide lock, so that no other start in the process
runs under a setting meant for another. The choice depends only on the byte count and the
number of ranks, which every rank of a matching call shares.

Where the variable cannot be switched (another MPI, no MPI_T, the user's own choice of
algorithm, MESHCOMM_MPI_RING_FROM=off), every all-reduce runs under the library's choice and
:attr:`AllreduceStarter.in_place` is False: the backend then never passes ``MPI_IN_PLACE``.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

__all__ = ["AllreduceStarter", "ring_threshold", "algorithm_for"]

_VARIABLE = b"coll_libnbc_iallreduce_algorithm"
_LIBRARY_CHOICE, _RING, _BINOMIAL, _RABENSEIFNER = 0, 1, 2, 3
#: from this many bytes on 4+ ranks libnbc's own choice depends on MPI_IN_PLACE
_IN_PLACE_MATTERS_FROM = 65536
#: below this many bytes (and the ring threshold) 4+ ranks run the binomial tree, from it
#: Rabenseifner's: on 4 ranks binomial took 76-77 us at 64 KiB and 123-130 at 128 KiB
#: against Rabenseifner's 115-159 and 132-165 (raw Iallreduce + test loop); from 256 KiB the
#: two were alike, and from 512 KiB ring and Rabenseifner's were faster
_BINOMIAL_BELOW = 256 << 10
#: smallest array (bytes) that uses ring on 2 ranks: below it the persistent operations
#: (backend.PLANNED_MAX) are faster through meshcomm (4-32 KiB: 11-23 against 21-31 us),
#: at 64 KiB the two measured alike (raw Iallreduce, ring: 0.84x blocking at 32 KiB, 0.79x
#: at 128 KiB; binomial 1.13x and 1.17x)
_RING_FROM_2 = 64 << 10
#: per rank, on 3 or more (measured on 4: ring 1.02× at 256 KiB, 0.78× from 1 MiB; on 3:
#: 0.73× at 256 KiB, 0.91× at 128 KiB where binomial gives 0.70×)
_RING_FROM_PER_RANK = 65536


def ring_threshold(size: int, setting: str | int) -> int | None:
    """Bytes from which an all-reduce on ``size`` ranks uses ring (None: never).

    ``setting`` is MESHCOMM_MPI_RING_FROM: ``"auto"`` (64 KiB on 2 ranks, 64 KiB per rank on
    more), ``"off"``, or a byte count.
    """
    if size < 2 or setting == "off":
        return None
    if setting == "auto":
        return _RING_FROM_2 if size == 2 else _RING_FROM_PER_RANK * size
    return int(setting)


def algorithm_for(size: int, nbytes: int, ring_from: int) -> int:
    """libnbc's algorithm code (0: its own choice) for an all-reduce of ``nbytes`` on ``size``
    ranks, ring from ``ring_from`` bytes: on 4+ ranks from 64 KiB a fixed choice, so that
    ranks that differ in passing MPI_IN_PLACE run the same algorithm."""
    if nbytes >= ring_from:
        return _RING
    if size >= 4 and nbytes >= _IN_PLACE_MATTERS_FROM:
        return _BINOMIAL if nbytes < _BINOMIAL_BELOW else _RABENSEIFNER
    return _LIBRARY_CHOICE


class _Variable:
    """The MCA variable through MPI_T: one handle, written only when the value changes."""

    def __init__(self, lib: Any, handle: ctypes.c_void_p) -> None:
        self._write = lib.MPI_T_cvar_write
        self._handle = handle
        self._values = {v: ctypes.byref(ctypes.c_int(v)) for v in (_LIBRARY_CHOICE, _RING, _BINOMIAL, _RABENSEIFNER)}

    def set(self, value: int) -> None:
        if self._write(self._handle, self._values[value]) != 0:
            from mpi4py import MPI

            raise MPI.Exception(MPI.ERR_OTHER)


def _open_variable() -> _Variable | None:
    """The variable's MPI_T handle, or None when it cannot or must not be switched."""
    from mpi4py import MPI  # here, not at import: ring_threshold must not initialise MPI

    if not MPI.Get_library_version().startswith("Open MPI"):
        return None
    try:
        lib = ctypes.CDLL(MPI.__file__)  # the extension module; its MPI library's symbols resolve through it
        provided = ctypes.c_int()
        if lib.MPI_T_init_thread(MPI.Query_thread(), ctypes.byref(provided)) != 0:
            return None
        index, count = ctypes.c_int(), ctypes.c_int()
        if lib.MPI_T_cvar_get_index(_VARIABLE, ctypes.byref(index)) != 0:
            return None
        handle = ctypes.c_void_p()
        if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != 0 or count.value != 1:
            return None
        current = ctypes.c_int()
        if lib.MPI_T_cvar_read(handle, ctypes.byref(current)) != 0 or current.value != _LIBRARY_CHOICE:
            return None  # the user chose an algorithm: keep it for every call
    except (OSError, AttributeError):
        return None
    return _Variable(lib, handle)


_LOCK = threading.Lock()
_variable: _Variable | None = None
_opened = False


def _shared_variable() -> _Variable | None:
    global _variable, _opened
    with _LOCK:
        if not _opened:
            _variable, _opened = _open_variable(), True
        return _variable


class AllreduceStarter:
    """Starts one communicator's non-blocking all-reduces under the algorithm they need.

    Once any starter has opened the variable, every all-reduce of every communicator in the
    process starts under the lock, so that none starts while another thread has a choice set
    for its own call; the variable is back at the library's choice between starts, so the
    user's own MPI calls keep Open MPI's choice (ring ignores whether an op commutes).

    Args:
        size: ranks of the communicator.
        ring_from: bytes from which ring runs (:func:`ring_threshold`; None, for
            MESHCOMM_MPI_RING_FROM=off or one rank: the variable is not opened for it).
    """

    def __init__(self, size: int, ring_from: int | None) -> None:
        on = ring_from is not None and size > 1 and _shared_variable() is not None
        #: MPI_IN_PLACE is safe when some ranks of a call pass it and others do not
        self.in_place = on or size == 1
        self.ring_from = ring_from if on else None
        self._size = size

    def choice(self, nbytes: int) -> int:
        """The algorithm an all-reduce of ``nbytes`` runs under (0: the library's choice)."""
        if self.ring_from is None:
            return _LIBRARY_CHOICE
        return algorithm_for(self._size, nbytes, self.ring_from)

    def persistent(self, comm: Any, send: Any, recv: Any, op: Any) -> Any:
        """``comm.Allreduce_init(send, recv, op)`` of a small array, under the library's choice
        (a persistent operation takes its algorithm when it is made)."""
        if _variable is None:
            return comm.Allreduce_init(send, recv, op)
        with _LOCK:
            return comm.Allreduce_init(send, recv, op)

    def __call__(self, comm: Any, send: Any, recv: Any, op: Any, nbytes: int) -> Any:
        """``comm.Iallreduce(send, recv, op)`` under :meth:`choice` of ``nbytes``."""
        var = _variable
        if var is None:
            return comm.Iallreduce(send, recv, op)
        with _LOCK:
            algorithm = self.choice(nbytes)
            if algorithm == _LIBRARY_CHOICE:
                return comm.Iallreduce(send, recv, op)
            var.set(algorithm)
            try:
                return comm.Iallreduce(send, recv, op)
            finally:
                var.set(_LIBRARY_CHOICE)
