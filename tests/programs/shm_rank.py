"""A rank for the shared-memory tests: report the path, then run a mode.

usage: shm_rank.py MODE  (ok | loop | kill | wake-ended)
"""

import json
import os
import signal
import sys
import time

import meshcomm as mc
import numpy as np

g = mc.init(strict=True)
t = g.transport
r, n = g.rank(), g.size()
shm = getattr(getattr(t, "path", None), "shm", None)
info = {"rank": r, "mode": getattr(getattr(t, "path", None), "name", "?"), "local": None if shm is None else shm.local,
        "native": None if shm is None else shm.native is not None}
print(json.dumps(info), flush=True)
mode = sys.argv[1]
x = np.ones(1 << 18, np.float32)
if mode == "loop":  # run until stopped from outside
    print("ready", flush=True)
    while True:
        mc.all_sum(x)
elif mode == "kill":
    t0 = time.monotonic()
    try:
        for i in range(100000):
            if r == 1 and i == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            mc.all_sum(x)
    except mc.DistributedError as exc:
        print(json.dumps({"error": type(exc).__name__, "peer": getattr(exc, "peer", None),
                          "elapsed": time.monotonic() - t0}), flush=True)
elif mode == "wake-ended":  # 2 ranks: waking a rank whose FIFO nobody reads any more
    from meshcomm.plugin import PeerLostError
    from meshcomm_sockets.engine import Call

    mc.all_sum(np.ones(4))  # both ranks published the same piece
    if r == 1:
        os.close(shm.fifo)  # as if rank 1 had ended after its last call
        shm.fifo = -1
        time.sleep(3)
    else:
        time.sleep(1)
        call = Call(1, 1, 0, 0, 4, "world")
        shm._wake(call, 1, shm.peer_fifos[1])  # rank 1 published this piece: not a loss
        shm.seq += 1  # now rank 1 has not published this rank's piece: it died before joining it
        try:
            shm._wake(call, 1, shm.peer_fifos[1])
            outcome = "no error"
        except PeerLostError as exc:
            outcome = f"PeerLostError peer={exc.peer}"
        shm.seq -= 1
        print(json.dumps({"ahead": outcome}), flush=True)
else:
    got = mc.all_sum(np.full(5, r + 1.0))
    assert (got == n * (n + 1) / 2).all(), got
