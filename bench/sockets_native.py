"""What the compiled shared-memory loop (meshcomm_sockets._shm) gains, measured inside one job.

    meshcomm launch -n 2 --backend sockets -- bench/sockets_native.py --sizes 8,65536,1048576

Between two jobs on a shared virtual machine the same call can differ by 1.5x (where the
ranks land), which hides a 20 % change; so one job alternates blocks of ``--calls``
blocking ``all_sum`` calls in three modes: the C loop with its one-call sum (publish,
wait, compare and sum in C, and the steps around it: the default for float32/64 and
32/64-bit integers), the C
loop with NumPy summing the slots, and the pure-Python loop (the protocol is the same, so
switching between blocks is safe: every rank switches after the same barrier),
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
    p.add_argument("--blocks", type=int, default=42, help="blocks per size (a third in each mode)")
    p.add_argument("--calls", type=int, default=300, help="calls per block")
    args = p.parse_args(argv)
    g = mc.init(strict=True)
    shm = getattr(getattr(g.transport, "path", None), "shm", None)
    if shm is None or shm.native is None:
        if g.rank() == 0:
            print(
                "sockets_native: this job has no shared-memory path with the C loop attached "
                "(run it on one host with --backend sockets and the compiled loop installed: meshcomm info)",
                file=sys.stderr,
            )
        return 2
    backend = g.transport
    # (the channel, the dtypes it sums, their codes for quick_sum, the backend's compiled entry)
    native, sums, codes, entry = shm.native, shm.native_sums, shm._sum_codes, backend.sum_now
    modes = {
        "C sum": (native, sums, codes, entry),
        "C loop, NumPy sum": (native, {}, {}, None),
        "Python": (None, {}, {}, None),
    }
    for size in (int(s) for s in args.sizes.split(",")):
        x = np.ones(max(1, size // 4), np.float32)
        for _ in range(200):
            g.all_sum(x)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for b in range(args.blocks):
            mode = list(modes)[b % len(modes)]
            shm.native, shm.native_sums, shm._sum_codes, backend.sum_now = modes[mode]
            times[mode].append(_time_block(g, x, args.calls))
        shm.native, shm.native_sums, shm._sum_codes, backend.sum_now = native, sums, codes, entry
        if g.rank() == 0:
            med = {m: statistics.median(t) * 1e6 for m, t in times.items()}
            print(
                f"{g.size()} ranks, {x.nbytes} B: "
                + ", ".join(f"{m} {v:.2f} us" for m, v in med.items())
                + f"; C sum / NumPy sum {med['C sum'] / med['C loop, NumPy sum']:.2f}, "
                f"C sum / Python {med['C sum'] / med['Python']:.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
