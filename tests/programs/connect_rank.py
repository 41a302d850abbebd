"""A rank of a job whose ranks connect only when needed (MESHCOMM_SOCKETS_CONNECT=needed).
Prints JSON lines: what it saw, how many sockets it held, the error it got.

usage: connect_rank.py MODE   (count | kill | ended | grow | strangers)
"""

import json
import os
import signal
import sys
import time

import meshcomm as mc
import numpy as np


def sockets() -> int:
    """Sockets this process holds (the listener and its peer connections)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the directory's own descriptor, closed by now
            pass
    return n


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


mode = sys.argv[1]
g = mc.init(strict=True)
r, n = g.rank(), g.size()
t0 = time.monotonic()
try:
    if mode == "count":
        say(stage="init", sockets=sockets())
        mc.barrier()  # no rank goes on to an operation that connects others before all counted
        for size in (2, 1 << 20):  # doubling and ring all-reduce
            x = np.arange(size, dtype=np.float64) + r
            assert np.array_equal(mc.all_sum(x), n * np.arange(size, dtype=np.float64) + n * (n - 1) / 2)
        assert mc.all_gather(np.array([r])).tolist() == list(range(n))
        mc.barrier()
        say(stage="all_sum, all_gather, barrier", sockets=sockets())
        mc.barrier()
        got = mc.all_to_all(np.arange(n, dtype=np.int64) + 1000 * r)
        assert got.tolist() == [1000 * q + r for q in range(n)]
        say(stage="all_to_all", sockets=sockets())
    elif mode == "kill":
        x = np.ones(1 << 16, np.float32)
        for i in range(1000):
            if r == int(os.environ["VICTIM"]) and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            mc.all_sum(x)
    elif mode == "ended":
        victim = int(os.environ["VICTIM"])
        mc.barrier()
        if r == victim:
            sys.exit(0)
        time.sleep(1.0)  # the victim's program has ended by now
        if r == 0:
            mc.send(np.ones(4), victim)  # the first contact of rank 0 and the victim
        say(error=None)
    elif mode == "grow":
        g.grow()
    elif mode == "strangers":  # the test floods rank 3's port between READY and the all-to-all
        mc.barrier()
        say(ready=r)
        time.sleep(float(os.environ.get("PAUSE", "2")))
        got = mc.all_to_all(np.arange(n, dtype=np.int64) + 1000 * r)  # first contacts: 0-3, 1-4
        assert got.tolist() == [1000 * q + r for q in range(n)], got
    say(error=None)
except mc.DistributedError as exc:
    say(error=type(exc).__name__, peer=getattr(exc, "peer", None), elapsed=time.monotonic() - t0, message=str(exc))
