"""meshcomm's main example: every collective once, with results a person can check.

Run it on 4 ranks of the default (sockets) backend:

    meshcomm launch -n 4 examples/quickstart.py

or alone (a size-1 group): ``python examples/quickstart.py``.
"""

from __future__ import annotations

import time

import meshcomm as mc
import numpy as np


def main() -> None:
    world = mc.init()
    r, n = world.rank(), world.size()

    # all_sum: rank r contributes [r, r, r]; everyone gets 0 + 1 + ... + (n-1)
    total = mc.all_sum(np.full(3, r, dtype=np.int64))
    expect = n * (n - 1) // 2
    ok_sum = bool((total == expect).all())

    # all_gather: rank r contributes its rank squared; everyone gets [0, 1, 4, 9, ...]
    squares = mc.all_gather(np.array([r * r]))
    ok_gather = squares.tolist() == [q * q for q in range(n)]

    # broadcast: rank 0 picks a number, everyone gets it
    pick = mc.broadcast(np.array(4242 if r == 0 else -1), root=0)
    ok_bcast = int(pick) == 4242

    # sum_scatter: everyone contributes arange(n) * (r+1); rank r gets element r of the sum
    mine = mc.sum_scatter(np.arange(n, dtype=np.float64) * (r + 1))
    ok_scatter = float(mine[0]) == r * n * (n + 1) / 2

    # send/recv around a ring (even ranks send first so nobody waits on a full pipe)
    ok_ring = True
    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        if r % 2 == 0:
            mc.send(np.array([r]), right)
            got = mc.recv((1,), np.int64, left)
        else:
            got = mc.recv((1,), np.int64, left)
            mc.send(np.array([r]), right)
        ok_ring = int(got[0]) == left

    # a bigger all_sum, timed after one warm-up call (the first one also pays for mapping
    # the result's fresh memory)
    big = np.ones(4 << 20, dtype=np.float32)  # 16 MiB
    mc.all_sum(big)
    world.barrier()
    t0 = time.perf_counter()
    big_sum = mc.all_sum(big)
    dt = time.perf_counter() - t0
    ok_big = bool((big_sum == n).all())

    checks = {
        "all_sum": ok_sum,
        "all_gather": ok_gather,
        "broadcast": ok_bcast,
        "sum_scatter": ok_scatter,
        "send/recv": ok_ring,
        "16 MiB all_sum": ok_big,
    }
    status = "all correct" if all(checks.values()) else "WRONG: " + ", ".join(k for k, v in checks.items() if not v)
    print(
        f"rank {r}/{n} on {world.backend}: sum of ranks = {int(total[0])} (expected {expect}), "
        f"gathered squares = {squares.tolist()}, 16 MiB all_sum in {dt * 1e3:.1f} ms (warm) -> {status}",
        flush=True,
    )
    world.barrier()
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
