"""What the core's cross-rank call check costs on a backend: ``all_sum`` through a group with
the check and through one without it, on the same transport, timed in alternating blocks.

    meshcomm launch -n 2 --backend gloo -- bench/check_cost.py
    meshcomm launch -n 4 --backend mpi -- bench/check_cost.py --sizes 8B,64KiB,1MiB --blocks 5

Rank 0 prints one row per size: the median µs per call without and with the check (the
middle block's median of ``--blocks``), and what the check adds. Both groups share the
world's backend, so they differ only in the check (``MESHCOMM_CHECK_CALLS``).
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
    plain = mc.Group(world.transport, "without the check", check_calls=False)
    sync = GroupSync(plain)
    if world.rank() == 0:
        print(f"all_sum float32, backend {world.backend}, {world.size()} ranks: median µs per call", flush=True)
        print(f"{'size':>10} {'off':>10} {'on':>10} {'added':>10}", flush=True)
    for nbytes in parse_sizes(args.sizes):
        x = np.ones(max(nbytes // 4, 1), np.float32)
        times: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.blocks):
            for side, group in (("off", plain), ("on", world)):
                t = time_op(lambda g=group, a=x: mc.all_sum(a, group=g), sync, min_time=args.min_time)
                times[side].append(t.stats.median * 1e6)
        off, on = (sorted(times[s])[len(times[s]) // 2] for s in ("off", "on"))
        if world.rank() == 0:
            print(f"{nbytes:>10} {off:>10.1f} {on:>10.1f} {on - off:>+10.1f}", flush=True)


if __name__ == "__main__":
    main()
