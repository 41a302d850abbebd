"""Rank side of ``tests/test_launch_exits.py``: ``launch_jobs.py MODE [ARGS...]`` under
``meshcomm launch`` on any backend (sockets, mpi, gloo).

Every mode first writes this process's pid to ``$MC_TEST_PIDDIR/rank-R-PID.pid`` (when the
variable is set). The rank comes from ``MLX_RANK`` or from the MPI launcher's variables,
so the modes that do not start meshcomm work under mpiexec too. Modes:

* ``raise RANK``: everyone starts; RANK raises ``KeyError('launch-jobs')`` once the others
  wait in ``all_sum`` (which can only finish with RANK).
* ``exit RANK CODE``: the same, but RANK calls ``sys.exit(CODE)``.
* ``stuck RANK``: RANK sleeps in ``stuck_here()`` while the others wait in ``all_sum``
  until MLX_TIMEOUT: the launcher must print every rank's stack.
* ``wait``: everyone starts, prints ``ready`` and blocks in ``recv`` from a rank that
  never sends, until stopped.
* ``spam LINES``: print LINES long self-checking lines on stdout and stderr from two
  threads, without meshcomm (whole-line output through any launcher).
"""

from __future__ import annotations

import os
import sys
import time

from launch_rank import record_pid, spam, spam_line  # noqa: F401  (spam_line: the tests check lines with it)


def stuck_here() -> None:
    time.sleep(600)


def main() -> None:
    record_pid(os.getpid())
    mode = sys.argv[1]
    if mode == "spam":
        spam(int(sys.argv[2]))
        return

    import meshcomm as mc
    import numpy as np

    g = mc.init(strict=True)
    r, n = g.rank(), g.size()
    g.barrier()
    print("ready", flush=True)
    if mode == "wait":
        mc.recv((1,), np.float32, (r + 1) % n)
        print("recv returned?!", flush=True)
        sys.exit(9)
    bad = int(sys.argv[2])
    g.barrier()
    if r == bad:
        time.sleep(0.5)  # let the others enter the collective first
        print(f"failing at {time.time():.6f}", flush=True)
        if mode == "raise":
            raise KeyError("launch-jobs")
        if mode == "exit":
            sys.exit(int(sys.argv[3]))
        if mode == "stuck":
            stuck_here()
        sys.exit(f"unknown mode {mode!r}")
    print("waiting in all_sum", flush=True)
    mc.all_sum(np.ones(3))
    print("all_sum returned without the failed rank?!", flush=True)
    sys.exit(8)


if __name__ == "__main__":
    main()
