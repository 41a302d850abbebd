"""Benchmark: meshcomm's ``all_sum`` on the gloo backend vs raw torch.distributed gloo.

Both run in the same processes on the same float32 buffers. For each size, blocks of
back-to-back calls of either side alternate (the order flips every round), and the
median block time per call is reported, the slowest rank's. The raw side is what a torch user writes:
``init_process_group("gloo")`` then ``dist.all_reduce(tensor)`` in place on a tensor
viewing the NumPy buffer. ``mc.all_sum(x)`` must leave the input untouched and return a
new array, so it copies the buffer once per call (except on 2 ranks from 8 MiB, where the
ranks exchange halves instead, ``meshcomm_gloo.pairsum``); ``mc.all_sum(x, out=x)`` reduces
in place like torch (the "out=x" column).

Usage::

    python bench/bench_gloo.py                 # 2 and 4 ranks, 8 B .. 64 MiB, table on stdout
    python bench/bench_gloo.py --ranks 2 --max-mib 4 --markdown
    python bench/bench_gloo.py --ranks 2 --sizes 524288,2097152   # chosen sizes, in bytes
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from meshcomm.bench.sizes import format_size

__all__ = ["main", "worker", "SIZES"]

#: message sizes in bytes: 8 B, then x8 up to 64 MiB
SIZES = [8 * 8**i for i in range(8)] + [64 << 20]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plan(nbytes: int) -> tuple[int, int]:
    """(rounds, calls per timed block) for a message size: about 5 ms or more per block."""
    if nbytes >= 16 << 20:
        return 7, 1
    if nbytes >= 1 << 20:
        return 11, 4
    if nbytes >= 64 << 10:
        return 15, 20
    return 15, 100


def worker(sizes: list[int]) -> None:
    """One rank: time both sides for every size; rank 0 prints JSON results."""
    import datetime

    import meshcomm as mc
    import numpy as np
    import torch
    import torch.distributed as dist

    g = mc.init(strict=True, backend="gloo")
    rank, size = g.rank(), g.size()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['BENCH_TORCH_PORT']}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=120),
    )
    results = []
    for nbytes in sizes:
        x = np.zeros(nbytes // 4, dtype=np.float32)
        t = torch.from_numpy(x)
        for _ in range(3):  # warm up both paths (connections, allocator)
            mc.all_sum(x, group=g)
            mc.all_sum(x, group=g, out=x)
            dist.all_reduce(t)
        times: dict[str, list[float]] = {"meshcomm": [], "out": [], "torch": []}
        sides = {
            "meshcomm": lambda x=x: mc.all_sum(x, group=g),
            "out": lambda x=x: mc.all_sum(x, group=g, out=x),
            "torch": lambda t=t: dist.all_reduce(t),
        }
        rounds, calls = _plan(nbytes)
        for i in range(rounds):  # alternate which side goes first, so drift hits both alike
            for name in ("meshcomm", "out", "torch") if i % 2 == 0 else ("torch", "out", "meshcomm"):
                fn = sides[name]
                g.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - t0) / calls)
        # each rank's median; the slowest rank's median is what the job sees
        med = np.array([statistics.median(times[k]) for k in ("meshcomm", "out", "torch")])
        worst = mc.all_max(med, group=g)
        results.append({"bytes": nbytes, "meshcomm": float(worst[0]), "out": float(worst[1]), "torch": float(worst[2])})
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps({"ranks": size, "rows": results}), flush=True)


def _run(nranks: int, sizes: list[int], timeout: float) -> dict:
    port, tport = _free_port(), _free_port()
    procs = []
    for r in range(nranks):
        env = dict(
            os.environ,
            MLX_RANK=str(r),
            MLX_WORLD_SIZE=str(nranks),
            MESHCOMM_GLOO_PORT=str(port),
            MESHCOMM_GLOO_ADDR="127.0.0.1",
            BENCH_TORCH_PORT=str(tport),
            MLX_BACKEND="gloo",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", "--sizes", ",".join(map(str, sizes))],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"bench: rank {r} of {nranks} did not finish within {timeout:g} s") from None
        if p.returncode:
            raise SystemExit(f"bench: rank {r} of {nranks} failed (exit {p.returncode}):\n{err[-3000:]}")
        outs.append(out)
    for line in outs[0].splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise SystemExit(f"bench: rank 0 printed no result:\n{outs[0][-2000:]}")


def _table(runs: list[dict]) -> str:
    lines = [
        "| ranks | size | meshcomm all_sum (µs) | all_sum(x, out=x) (µs) | torch all_reduce (µs) | ratio "
        "| ratio out=x |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        for row in run["rows"]:
            lines.append(
                f"| {run['ranks']} | {format_size(row['bytes'])} | {row['meshcomm'] * 1e6:,.0f} | "
                f"{row['out'] * 1e6:,.0f} | {row['torch'] * 1e6:,.0f} | "
                f"{row['meshcomm'] / row['torch']:.3f} | {row['out'] / row['torch']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for each rank count and print the table (ratio = meshcomm / torch)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="comma list of rank counts (default 2,4)")
    p.add_argument("--max-mib", type=float, default=64, help="largest message in MiB (default 64)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before a run is abandoned")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="", help="comma list of sizes in bytes (default: the sizes up to --max-mib)")
    p.add_argument("--markdown", action="store_true", help="(the table is always markdown)")
    args = p.parse_args(argv)
    max_bytes = int(args.max_mib * (1 << 20))
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else [n for n in SIZES if n <= max_bytes]
    if any(n <= 0 or n % 4 for n in sizes):
        p.error(f"--sizes {args.sizes}: every size must be a positive multiple of 4 bytes (float32)")
    if args.worker:
        worker(sizes)
        return 0
    runs = [_run(int(n), sizes, args.timeout) for n in args.ranks.split(",")]
    print("float32, median per call of the slowest rank; ratio = meshcomm / torch (1.00 = same speed)")
    print(_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
