"""meshcomm's all_sum over the mpi backend against raw mpi4py Allreduce, in the same job.

    .venv/bin/python bench/bench_mpi.py              # 2 and 4 ranks, prints both tables
    .venv/bin/python bench/bench_mpi.py --ranks 2 --quick

Run without mpiexec it starts itself under the mpiexec of the MPI that mpi4py loads
(:func:`meshcomm_mpi.launcher.mpiexec_command`) once per rank count. In each job every
size is timed in alternating batches of four kinds of call on the same float32 input:

* ``raw``: ``comm.Allreduce(x, out, MPI.SUM)`` into a preallocated ``out`` (the floor);
* ``raw+alloc``: the same, but ``out = np.empty_like(x)`` each call, as meshcomm must
  return a new array;
* ``meshcomm``: ``mc.all_sum(x)``;
* ``out=``: ``mc.all_sum(x, out=out)`` into the same preallocated ``out`` as ``raw``.

Each batch runs ``k`` calls back to back (many for small messages, one for large ones)
and the table shows the median over batches of the time per call on rank 0, and the
median over batches of the ratio meshcomm/raw and of the microseconds meshcomm adds,
each taken between the two batches run next to each other (so that load from other
processes on a shared machine hits both sides of each pair alike).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from meshcomm.bench.sizes import format_size

__all__ = ["main"]

SIZES = [8, 32, 128, 512, 2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _plan(nbytes: int, quick: bool) -> tuple[int, int]:
    """(calls per batch, batches) so that each size takes a bounded time."""
    calls = max(1, min(200, (256 << 10) // nbytes))
    batches = 21 if nbytes >= (16 << 20) else 41 if nbytes >= (1 << 20) else 81
    if quick:
        batches = max(7, batches // 3)
    return calls, batches


def _measure(g: Any, comm: Any, nbytes: int, quick: bool) -> dict[str, float]:
    """Median µs per call of each kind of call for one message size."""
    import meshcomm as mc
    from mpi4py import MPI

    x = np.full(nbytes // 4, g.rank() + 1, dtype=np.float32)
    out = np.empty_like(x)
    calls, batches = _plan(nbytes, quick)

    def raw() -> None:
        comm.Allreduce(x, out, MPI.SUM)

    def raw_alloc() -> None:
        comm.Allreduce(x, np.empty_like(x), MPI.SUM)

    def meshcomm() -> None:
        mc.all_sum(x, group=g)

    def meshcomm_out() -> None:
        mc.all_sum(x, group=g, out=out)

    kinds: list[tuple[str, Callable[[], None]]] = [
        ("raw", raw),
        ("raw+alloc", raw_alloc),
        ("meshcomm", meshcomm),
        ("out", meshcomm_out),
    ]
    times: dict[str, list[float]] = {k: [] for k, _ in kinds}
    for _, fn in kinds:  # warm up (connections, page faults, op selection)
        for _ in range(min(calls, 20)):
            fn()
    for b in range(batches):
        order = kinds if b % 2 == 0 else kinds[::-1]  # alternate so drift hits all alike
        for name, fn in order:
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls)
    n = g.size()
    if not np.array_equal(mc.all_sum(x, group=g), np.full_like(x, n * (n + 1) / 2)):
        raise RuntimeError(f"rank {g.rank()}: wrong all_sum result at {nbytes} bytes")
    med = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
    # paired per batch: adjacent in time, so load from other processes cancels out
    raw_t, mc_t = np.array(times["raw"]), np.array(times["meshcomm"])
    med["ratio"] = float(np.median(mc_t / raw_t))
    med["ratio_out"] = float(np.median(np.array(times["out"]) / raw_t))
    med["added"] = float(np.median(mc_t - raw_t)) * 1e6
    return med


def _worker(quick: bool, sizes: list[int]) -> int:
    import meshcomm as mc
    from mpi4py import MPI

    g = mc.init(strict=True, backend="mpi")
    comm = MPI.COMM_WORLD
    r, n = g.rank(), g.size()
    rows = []
    for nbytes in sizes:
        med = _measure(g, comm, nbytes, quick)
        rows.append(
            (
                nbytes,
                med["raw"],
                med["raw+alloc"],
                med["meshcomm"],
                med["ratio"],
                med["added"],
                med["out"],
                med["ratio_out"],
            )
        )
    if r == 0:
        print(f"\n{n} ranks, float32 all_sum, median µs per call (rank 0), {os.cpu_count()} cores")
        print(
            f"| {'size':>8} | {'raw mpi4py':>11} | {'raw+alloc':>10} | {'meshcomm':>10} | {'ratio':>6} | "
            f"{'added µs':>9} | {'out=':>10} | {'ratio out=':>10} |"
        )
        print(f"|{'-' * 10}|{'-' * 13}|{'-' * 12}|{'-' * 12}|{'-' * 8}|{'-' * 11}|{'-' * 12}|{'-' * 12}|")
        for nbytes, t_raw, t_alloc, t_mc, ratio, added, t_out, ratio_out in rows:
            print(
                f"| {format_size(nbytes):>8} | {t_raw:11.1f} | {t_alloc:10.1f} | {t_mc:10.1f} | "
                f"{ratio:6.3f} | {added:9.1f} | {t_out:10.1f} | {ratio_out:10.3f} |"
            )
        sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4], help="rank counts to run (default 2 4)")
    p.add_argument("--quick", action="store_true", help="fewer batches")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message (default 64 MiB)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [s for s in SIZES if s <= args.max_bytes]
    if args.worker:
        return _worker(args.quick, sizes)
    from meshcomm_mpi.launcher import mpiexec_command

    status = 0
    for n in args.ranks:
        extra = ["--quick"] if args.quick else []
        cmd = mpiexec_command(
            n, [sys.executable, os.path.abspath(__file__), "--worker", "--max-bytes", str(args.max_bytes), *extra]
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "OMPI_COMM", "PMI"))}
        status |= subprocess.call(cmd, env=env)
    return status


if __name__ == "__main__":
    sys.exit(main())
