"""A rank of a fault test across network namespaces. Prints JSON lines: what happened, when.

usage: netns_faults.py MODE   (loop | check | ok)

* loop: all_sum of 1 Mi float32 over and over (prints {"ready": ...} after the first one)
  until an error or ``LOOP_SECONDS``; the error line carries the wall-clock time it was
  raised (``t``), so the test measures how long after the fault every rank failed.
* check: a fixed set of collectives and send/recv with known answers (``ok`` true when
  every result matches NumPy) and how long they took.
* ok: init and one small all_sum.
"""

import json
import os
import sys
import time

import meshcomm as mc
import numpy as np


def say(**kw):
    print(json.dumps(kw), flush=True)


mode = sys.argv[1]
t0 = time.monotonic()
try:
    g = mc.init(strict=True)
except mc.DistributedError as exc:
    say(
        phase="init",
        error=type(exc).__name__,
        peer=getattr(exc, "peer", None),
        t=time.time(),
        elapsed=time.monotonic() - t0,
        message=str(exc),
    )
    sys.exit(0)
r, n = g.rank(), g.size()
t0 = time.monotonic()
try:
    if mode == "loop":
        x = np.ones(1 << 20, np.float32)
        limit = float(os.environ.get("LOOP_SECONDS", "120"))
        i = 0
        while time.monotonic() - t0 < limit:
            got = mc.all_sum(x)
            if i == 0:
                assert got[0] == n
                say(ready=r)
            i += 1
        say(error=None, iterations=i)
    elif mode == "check":
        ok = True
        big = np.arange(1 << 20, dtype=np.float64) + r
        ok &= bool(np.array_equal(mc.all_sum(big), np.arange(1 << 20) * n + n * (n - 1) / 2))
        ok &= bool(np.array_equal(mc.all_max(np.full(1000, r)), np.full(1000, n - 1)))
        ok &= bool(
            np.array_equal(
                mc.all_gather(np.full((3, 2), r, np.int32)),
                np.repeat(np.arange(n, dtype=np.int32), 3)[:, None].repeat(2, 1),
            )
        )
        rows = np.arange(n * 50_000, dtype=np.int64).reshape(n * 1000, 50) * (r + 1)
        want = np.arange(n * 50_000, dtype=np.int64).reshape(n * 1000, 50) * (n * (n + 1) // 2)
        ok &= bool(np.array_equal(mc.sum_scatter(rows), want[r * 1000 : (r + 1) * 1000]))
        ok &= bool(
            np.array_equal(mc.broadcast(np.full(300_000, r, np.float32), n - 1), np.full(300_000, n - 1, np.float32))
        )
        msg = np.arange(200_000, dtype=np.float32) * (r + 1)
        if r % 2 == 0:
            mc.send(msg, (r + 1) % n)
            got = mc.recv_like(msg, (r - 1) % n)
        else:
            got = mc.recv_like(msg, (r - 1) % n)
            mc.send(msg, (r + 1) % n)
        ok &= bool(np.array_equal(got, np.arange(200_000, dtype=np.float32) * ((r - 1) % n + 1)))
        g.barrier()
        say(ok=ok, seconds=time.monotonic() - t0)
    elif mode == "ok":
        say(result=mc.all_sum(np.full(3, r + 1.0)).tolist())
except mc.DistributedError as exc:
    say(
        phase="op",
        error=type(exc).__name__,
        peer=getattr(exc, "peer", None),
        t=time.time(),
        elapsed=time.monotonic() - t0,
        message=str(exc),
    )
