"""The mpi backend's compiled small all_sum and barrier (``meshcomm_mpi._planned``), when it
was built.

The extension reaches MPI through the functions mpi4py's own extension module calls: their
addresses are found here with ctypes, so the extension needs no MPI headers and works with
whichever MPI mpi4py loaded (Open MPI, MPICH, the MPI ABI).

It also holds the carried sum (:func:`carried`): an MPI op that all-reduces one record of the
call check's key and a small all_sum's data, so that such an all_sum is one MPI operation
where it was two (the check's and the data's).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

__all__ = ["CompiledEntries", "compiled_entries", "Carried", "carried"]


@functools.cache
def _addresses(names: tuple[str, ...]) -> tuple[int, ...] | None:
    """The addresses of MPI functions ``names`` (found once per process: every backend, split
    and start-up backend asks for the same ones), or None where one is missing."""
    try:
        lib = ctypes.CDLL(MPI.__file__)  # mpi4py's extension: its MPI library's symbols resolve through it
        found = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names]
    except (OSError, AttributeError):
        return None
    return None if None in found else tuple(int(a) for a in found if a is not None)


class CompiledEntries(Protocol):
    """The extension's entries for one backend (``meshcomm_mpi._planned.PlannedSum``)."""

    def run(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> bool:
        """``backend.sum_now`` (Backend.sum_now): a small all_sum started and waited for in C."""

    def barrier(self) -> bool:
        """``backend.barrier_now``: the barrier as the carried call check with no data, in C;
        False (nothing happened) where the check is not carried."""


def compiled_entries(backend: Any, max_bytes: int) -> CompiledEntries | None:
    """``backend``'s compiled small all_sum and barrier, or None without the extension (the
    backend's Python ``all_reduce`` and ``barrier`` do the same steps)."""
    try:
        from ._planned import PlannedSum
    except ImportError:
        return None
    found = _addresses(("MPI_Start", "MPI_Test", "MPI_Iprobe"))
    if found is None:
        return None
    control = backend.control
    start, test, iprobe = found
    c = backend.carried
    return PlannedSum(
        backend,
        control,
        start,
        test,
        iprobe,
        MPI._handleof(control.ctl),
        MPI._sizeof(MPI.Comm),
        MPI.ANY_SOURCE,
        MPI.ANY_TAG,
        bool(control.oversubscribed),
        float(control.spin),
        max_bytes,
        0 if c is None else c.data,
        None if c is None else c.codes,
    )


#: the dtypes a carried record adds: every integer, float32 and float64, complex64 and complex128
_CARRIED_TYPES = np.typecodes["AllInteger"] + "fdFD"


class Carried:
    """The carried sum of this process (one MPI op, made by the extension) and its record: every
    call check, and the data of every all_sum of at most ``data`` bytes whose dtype has a code,
    travel as one record of the same size (``meshcomm_mpi._planned`` describes it).

    Attributes:
        op: the MPI op adding two records.
        record: the MPI datatype of one record (``words`` int64).
        head: int64 words before the data: the key (h, -h), the data's bytes, its code.
        data: the most data bytes a record carries.
    """

    def __init__(self, op: Any, head: int, data: int, codes: dict[str, int]) -> None:
        self.op = op
        self.head, self.data = head, data
        self.words = head + data // 8
        self.record = MPI.BYTE.Create_contiguous(8 * self.words).Commit()
        #: dtype -> how a record adds it (complex as its float parts; signed integers as the
        #: unsigned ones of their width: the same bits); dtypes missing here are not carried
        self.codes: dict[np.dtype, int] = {}
        for t in _CARRIED_TYPES:
            dt = np.dtype(t)
            name = f"{'u' if dt.kind in 'iu' else 'f'}{dt.itemsize // 2 if dt.kind == 'c' else dt.itemsize}"
            self.codes[dt] = codes[name]

    def records(self) -> tuple[np.ndarray, np.ndarray]:
        """A send and a receive record, zeros (no key, no data)."""
        return np.zeros(self.words, np.int64), np.zeros(self.words, np.int64)


@functools.cache
def carried() -> Carried | None:
    """This process's carried sum, or None without the extension (made once per process:
    every world, split and shrunk world of the process shares it)."""
    try:
        from . import _planned
    except ImportError:
        return None
    found = _addresses(("MPI_Op_create",))
    if found is None:
        return None
    op = MPI.Op.fromhandle(_planned.carried_op(found[0], MPI._sizeof(MPI.Op)))
    return Carried(op, _planned.CARRIED_HEAD, _planned.CARRIED_DATA, dict(_planned.CARRIED_CODES))
