"""What a small call pays on any backend, three ways to run the same float32 all-reduce, timed
in alternating blocks of one job: ``all_sum`` through a group without the core's call check,
``all_sum`` as users call it (the world group: the check on), and a start of a persistent
all-reduce of the same array (``all_reduce_init``).

    meshcomm launch -n 2 --backend mpi -- bench/call_paths.py [--sizes 8B,64KiB,1MiB]

Rank 0 prints one row per size: the median µs per call of each (the middle block's median
of ``--blocks``). The groups share the world's backend, so "no check" and "all_sum" differ
only in the check (``MESHCOMM_CHECK_CALLS``), "all_sum" and "persistent" only in the
per-call set-up.
"""

from __future__ import annotations

import argparse

import meshcomm as mc
import numpy as np
from meshcomm.bench.measure import time_op
from meshcomm.bench.runner import GroupSync
from meshcomm.bench.sizes import parse_sizes

SIDES = ("no check", "all_sum", "persistent")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8B,64KiB,1MiB", help="comma list of byte sizes (default 8B,64KiB,1MiB)")
    p.add_argument("--blocks", type=int, default=3, help="alternating timed blocks per size and side (default 3)")
    p.add_argument("--min-time", type=float, default=0.2, help="timed seconds per block (default 0.2)")
    args = p.parse_args()
    world = mc.init(strict=True)
    plain = mc.Group(world.transport, "without the check", check_calls=False)
    sync = GroupSync(plain)
    if world.rank() == 0:
        print(f"float32, backend {world.backend}, {world.size()} ranks: median µs per call", flush=True)
        print(f"{'size':>10}" + "".join(f"{side:>12}" for side in SIDES), flush=True)
    for nbytes in parse_sizes(args.sizes):
        x = np.ones(max(nbytes // 4, 1), np.float32)
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        with world.all_reduce_init(x) as started:
            calls = {
                "no check": lambda a=x: mc.all_sum(a, group=plain),
                "all_sum": lambda a=x: mc.all_sum(a, group=world),
                "persistent": started,
            }
            for _ in range(args.blocks):
                for side in SIDES:
                    times[side].append(time_op(calls[side], sync, min_time=args.min_time).stats.median * 1e6)
        if world.rank() == 0:
            medians = (sorted(times[side])[len(times[side]) // 2] for side in SIDES)
            print(f"{nbytes:>10}" + "".join(f"{m:>12.1f}" for m in medians), flush=True)


if __name__ == "__main__":
    main()
