"""Starting the mpi backend: initialise MPI, check the world is the one launched, probe ops.

Imported only when the backend starts, because importing ``mpi4py.MPI`` initialises MPI.
"""

from __future__ import annotations

import os
import signal

import numpy as np
from meshcomm.plugin import Backend, BackendUnavailableError, Config, die_with_parent, host_key

from .environment import launched_world_size
from .settings import MPISettings

__all__ = ["create_backend"]


def create_backend(config: Config, settings: MPISettings | None) -> Backend:
    """The ``factory`` of the mpi backend: an MPIBackend on a duplicate of COMM_WORLD.

    Raises BackendUnavailableError when MPI cannot initialise, or when the launcher
    announced N ranks but MPI sees a different world (mpiexec of another MPI than the
    one mpi4py loads: every rank would silently run alone as a singleton).
    """
    settings = settings if settings is not None else MPISettings()
    try:
        from mpi4py import MPI
    except Exception as exc:
        raise BackendUnavailableError(
            f"mpi backend: mpi4py could not load or initialise MPI: {type(exc).__name__}: {exc}"
        ) from exc
    from .backend import MPIBackend
    from .compiled import carried
    from .control import Control
    from .peers import PeerTable
    from .reduce_ops import INTS, OpTable, saturating_sum_dtypes
    from .survivors import fault_tolerant

    world = MPI.COMM_WORLD
    size = world.Get_size()
    launched = launched_world_size()
    if launched is not None and launched[1] is not None and launched[1] != size:
        who, want = launched
        raise BackendUnavailableError(
            f"mpi backend: started by {who} for {want} ranks, but {MPI.Get_library_version().splitlines()[0]} "
            f"(the MPI that mpi4py loaded) sees a world of {size}: the mpiexec belongs to a different "
            "MPI. Start the job with `meshcomm launch --backend mpi` or the mpiexec printed by "
            "`python -m meshcomm_mpi.launcher --which`."
        )
    comm = world.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    ctl = world.Dup()
    ctl.Set_errhandler(MPI.ERRORS_RETURN)
    if launched is not None:
        # a rank must not outlive its mpiexec: SIGKILL when its parent exits; if the parent
        # died before the request took effect, the rank ends at once
        die_with_parent(signal.SIGKILL, check="kill")
    control = Control(ctl, None, spin=settings.spin_us * 1e-6, ft=fault_tolerant(settings))
    timeout = float(config.timeout)
    # start-up exchanges run under the deadline like every operation
    ring = settings.ring_from
    start = MPIBackend(comm, OpTable([]), control, timeout=timeout, ring_from=ring)
    # each rank's pid and host, and whether it runs the extension (built, MESHCOMM_MPI_COMPILED):
    # all ranks must or none, as its carried sum changes the MPI operations of every call check
    carry = carried() if settings.compiled else None
    ident = np.array([os.getpid(), host_key(), carry is not None], dtype=np.int64)
    table = np.empty((size, 3), dtype=np.int64)
    start.all_gather(ident, table.reshape(-1))
    control.peers = PeerTable(table[:, :2].copy(), comm.Get_rank())  # and whether the host is oversubscribed
    if launched is not None:
        control.watch_teardown()
    if settings.int_sum == "numpy":
        numpy_sums = list(INTS)
    elif settings.int_sum == "native":
        numpy_sums = []
    else:
        # probe locally, then agree: all ranks must use the same op in a collective
        bad_here = saturating_sum_dtypes(INTS)
        flags = np.array([dt in bad_here for dt in INTS], dtype=np.bool_)
        agreed = np.empty_like(flags)
        start.all_reduce(flags, agreed, "max")
        numpy_sums = [dt for dt, bad in zip(INTS, agreed, strict=True) if bad]
    spare = comm.Dup()  # for naming a mismatch (MPIBackend._agree)
    backend = MPIBackend(
        comm,
        OpTable(numpy_sums, carry if table[:, 2].all() else None),
        control,
        timeout=timeout,
        spare=spare,
        ring_from=ring,
        plans=start._plans,
    )
    backend.coll_count = start.coll_count  # the same communicator: its sequence goes on
    return backend
