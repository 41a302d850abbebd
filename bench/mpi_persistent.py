"""The floor of a persistent all-reduce in Python (MPI-4's ``MPI_Allreduce_init``), with and
without a call-check key beside it, against blocking and non-blocking calls: raw mpi4py only.

    meshcomm launch -n 2 --backend mpi -- bench/mpi_persistent.py [--size 8B] [--calls 20000]

It answers how fast a persistent meshcomm operation (validated once, started many times)
could be before building one: rank 0 prints µs per call, averaged over ``--calls`` calls
after a warm-up, for

* ``blocking``: ``Allreduce`` into a reused buffer (what the comparisons call raw mpi4py);
* ``persistent``: ``Start`` + ``Wait`` of one ``Allreduce_init`` request;
* ``persistent+key``: ``Startall`` + ``Waitall`` of it and a 16-byte max all-reduce (the
  call check, carried beside the operation as meshcomm-mpi does);
* ``nonblocking+key``: ``Iallreduce`` of the key and of the data, ``Waitall`` (meshcomm-mpi's
  calls today, without its deadline loop and Group path).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="8B", help="bytes per call (default 8B)")
    p.add_argument("--calls", type=int, default=20000, help="timed calls per pattern (default 20000)")
    args = p.parse_args()
    from meshcomm.bench.sizes import parse_sizes

    (nbytes,) = parse_sizes(args.size)
    comm = MPI.COMM_WORLD.Dup()
    x = np.ones(max(nbytes // 4, 1), np.float32)
    out = np.empty_like(x)
    key = np.array([5, -5], np.int64)
    seen = np.empty(2, np.int64)
    data = comm.Allreduce_init(x, out, MPI.SUM)
    check = comm.Allreduce_init(key, seen, MPI.MAX)

    def blocking() -> None:
        comm.Allreduce(x, out, MPI.SUM)

    def persistent() -> None:
        data.Start()
        data.Wait()

    def persistent_key() -> None:
        MPI.Prequest.Startall([check, data])
        MPI.Request.Waitall([check, data])

    def nonblocking_key() -> None:
        MPI.Request.Waitall([comm.Iallreduce(key, seen, MPI.MAX), comm.Iallreduce(x, out, MPI.SUM)])

    patterns: dict[str, Callable[[], None]] = {
        "blocking": blocking,
        "persistent": persistent,
        "persistent+key": persistent_key,
        "nonblocking+key": nonblocking_key,
    }
    if comm.rank == 0:
        print(f"all-reduce float32, {x.nbytes} B, {comm.size} ranks: µs per call (mean of {args.calls})")
    for _ in range(2):
        for name, call in patterns.items():
            for _ in range(200):
                call()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            took = (time.perf_counter() - t0) / args.calls * 1e6
            if comm.rank == 0:
                print(f"{name:>16} {took:8.2f}", flush=True)
    data.Free()
    check.Free()
    comm.Free()


if __name__ == "__main__":
    main()
