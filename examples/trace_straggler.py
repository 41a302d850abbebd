"""A data-parallel loop with one slow rank, to look at with the tracer (docs/observability.md).

Each step every rank "computes" (a sleep of 2 ms; rank 1 takes 6 ms every third step),
then all-sums a 256 KiB gradient and, every fifth step, all-gathers a small metric.
The trace shows the others waiting for rank 1:

    meshcomm launch -n 3 --trace /tmp/mc-trace examples/trace_straggler.py
    meshcomm trace summary /tmp/mc-trace/trace.json --plot /tmp/mc-trace/timeline.png

Open ``/tmp/mc-trace/trace.json`` in https://ui.perfetto.dev for the timeline itself.
"""

from __future__ import annotations

import time

import meshcomm as mc
import numpy as np


def main(steps: int = 12) -> None:
    world = mc.init()
    r = world.rank()
    grad = np.full(64 * 1024, float(r), np.float32)
    for step in range(steps):
        time.sleep(0.006 if r == 1 and step % 3 == 0 else 0.002)
        total = world.all_sum(grad)
        assert total[0] == sum(range(world.size()))
        if step % 5 == 4:
            world.all_gather(np.array([step, r], np.int64))
    world.barrier()
    if r == 0:
        print(f"{steps} steps on {world.size()} ranks")


if __name__ == "__main__":
    main()
