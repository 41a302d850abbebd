"""``all_sum`` against a persistent all-reduce (``all_reduce_init``, started each call) of the
same array on any backend, timed in alternating blocks of one job.

    meshcomm launch -n 2 --backend mpi -- bench/persistent.py [--sizes 8B,64KiB,1MiB]

Rank 0 prints the median µs per call of each (the middle block's median of ``--blocks``).
Both run through the world group with its default call check and stall inspector.
"""

from __future__ import annotations

import argparse

import meshcomm as mc
import numpy as np
from meshcomm.bench.measure import time_op
from meshcomm.bench.runner import GroupSync
from meshcomm.bench.sizes import parse_sizes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8B,64KiB,1MiB", help="comma list of byte sizes (default 8B,64KiB,1MiB)")
    p.add_argument("--blocks", type=int, default=3, help="alternating timed blocks per size and side (default 3)")
    p.add_argument("--min-time", type=float, default=0.2, help="timed seconds per block (default 0.2)")
    args = p.parse_args()
    world = mc.init(strict=True)
    sync = GroupSync(world)
    if world.rank() == 0:
        print(f"float32, backend {world.backend}, {world.size()} ranks: median µs per call", flush=True)
        print(f"{'size':>10} {'all_sum':>10} {'persistent':>10}", flush=True)
    for nbytes in parse_sizes(args.sizes):
        x = np.ones(max(nbytes // 4, 1), np.float32)
        times: dict[str, list[float]] = {"all_sum": [], "persistent": []}
        with world.all_reduce_init(x) as started:
            sides = {"all_sum": lambda a=x: mc.all_sum(a, group=world), "persistent": started}
            for _ in range(args.blocks):
                for side, call in sides.items():
                    times[side].append(time_op(call, sync, min_time=args.min_time).stats.median * 1e6)
        plain, persistent = (sorted(times[s])[len(times[s]) // 2] for s in ("all_sum", "persistent"))
        if world.rank() == 0:
            print(f"{nbytes:>10} {plain:>10.1f} {persistent:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
