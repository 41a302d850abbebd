"""How much of an ``all_sum(async_op=True)`` hides behind computation.

    meshcomm launch -n 2 --backend sockets -- bench/overlap.py
    meshcomm launch -n 2 --backend mpi -- bench/overlap.py --mib 16 --reps 7
    python bench/overlap.py --driver          # both backends, 2 ranks, one table

Each rank first times the blocking ``all_sum`` of ``--mib`` MiB of float32 (C, median
over ``--reps``, a barrier before each), then calibrates a compute kernel (float64
matrix products of ``--matrix`` (256) square, BLAS limited to one thread per rank by the launcher) to
run about as long: T. Then, ``--reps`` times, after a barrier::

    t0; h = all_sum(x, async_op=True); compute for T; h.wait(); elapsed = now - t0

(``--kernel sleep`` replaces the products by ``time.sleep(C)``: work that needs no core
of this machine, like waiting for an accelerator, which shows what the async machinery
itself can hide when the cores are free) and reports the medians of ``elapsed / T``
(1.0: the all_sum hid completely behind the computation; ``(T + C) / T``, about 2 when C
equals T: no overlap at all) and of ``elapsed / (T + C)`` (below 1: time saved against
doing the two one after the other).
Every result is checked against the blocking all_sum, bit for bit. Rank 0 prints one
JSON line prefixed ``OVERLAP``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

__all__ = ["main", "driver"]


def _compute(reps: int, a: np.ndarray) -> float:
    acc = 0.0
    for _ in range(reps):
        acc += float((a @ a)[0, 0])
    return acc


def _kernel_reps(seconds: float, a: np.ndarray) -> int:
    """Matrix products that take about ``seconds`` on this rank (measured alone)."""
    t0 = time.perf_counter()
    _compute(5, a)
    one = (time.perf_counter() - t0) / 5
    return max(1, round(seconds / one))


def run(mib: float, reps: int, matrix: int = 256, kernel: str = "matmul") -> dict[str, object]:
    """The measurement on this job's world; every rank returns the same summary."""
    import meshcomm as mc

    g = mc.init(strict=True)
    n, r = g.size(), g.rank()
    x = (np.arange(int(mib * (1 << 20)) // 4) % 7 + r).astype(np.float32)
    want = mc.all_sum(x)
    comm = []
    for _ in range(reps):
        g.barrier()
        t0 = time.perf_counter()
        mc.all_sum(x)
        comm.append(time.perf_counter() - t0)
    c = statistics.median(comm)
    a = np.random.default_rng(r).standard_normal((matrix, matrix))
    # every rank runs the same number of products (the slowest rank's calibration)
    k = int(mc.all_max(np.array([_kernel_reps(c, a)]))[0])
    if kernel == "sleep":

        def work() -> None:
            time.sleep(c)
    else:

        def work() -> None:
            _compute(k, a)

    compute = []
    for _ in range(reps):
        g.barrier()
        t0 = time.perf_counter()
        work()
        compute.append(time.perf_counter() - t0)
    t = statistics.median(compute)
    ratios, saved = [], []
    out = np.empty_like(x)
    for _ in range(reps):
        g.barrier()
        t0 = time.perf_counter()
        h = mc.all_sum(x, out=out, async_op=True)
        work()
        h.wait()
        elapsed = time.perf_counter() - t0
        if out.tobytes() != want.tobytes():
            raise AssertionError(f"rank {r}: the async all_sum differs from the blocking one")
        e = float(mc.all_max(np.array([elapsed]))[0])  # the slowest rank's time
        ratios.append(e / t)
        saved.append(e / (t + c))
    return {
        "backend": g.backend,
        "kernel": kernel,
        "ranks": n,
        "mib": mib,
        "reps": reps,
        "allsum_s": round(c, 5),
        "compute_s": round(t, 5),
        "products": k,
        "matrix": matrix,
        "elapsed_over_T": round(statistics.median(ratios), 3),
        "elapsed_over_T_plus_C": round(statistics.median(saved), 3),
        "no_overlap_would_be": round((t + c) / t, 3),
        "cores": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/overlap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=16.0, help="all_sum size in MiB (default 16)")
    p.add_argument("--reps", type=int, default=7, help="repetitions of each measurement (default 7)")
    p.add_argument("--matrix", type=int, default=256, help="side of the compute kernel's matrices (default 256)")
    p.add_argument(
        "--kernel",
        choices=("matmul", "sleep"),
        default="matmul",
        help="what overlaps the all_sum: matrix products (default) or a sleep that needs no core",
    )
    p.add_argument("--driver", action="store_true", help="launch 2-rank jobs on sockets and mpi and print a table")
    p.add_argument("--backends", default="sockets,mpi", help="backends for --driver (default sockets,mpi)")
    args = p.parse_args(argv)
    if args.driver:
        return driver(args.backends.split(","), args.mib, args.reps, args.matrix, args.kernel)
    res = run(args.mib, args.reps, args.matrix, args.kernel)
    import meshcomm as mc

    if mc.init().rank() == 0:
        print("OVERLAP " + json.dumps(res), flush=True)
    return 0


def driver(backends: list[str], mib: float, reps: int, matrix: int = 256, kernel: str = "matmul") -> int:
    """Run one 2-rank job per backend and print a Markdown table of the results."""
    rows = []
    for b in backends:
        cmd = [
            sys.executable,
            "-m",
            "meshcomm",
            "launch",
            "-n",
            "2",
            "--backend",
            b,
            "--",
            os.path.abspath(__file__),
            "--mib",
            str(mib),
            "--reps",
            str(reps),
            "--matrix",
            str(matrix),
            "--kernel",
            kernel,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        line = next((ln for ln in p.stdout.splitlines() if "OVERLAP " in ln), None)
        if p.returncode or line is None:
            print(f"{b}: failed (exit {p.returncode})\n{p.stdout[-2000:]}{p.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(line.split("OVERLAP ", 1)[1]))
    print(
        "| backend | kernel | ranks | all_sum MiB | C: blocking all_sum (ms) | T: compute (ms) | elapsed / T "
        "| no overlap would be (T+C)/T | elapsed / (T+C) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['backend']} | {r['kernel']} | {r['ranks']} | {r['mib']:g} | {1000 * r['allsum_s']:.1f} "
            f"| {1000 * r['compute_s']:.1f} | {r['elapsed_over_T']:.2f} | {r['no_overlap_would_be']:.2f} "
            f"| {r['elapsed_over_T_plus_C']:.2f} |"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
