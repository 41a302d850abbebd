"""What the core's layers cost a small blocking all_sum on any backend, in alternating blocks
of one job: the backend's ``all_reduce`` alone (into a new array, as the core calls it), the
group's ``all_sum`` on the compiled call path and on the pure-Python one (a group with the
pure-Python guard over the same backend, as ``MESHCOMM_COMPILED=0`` gives), and
``mc.all_sum`` without a group (the default group, the way the README calls it).

    meshcomm launch -n 2 -- bench/core_layers.py [--sizes 8B,4KiB,64KiB] [--backend mpi]

Rank 0 prints one row per size: the median µs per call of each (the middle block's median of
``--blocks``), then each layer as a ratio to the backend alone. The stall inspector and the
core's call check are on, as in a user's job.
"""

from __future__ import annotations

import argparse

import meshcomm as mc
import numpy as np
from meshcomm.api.guard import WorldGuard
from meshcomm.bench.measure import time_op
from meshcomm.bench.runner import GroupSync
from meshcomm.bench.sizes import parse_sizes

SIDES = ("backend", "compiled", "pure-Python", "mc.all_sum")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8B,4KiB,64KiB", help="comma list of byte sizes (default 8B,4KiB,64KiB)")
    p.add_argument("--blocks", type=int, default=5, help="alternating timed blocks per size and side (default 5)")
    p.add_argument("--min-time", type=float, default=0.2, help="timed seconds per block (default 0.2)")
    args = p.parse_args()
    world = mc.init(strict=True)
    if world._lane is None:
        raise SystemExit("this world runs the pure-Python call path (MESHCOMM_COMPILED=0, or none installed)")
    python = mc.Group(world.transport, "pure-Python path", guard=WorldGuard())
    sync = GroupSync(world)
    moves = world._moves
    if world.rank() == 0:
        print(f"float32 all_sum, backend {world.backend}, {world.size()} ranks: median µs per call", flush=True)
        print(f"{'size':>8}" + "".join(f"{side:>13}" for side in SIDES) + "   ratios to the backend", flush=True)
    for nbytes in parse_sizes(args.sizes):
        x = np.ones(max(nbytes // 4, 1), np.float32)

        def backend(a: np.ndarray = x) -> np.ndarray:
            res = np.empty(a.shape, a.dtype)
            moves.all_reduce(a, res, "sum")
            return res

        calls = {
            "backend": backend,
            "compiled": lambda a=x: world.all_sum(a),
            "pure-Python": lambda a=x: python.all_sum(a),
            "mc.all_sum": lambda a=x: mc.all_sum(a),
        }
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for _ in range(args.blocks):
            for side in SIDES:
                times[side].append(time_op(calls[side], sync, min_time=args.min_time).stats.median * 1e6)
        if world.rank() == 0:
            med = {side: sorted(times[side])[len(times[side]) // 2] for side in SIDES}
            ratios = " ".join(f"{med[side] / med['backend']:.2f}" for side in SIDES[1:])
            print(f"{nbytes:>8}" + "".join(f"{med[side]:>13.2f}" for side in SIDES) + f"   {ratios}", flush=True)


if __name__ == "__main__":
    main()
