"""Raw mpi4py ``Allreduce`` into one reused receive buffer against two or three taken in turn.

    meshcomm launch -n 2 --backend mpi -- bench/mpi_result_buffers.py [--size 16MiB] [--iters 30]

A loop ``y = mc.all_sum(x)`` keeps the previous result alive while the next one is made, so
its results take turns between (at least) two buffers, where the raw peer in the
comparisons writes into one preallocated array. This times that difference in MPI alone,
with no meshcomm in the call: rank 0 prints the median µs per call for each pattern, and
the page faults per call (none, with freed memory kept for reuse as ``init()`` asks glibc).
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="16MiB", help="bytes per call (default 16MiB)")
    p.add_argument("--iters", type=int, default=30, help="timed calls per pattern (default 30)")
    args = p.parse_args()
    from meshcomm.bench.sizes import parse_sizes
    from meshcomm.protocol.memory import keep_freed_memory

    keep_freed_memory()
    comm = MPI.COMM_WORLD
    (nbytes,) = parse_sizes(args.size)
    x = np.ones(nbytes // 4, np.float32)
    bufs = [np.empty_like(x) for _ in range(3)]

    def timed(call: Callable[[int], object]) -> tuple[float, float]:
        times = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for i in range(args.iters):
            comm.Barrier()
            t0 = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - t0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return sorted(times)[len(times) // 2] * 1e6, faults / args.iters

    patterns = {
        "one buffer": lambda i: comm.Allreduce(x, bufs[0], MPI.SUM),
        "two in turn": lambda i: comm.Allreduce(x, bufs[i % 2], MPI.SUM),
        "three in turn": lambda i: comm.Allreduce(x, bufs[i % 3], MPI.SUM),
    }
    for call in patterns.values():
        timed(call)  # warm every buffer
    if comm.rank == 0:
        print(f"Allreduce float32, {nbytes} B, {comm.size} ranks: median µs per call, page faults per call")
    for _ in range(2):
        for name, call in patterns.items():
            us, faults = timed(call)
            if comm.rank == 0:
                print(f"{name:>14} {us:>10.1f} µs {faults:>6.1f} faults", flush=True)


if __name__ == "__main__":
    main()
