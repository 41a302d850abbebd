"""A rank of a fault-test job. Prints one JSON line: what it got and how long it took.

usage: sockets_faults.py MODE   (kill | sleep | shape | op | ok)
"""

import json
import os
import signal
import sys
import time

import meshcomm as mc
import numpy as np

mode = sys.argv[1]
t0 = time.monotonic()
try:
    g = mc.init(strict=True)
except mc.DistributedError as exc:
    print(
        json.dumps(
            {
                "phase": "init",
                "error": type(exc).__name__,
                "peer": getattr(exc, "peer", None),
                "elapsed": time.monotonic() - t0,
                "message": str(exc),
            }
        ),
        flush=True,
    )
    sys.exit(0)
r, n = g.rank(), g.size()
x = np.ones(1 << 20, np.float32)
t0 = time.monotonic()
try:
    if mode == "kill":
        for i in range(1000):
            if r == n - 1 and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            mc.all_sum(x)
    elif mode == "sleep":
        if r == 1:
            time.sleep(float(os.environ["SLEEP"]))
        mc.all_sum(np.ones(4))
    elif mode == "shape":
        mc.all_sum(np.ones(1000 + (r == 1), np.float32))
    elif mode == "op":
        (mc.all_gather if r == 0 else mc.all_sum)(np.ones(8, np.float32))
    elif mode == "ok":
        got = mc.all_sum(np.full(3, r + 1.0))
        print(json.dumps({"result": got.tolist()}), flush=True)
        sys.exit(0)
    print(json.dumps({"error": None}), flush=True)
except mc.DistributedError as exc:
    print(
        json.dumps(
            {
                "phase": "op",
                "error": type(exc).__name__,
                "peer": getattr(exc, "peer", None),
                "elapsed": time.monotonic() - t0,
                "message": str(exc),
            }
        ),
        flush=True,
    )
    if mode != "sleep" or r != 1:
        # a second call on a broken group fails at once with the first cause
        try:
            mc.all_sum(np.ones(2))
        except mc.DistributedError as again:
            print(json.dumps({"again": type(again).__name__, "message": str(again)}), flush=True)
