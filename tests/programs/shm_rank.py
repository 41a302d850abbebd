"""A rank for the shared-memory tests: report the path, then run a mode.

usage: shm_rank.py MODE  (ok | loop | kill | wake-ended | numbering [late])
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
info = {
    "rank": r,
    "mode": getattr(getattr(t, "path", None), "name", "?"),
    "local": None if shm is None else shm.local,
    "native": None if shm is None else shm.native is not None,
}
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
        print(
            json.dumps(
                {"error": type(exc).__name__, "peer": getattr(exc, "peer", None), "elapsed": time.monotonic() - t0}
            ),
            flush=True,
        )
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
elif mode == "numbering":  # numbering [late]
    # small all_sums (one C call each, no Call object made) between calls of every other
    # path, with late peers (a sleep, a wake-up); then a mismatch (rank 1 late with "late"),
    # whose message names each rank's call number
    total = n * (n + 1) // 2
    ok = True
    for i in range(12):
        if r == 1 and i in (3, 7):
            time.sleep(0.3)  # beyond the spin: the others sleep, then rank 1 wakes them
        ok &= bool(np.all(mc.all_sum(np.full(3, r + 1.0, np.float32)) == total))
        ok &= bool(np.all(mc.all_max(np.full(3, r + 1, np.int64)) == n))
        ok &= bool(np.all(mc.all_sum(np.full(3, r + 1, np.float16)) == total))  # not summed in C
        ok &= bool(np.all(mc.all_sum(np.full(1 << 16, r + 1, np.int32)) == total))  # 256 KiB
        ok &= bool(np.all(mc.all_gather(np.full(2, r, np.int32)) == np.repeat(np.arange(n), 2)))
        g.barrier()
    if r == 1 and sys.argv[2:] == ["late"]:
        time.sleep(0.3)
    try:
        mc.all_sum(np.ones(2, np.float64 if r == 1 else np.float32))
        error = "no error"
    except mc.CollectiveMismatchError as exc:
        error = str(exc)
    print(json.dumps({"results": ok, "error": error}), flush=True)
else:
    got = mc.all_sum(np.full(5, r + 1.0))
    assert (got == n * (n + 1) / 2).all(), got
