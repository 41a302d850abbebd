"""Survivors continue on MPI: ``agree`` and ``shrink`` through MPI's fault tolerance (ULFM).

Open MPI 5 ships ULFM (``MPIX_Comm_iagree``, ``MPIX_Comm_shrink``, ``MPIX_Comm_revoke``;
mpi4py 4: ``Comm.Iagree``, ``Comm.Shrink``, ``Comm.Revoke``), but a job has it only when it
was started with it: ``mpiexec --with-ft ulfm`` (which sets ``OMPI_MCA_mpi_ft_enable`` in
every rank); ``meshcomm launch --keep-going --backend mpi`` passes it and sets
``MESHCOMM_MPI_FT=1``. Without it a rank's death ends the whole job, as it always does
under MPI. (MPICH's wheel lacks ``MPIX_Comm_iagree``: :func:`agree` raises NotSupportedError.)

MPI notices a failed process only when it has ended (its runtime sees the exit). A stopped
or hung one is not noticed by the library; meshcomm's own deadline names it
(CommTimeoutError), and ``shrink`` then ends such a peer if it runs on this host (SIGKILL:
the same outcome as a crash, which MPI then sees), so the survivors can agree. A stopped
peer on another host cannot be ended from here: shrink raises CommTimeoutError naming it.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from typing import Any

import numpy as np
from meshcomm.plugin import CommTimeoutError, DistributedError, NotSupportedError, PeerLostError
from mpi4py import MPI

from .settings import MPISettings

__all__ = ["fault_tolerant", "lost_error", "agree", "shrink", "end_stopped_suspects", "bound_finalize"]

#: seconds the end of a process may take once its program is done, after a rank was lost
FINALIZE_LIMIT = 5.0

_PROC_FAILED = getattr(MPI, "ERR_PROC_FAILED", None)
_PROC_FAILED_PENDING = getattr(MPI, "ERR_PROC_FAILED_PENDING", None)
_REVOKED = getattr(MPI, "ERR_REVOKED", None)
#: the error classes with which ULFM reports a failed peer (the operation's result may still stand)
_FAILURE_CLASSES = (_PROC_FAILED, _PROC_FAILED_PENDING, _REVOKED)


def fault_tolerant(settings: MPISettings) -> bool:
    """True when this MPI has ULFM and the job was started with it (see the module docstring)."""
    has_ulfm = _PROC_FAILED is not None and hasattr(MPI.Comm, "Shrink") and hasattr(MPI.Comm, "Iagree")
    ompi = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true")
    return has_ulfm and (settings.fault_tolerance or ompi)


def _error_class(exc: Any) -> int | None:
    try:
        return int(exc.Get_error_class())
    except Exception:
        return None


def failed_ranks(comm: Any) -> list[int]:
    """Ranks of ``comm`` that MPI knows have failed (ULFM's ``Comm.Get_failed``)."""
    try:
        group = comm.Get_failed()
        try:
            n = group.Get_size()
            if n == 0:
                return []
            ranks = MPI.Group.Translate_ranks(group, list(range(n)), comm.Get_group())
        finally:
            group.Free()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return []
    return sorted(int(r) for r in ranks if r is not None and r >= 0)


def lost_error(exc: Any, backend: Any, op: str) -> DistributedError | None:
    """The PeerLostError for an MPI error that reports a failed peer (ULFM's classes), else None."""
    klass = _error_class(exc)
    failed = failed_ranks(backend.comm)  # also behind other classes (libnbc's "round failed")
    if not failed and klass not in _FAILURE_CLASSES:
        return None
    where = f"[mpi] rank {backend.rank()} of {backend.size()}: {op} on {backend.label}"
    fix = "; call world.shrink() on every survivor to go on without it"
    if failed:
        names = ", ".join(map(str, failed))
        return PeerLostError(f"{where}: rank {names} failed (MPI: its process ended){fix}", peer=failed[0])
    if klass == _REVOKED:
        return PeerLostError(f"{where}: a peer revoked the communicator after it saw a rank fail{fix}", peer=None)
    return PeerLostError(f"{where}: MPI reports a failed process{fix}", peer=None)


def end_stopped_suspects(control: Any) -> list[int]:
    """End (SIGKILL) the peers this rank timed out on that are stopped on this host: MPI sees
    only ended processes as failed, and the survivors cannot agree while one of them is only
    stopped. Returns the world ranks ended."""
    peers = control.peers
    ended = []
    for w in sorted(control.suspects):
        if peers is None or w == control.rank or peers.state(w) != "stopped":
            continue
        try:
            os.kill(peers.pids[w], signal.SIGKILL)
            ended.append(w)
        except OSError:
            pass
    return ended


def _complete(req: Any, backend: Any, what: str) -> int | None:
    """Test ``req`` until it completes; its error class if it completed with one of ULFM's
    (the result is still the agreed one), raising CommTimeoutError at the deadline."""
    end = time.monotonic() + backend.timeout
    nap = 5e-5
    while True:
        try:
            if req.Test():
                return None
        except MPI.Exception as exc:
            klass = _error_class(exc)
            if klass in _FAILURE_CLASSES:
                return klass
            raise DistributedError(
                f"[mpi] rank {backend.rank()} of {backend.size()}: {what} failed: {exc.Get_error_string()}"
            ) from None
        if time.monotonic() >= end:
            peers = backend.control.peers
            stopped = []
            if peers is not None:
                stopped = [q for q, w in enumerate(backend.members) if peers.state(w) == "stopped"]
            who = (
                f"rank {', '.join(map(str, stopped))} is stopped on this host"
                if stopped
                else (
                    "a peer did not join it (stopped, or on a host that is cut off: MPI notices only processes that "
                    "ended)"
                )
            )
            raise CommTimeoutError(
                f"[mpi] rank {backend.rank()} of {backend.size()}: {what} did not complete within "
                f"{backend.timeout:g} s (MLX_TIMEOUT): {who}; end that process (kill it) so that MPI sees it as "
                "failed, then call shrink() again",
                peer=stopped[0] if stopped else None,
            )
        time.sleep(nap)
        nap = min(1e-3, nap * 1.5)


def agree(backend: Any, flag: int) -> tuple[int, frozenset[int]]:
    """ULFM's agreement on ``backend.comm``: the bitwise AND of ``flag`` over the live ranks
    (the same on each; MPI completes it with an error class when ranks failed, the value
    agreed all the same), and the ranks of the communicator MPI knows have failed."""
    buf = np.array([flag], dtype=np.uint32).view(np.intc)
    try:
        req = backend.comm.Iagree(buf)
    except NotImplementedError:
        raise NotSupportedError(
            f"[mpi] rank {backend.rank()}: this MPI library has no MPIX_Comm_iagree "
            f"({MPI.Get_library_version().splitlines()[0]}); survivors go on under Open MPI 5 (--with-ft ulfm)"
        ) from None
    except MPI.Exception as exc:
        raise DistributedError(
            f"[mpi] rank {backend.rank()} of {backend.size()}: agree() could not start: {exc.Get_error_string()}"
        ) from None
    _complete(req, backend, "agree()")
    lost = frozenset(failed_ranks(backend.comm))
    return int(buf.view(np.uint32)[0]), lost


def shrink(backend: Any) -> tuple[Any, list[int]]:
    """The communicator of the live ranks of ``backend.comm`` and their ranks in it.

    Revokes the communicator (every rank still inside an operation on it gets an error and
    comes to shrink too), agrees under the deadline that every live rank is here (a peer that
    is stopped would otherwise make MPI's shrink wait for ever), then ``Comm.Shrink``."""
    comm = backend.comm
    try:
        comm.Revoke()
    except MPI.Exception:
        pass  # revoked already, by a peer
    end_stopped_suspects(backend.control)  # MPI notices their end; the agreement waits for that
    agree(backend, 1)
    try:
        new = comm.Shrink()
    except MPI.Exception as exc:
        raise DistributedError(
            f"[mpi] rank {backend.rank()} of {backend.size()}: shrink() failed in MPI: {exc.Get_error_string()}; "
            "call shrink() again"
        ) from None
    new.Set_errhandler(MPI.ERRORS_RETURN)
    n = new.Get_size()
    old = MPI.Group.Translate_ranks(new.Get_group(), list(range(n)), comm.Get_group())
    return new, [int(r) for r in old]


def _arm_finalize_limit() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, FINALIZE_LIMIT)


_bounded: list[bool] = []


def bound_finalize() -> None:
    """Open MPI 5.0's MPI_Finalize waits in a runtime barrier that, after a process was lost,
    sometimes never completes (1 run in 6 to 8 of tests/programs/survivors.py here). Once a world was shrunk, the end of
    the process is bounded: from the interpreter's exit on, after FINALIZE_LIMIT seconds the
    process ends by SIGALRM (its program has completed by then)."""
    if not _bounded:
        _bounded.append(True)
        atexit.register(_arm_finalize_limit)
