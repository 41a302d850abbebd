"""A rank of the tracing tests (tests/test_trace.py): one of every kind of operation.

``trace_rank.py ops``: the operations below, then prints ``OPS <json>`` (the names this
rank issued, in order) and ``ACTIVE <bool>`` (whether the core's recorder hook is set).
``trace_rank.py stall SECONDS``: rank 2 sleeps SECONDS between two all_sums.
``trace_rank.py fail``: rank 1 raises after two all_sums (the others then fail too).
``trace_rank.py mismatch``: rank 2 passes another shape to the first all_sum.
"""

from __future__ import annotations

import json
import sys
import time

import meshcomm as mc
import numpy as np
from meshcomm.trace import recorder


def ops(world: mc.Group) -> list[str]:
    r, n = world.rank(), world.size()
    done = []
    for _ in range(3):
        world.all_sum(np.arange(4, dtype=np.float32))
        done.append("all_sum")
    world.all_gather(np.ones(2, np.int64))
    world.barrier()
    world.broadcast(np.ones(5), root=0)
    done += ["all_gather", "barrier", "broadcast"]
    sub = world.split(r % 2)
    done.append("split")
    sub.all_max(np.ones(8))
    done.append("all_max")
    if r == 0:
        world.send(np.ones(3), 1)
        done.append("send")
    elif r == 1:
        world.recv((3,), np.float64, 0)
        done.append("recv")
    world.all_gather_object({"rank": r})
    world.all_sum(np.ones(1024, np.float64), async_op=True).wait()
    world.sum_scatter(np.ones(2 * n, np.float32))
    done += ["all_gather_object", "all_sum", "sum_scatter"]
    return done


def main() -> None:
    world = mc.init(strict=True)
    what = sys.argv[1]
    if what == "ops":
        done = ops(world)
        print("OPS " + json.dumps(done))
        print(f"ACTIVE {recorder.active is not None}")
    elif what == "stall":
        world.all_sum(np.ones(4))
        if world.rank() == 2:
            time.sleep(float(sys.argv[2]))
        world.all_sum(np.ones(4))
        print("STALL DONE")
    elif what == "mismatch":
        world.all_sum(np.ones(4 + (world.rank() == 2)))
    elif what == "fail":
        world.all_sum(np.ones(4))
        world.all_sum(np.ones(4))
        if world.rank() == 1:
            raise KeyError("planned failure of rank 1")
        world.all_sum(np.ones(4))


if __name__ == "__main__":
    main()
