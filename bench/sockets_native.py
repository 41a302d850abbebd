"""What the compiled shared-memory loop (meshcomm-sockets-native) gains, measured inside one job.

    meshcomm launch -n 2 --backend sockets -- bench/sockets_native.py --sizes 8,65536,1048576

Between two jobs on a shared virtual machine the same call can differ by 1.5x (where the
ranks land), which hides a 20 % change; so one job alternates blocks of ``--calls``
blocking ``all_sum`` calls with the C loop attached and detached (the protocol is the
same, so switching between blocks is safe: every rank switches after the same barrier),
``--blocks`` blocks per size, and rank 0 prints the median per-call time of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import meshcomm as mc
import numpy as np

__all__ = ["main"]


def _time_block(g: mc.Group, x: np.ndarray, calls: int) -> float:
    g.barrier()
    t = time.perf_counter()
    for _ in range(calls):
        g.all_sum(x)
    return (time.perf_counter() - t) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,65536,262144,1048576", help="bytes per all_sum, comma-separated")
    p.add_argument("--blocks", type=int, default=40, help="blocks per size (half with C, half without)")
    p.add_argument("--calls", type=int, default=300, help="calls per block")
    args = p.parse_args(argv)
    g = mc.init(strict=True)
    shm = getattr(getattr(g.transport, "path", None), "shm", None)
    if shm is None or shm.native is None:
        if g.rank() == 0:
            print("sockets_native: this job has no shared-memory path with the C loop attached "
                  "(run it on one host with --backend sockets and meshcomm-sockets-native installed)",
                  file=sys.stderr)
        return 2
    native = shm.native
    for size in (int(s) for s in args.sizes.split(",")):
        x = np.ones(max(1, size // 4), np.float32)
        for _ in range(200):
            g.all_sum(x)
        times: dict[str, list[float]] = {"C": [], "Python": []}
        for b in range(args.blocks):
            mode = "C" if b % 2 == 0 else "Python"
            shm.native = native if mode == "C" else None
            times[mode].append(_time_block(g, x, args.calls))
        shm.native = native
        if g.rank() == 0:
            c, py = (statistics.median(times[k]) * 1e6 for k in ("C", "Python"))
            print(f"{g.size()} ranks, {x.nbytes} B: C loop {c:.2f} us, Python loop {py:.2f} us, "
                  f"C/Python {c / py:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
