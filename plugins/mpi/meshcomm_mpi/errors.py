"""Turning MPI errors into meshcomm errors that say which rank, which call and what MPI said."""

from __future__ import annotations

from typing import Any

from meshcomm.plugin import DistributedError

__all__ = ["mpi_error"]


def mpi_error(exc: Any, *, rank: int, size: int, op: str, peer: int | None = None) -> DistributedError:
    """A DistributedError for the ``mpi4py.MPI.Exception`` ``exc`` raised by ``op``.

    The message keeps MPI's own text and error class, so that searching for it finds the
    MPI documentation, and names the rank, the peer (if any) and the communicator size.
    """
    try:
        text = exc.Get_error_string().strip()
        klass = exc.Get_error_class()
    except Exception:  # not an MPI.Exception after all
        text, klass = str(exc), None
    where = f"rank {rank} of {size}" + (f", peer {peer}" if peer is not None else "")
    code = f" (MPI error class {klass})" if klass is not None else ""
    return DistributedError(f"[mpi] {where}: {op} failed: {text}{code}")
