"""``MPIBackend``: meshcomm's Backend protocol on an MPI communicator.

Every operation is one native MPI call on the caller's NumPy buffers (zero-copy, never
pickled): Allreduce, Allgather, Reduce_scatter_block, Bcast, Send/Recv, Sendrecv,
Barrier, and Comm.Split for ``split``. The backend works on its own duplicate of
``MPI.COMM_WORLD`` so that meshcomm's messages never match a user's own mpi4py
messages, with the ``ERRORS_RETURN`` error handler so that MPI errors become
:class:`meshcomm.DistributedError` instead of aborting the job.

MPI has no per-operation timeout: ``timeout`` is kept for the protocol but MPI calls
wait until they complete. A rank that dies makes the MPI launcher end the whole job
(see docs/backends/mpi.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from meshcomm.backend import Backend
from meshcomm.errors import DistributedError
from mpi4py import MPI

from .errors import mpi_error
from .reduce_ops import OpTable

__all__ = ["MPIBackend"]

_TAG = 0  # one tag suffices: the communicator is private and MPI keeps pair order


class MPIBackend(Backend):
    """A meshcomm transport over the MPI communicator ``comm``.

    Args:
        comm: the communicator (the backend takes ownership and frees it in ``close``).
        ops: the (dtype, op) -> (MPI datatype, MPI op) table shared by a world and its splits.
        timeout: kept as the ``timeout`` attribute; MPI cannot enforce it.
    """

    def __init__(self, comm: Any, ops: OpTable, *, timeout: float = 300.0) -> None:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm = comm
        self.timeout = timeout
        self._ops = ops
        self._reduce = ops.table
        self._move = ops.move
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._closed = False

    # -- identity -----------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _fail(self, op: str, exc: Any, peer: int | None = None) -> DistributedError:
        return mpi_error(exc, rank=self._rank, size=self._size, op=op, peer=peer)

    # -- point-to-point -------------------------------------------------------------------
    def send(self, buf: np.ndarray, dst: int) -> None:
        try:
            self.comm.Send([buf, self._move[buf.dtype]], dst, _TAG)
        except MPI.Exception as exc:
            raise self._fail("send", exc, dst) from None

    def recv(self, buf: np.ndarray, src: int) -> None:
        dt = self._move[buf.dtype]
        status = MPI.Status()
        try:
            self.comm.Recv([buf, dt], src, _TAG, status)
        except MPI.Exception as exc:
            raise self._fail("recv", exc, src) from None
        got = status.Get_count(dt)
        if got != buf.size:
            raise DistributedError(
                f"[mpi] rank {self._rank}: recv from rank {src} got {got} elements of {buf.dtype}, "
                f"expected {buf.size}; the sender's send and this recv disagree in shape or dtype "
                "(run with MLX_DEBUG=1 to find the mismatched call)"
            )

    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None:
        try:
            self.comm.Sendrecv([sendbuf, self._move[sendbuf.dtype]], dst, _TAG,
                               [recvbuf, self._move[recvbuf.dtype]], src, _TAG)
        except MPI.Exception as exc:
            raise self._fail(f"sendrecv (to {dst}, from {src})", exc) from None

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        dt, mop = self._reduce.get((sendbuf.dtype, op)) or self._ops.resolve(sendbuf.dtype, op)
        try:
            self.comm.Allreduce([sendbuf, dt], [recvbuf, dt], mop)
        except MPI.Exception as exc:
            raise self._fail(f"all_reduce({op}, {sendbuf.dtype})", exc) from None

    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        dt = self._move[sendbuf.dtype]
        try:
            self.comm.Allgather([sendbuf, dt], [recvbuf, dt])
        except MPI.Exception as exc:
            raise self._fail("all_gather", exc) from None

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        dt, mop = self._reduce.get((sendbuf.dtype, op)) or self._ops.resolve(sendbuf.dtype, op)
        try:
            self.comm.Reduce_scatter_block([sendbuf, dt], [recvbuf, dt], mop)
        except MPI.Exception as exc:
            raise self._fail(f"reduce_scatter({op}, {sendbuf.dtype})", exc) from None

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        try:
            self.comm.Bcast([buf, self._move[buf.dtype]], root)
        except MPI.Exception as exc:
            raise self._fail(f"broadcast(root={root})", exc) from None

    def barrier(self) -> None:
        try:
            self.comm.Barrier()
        except MPI.Exception as exc:
            raise self._fail("barrier", exc) from None

    # -- groups -------------------------------------------------------------------------------
    def split(self, color: int, key: int) -> Backend:
        """A new MPIBackend on ``Comm.Split`` of this communicator.

        meshcomm accepts any integer colour and key, MPI only non-negative 32-bit colours,
        so the ranks first exchange (colour, key) and each passes MPI its colour's index
        and its position in (key, rank) order, ordering like the core's generic split
        (a negative key sorts as the rank itself).
        """
        mine = np.zeros(3, dtype=np.int64)
        try:
            mine[1], mine[2] = color, key
        except OverflowError:
            mine[0] = 1  # every rank raises below, none is left waiting
        table = np.empty(3 * self._size, dtype=np.int64)
        self.all_gather(mine, table)
        flags, colors, keys = table[0::3], table[1::3], table[2::3]
        if flags.any():
            bad = int(np.flatnonzero(flags)[0])
            raise ValueError(
                f"split: rank {bad} passed a colour or key outside the 64-bit range "
                f"(this rank {self._rank} passed color={color}, key={key}); use smaller integers"
            )
        palette = sorted(set(colors.tolist()))
        members = [q for q in range(self._size) if colors[q] == colors[self._rank]]
        members.sort(key=lambda q: (int(keys[q]) if keys[q] >= 0 else q, q))
        try:
            sub = self.comm.Split(palette.index(int(colors[self._rank])), members.index(self._rank))
        except MPI.Exception as exc:
            raise self._fail(f"split(color={color}, key={key})", exc) from None
        return MPIBackend(sub, self._ops, timeout=self.timeout)

    def close(self) -> None:
        """Free the communicator unless MPI is already finalised (user-defined ops live on)."""
        if self._closed:
            return
        self._closed = True
        if MPI.Is_finalized():
            return
        try:
            self.comm.Free()
        except MPI.Exception:
            pass
