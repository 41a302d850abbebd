"""One rank of a job started by srun or mpirun on the Slurm test cluster (tests/slurm.py).

``slurm_rank.py [BACKEND]``: start the job (``mc.init(strict=True)``, with BACKEND when
given, else whatever meshcomm picks from the environment), run all_sum, all_gather and
broadcast, and print one line ``INFO {json}``: rank, size, hostname, the backend, the
placement meshcomm read and whether each result was right (computed here from rank and
size).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import meshcomm as mc
import numpy as np


def main() -> None:
    t0 = time.time()
    backend = sys.argv[1] if len(sys.argv) > 1 else None
    g = mc.init(strict=True, backend=backend)
    r, n = g.rank(), g.size()
    g.barrier()
    up = time.time()
    x = np.arange(6, dtype=np.float32) + r
    want_sum = np.arange(6, dtype=np.float32) * n + n * (n - 1) / 2
    got_sum = mc.all_sum(x)
    got_gather = mc.all_gather(np.full(2, r, np.int32))
    want_gather = np.repeat(np.arange(n, dtype=np.int32), 2)
    got_bcast = mc.broadcast(np.full(3, 100 + r, np.int64), root=n - 1)
    want_bcast = np.full(3, 100 + n - 1, np.int64)
    info = {
        "rank": r,
        "size": n,
        "host": socket.gethostname(),
        "backend": g.backend,
        "slurm_procid": os.environ.get("SLURM_PROCID"),
        "sum_ok": bool(np.array_equal(got_sum, want_sum)),
        "gather_ok": bool(np.array_equal(got_gather, want_gather)),
        "bcast_ok": bool(np.array_equal(got_bcast, want_bcast)),
        "init_seconds": up - t0,
    }
    print("INFO " + json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
