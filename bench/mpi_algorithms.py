"""Open MPI's non-blocking all-reduce under each libnbc algorithm, against the blocking one.

    python bench/mpi_algorithms.py                       # 2, 3 and 4 ranks
    python bench/mpi_algorithms.py --ranks 2 --sizes 8,65536,1048576

Raw mpi4py only (meshcomm is not imported): the table behind the choice of algorithm in
:mod:`meshcomm_mpi.algorithms` (docs/backends/mpi.md, "Which algorithm the all-reduce runs").
Each job runs under the mpiexec of the MPI mpi4py loads. Per size it times, in rotating
blocks with a barrier before each, the blocking ``Allreduce`` and ``Iallreduce`` completed by
a ``Test`` loop under libnbc's own choice (0), ring (1), binomial (2), Rabenseifner's (3) and
recursive doubling (4),
switched through MPI_T the way the backend does; every result is compared with the blocking
call's. A cell is the median over blocks of the slowest rank's time, divided by the blocking
call's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

ALGORITHMS = {0: "Open MPI's choice", 1: "ring", 2: "binomial", 3: "Rabenseifner", 4: "recursive doubling"}
DEFAULT_SIZES = "8,4096,32768,131072,262144,1048576,4194304"


def _variable_writer() -> Any:
    from mpi4py import MPI

    lib = ctypes.CDLL(MPI.__file__)
    provided, index, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    handle = ctypes.c_void_p()
    lib.MPI_T_init_thread(MPI.Query_thread(), ctypes.byref(provided))
    if lib.MPI_T_cvar_get_index(b"coll_libnbc_iallreduce_algorithm", ctypes.byref(index)) != 0:
        raise SystemExit("this MPI has no coll_libnbc_iallreduce_algorithm (Open MPI only)")
    lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count))

    def write(value: int) -> None:
        if lib.MPI_T_cvar_write(handle, ctypes.byref(ctypes.c_int(value))) != 0:
            raise RuntimeError("MPI_T_cvar_write failed")

    return write


def worker(sizes: list[int], blocks: int) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    write = _variable_writer()

    def blocking(x: np.ndarray, out: np.ndarray, reps: int) -> None:
        for _ in range(reps):
            comm.Allreduce(x, out, MPI.SUM)

    def nonblocking(algorithm: int) -> Any:
        def run(x: np.ndarray, out: np.ndarray, reps: int) -> None:
            write(algorithm)
            for _ in range(reps):
                req = comm.Iallreduce(x, out, MPI.SUM)
                while not req.Test():
                    pass
            write(0)

        return run

    sides = {"blocking": blocking, **{name: nonblocking(a) for a, name in ALGORITHMS.items()}}
    if rank == 0:
        print("| ranks | size | blocking (µs) | " + " | ".join(ALGORITHMS.values()) + " |", flush=True)
        print("|---:|---:|---:|" + "---:|" * len(ALGORITHMS), flush=True)
    for nbytes in sizes:
        x = (np.arange(nbytes // 4) % 7 + rank).astype(np.float32)
        want = np.empty_like(x)
        comm.Allreduce(x, want, MPI.SUM)
        reps = max(3, min(2000, int(4e6 / max(nbytes, 64))))
        times: dict[str, list[float]] = {k: [] for k in sides}
        for b in range(blocks):
            order = list(sides)[b % len(sides) :] + list(sides)[: b % len(sides)]
            for name in order:
                out = np.empty_like(x)
                comm.Barrier()
                t0 = time.perf_counter()
                sides[name](x, out, reps)
                mine = np.array([(time.perf_counter() - t0) / reps])
                slowest = np.empty_like(mine)
                comm.Allreduce(mine, slowest, MPI.MAX)
                times[name].append(float(slowest[0]))
                if not np.array_equal(out, want):
                    raise SystemExit(f"rank {rank}: {name} at {nbytes} B differs from the blocking all-reduce")
        if rank == 0:
            base = float(np.median(times["blocking"]))
            cells = " | ".join(f"{np.median(times[k]) / base:.2f}" for k in ALGORITHMS.values())
            print(f"| {n} | {nbytes} | {base * 1e6:.1f} | {cells} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list of bytes (default {DEFAULT_SIZES})")
    p.add_argument("--blocks", type=int, default=7, help="timed blocks per size and side (default 7)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes, args.blocks)
        return 0
    from meshcomm_mpi.launcher import mpiexec_command

    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env.pop("OMPI_MCA_coll_libnbc_iallreduce_algorithm", None)
    for n in args.ranks:
        cmd = mpiexec_command(
            n, [sys.executable, __file__, "--worker", "--sizes", args.sizes, "--blocks", str(args.blocks)]
        )
        res = subprocess.run(cmd, env=env, timeout=900)
        if res.returncode != 0:
            return res.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
