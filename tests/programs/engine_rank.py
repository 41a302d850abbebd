"""One rank of a job started by another engine (mpirun, torchrun, by hand): init, a few
operations with checked results, one JSON line per rank."""

from __future__ import annotations

import json
import os
import time

import meshcomm as mc
import numpy as np
from meshcomm.runtime.config import Config


def main() -> int:
    t0 = time.monotonic()
    try:
        g = mc.init(strict=True)
    except mc.DistributedError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return 1
    init = time.monotonic() - t0
    r, n = g.rank(), g.size()
    total = mc.all_sum(np.arange(1000, dtype=np.float64) * (r + 1))
    sum_ok = bool(np.array_equal(total, np.arange(1000, dtype=np.float64) * (n * (n + 1) // 2)))
    gathered = mc.all_gather(np.full(3, r, np.int32))
    gather_ok = gathered.tolist() == [q for q in range(n) for _ in range(3)]
    ring_ok = True
    if n > 1:  # every rank sends to the next and receives from the previous
        if r % 2 == 0:
            mc.send(np.full(5, r, np.int64), (r + 1) % n)
            got = mc.recv((5,), np.int64, (r - 1) % n)
        else:
            got = mc.recv((5,), np.int64, (r - 1) % n)
            mc.send(np.full(5, r, np.int64), (r + 1) % n)
        ring_ok = got.tolist() == [(r - 1) % n] * 5
    cfg = Config.load()
    print(
        json.dumps(
            {
                "rank": r,
                "size": n,
                "backend": g.backend,
                "ok": sum_ok and gather_ok and ring_ok,
                "shm": getattr(getattr(g.transport, "path", None), "name", None),
                "placement": cfg.placement_source,
                "coordinator": cfg.coordinator,
                "master_port": os.environ.get("MASTER_PORT"),
                "init_s": init,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
