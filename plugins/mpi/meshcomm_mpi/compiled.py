"""The mpi backend's compiled small all_sum (``meshcomm_mpi._planned``), when it was built.

The extension reaches MPI through the functions mpi4py's own extension module calls: their
addresses are found here with ctypes, so the extension needs no MPI headers and works with
whichever MPI mpi4py loaded (Open MPI, MPICH, the MPI ABI).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = ["planned_sum"]


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


def planned_sum(backend: Any, max_bytes: int) -> Callable[[np.ndarray, np.ndarray], bool] | None:
    """``backend``'s ``sum_now`` (Backend.sum_now): a small all_sum started and waited for in C,
    or None without the extension (the backend's Python ``all_reduce`` does the same steps)."""
    try:
        from ._planned import PlannedSum
    except ImportError:
        return None
    found = _addresses(("MPI_Start", "MPI_Test", "MPI_Iprobe"))
    if found is None:
        return None
    control = backend.control
    start, test, iprobe = found
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
    ).run
