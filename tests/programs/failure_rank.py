"""One rank of a failure-matrix job: ``failure_rank.py --kind KIND [--marker M]``.

Rank 1 is the odd one out. After a barrier (every rank is up), rank 1 fails (kinds
``raise``, ``exit3``, ``exit0``, ``sigkill``, ``sigstop``) or calls something different
from the others (``shape``, ``dtype``, ``op``, ``root``; ``send``: rank 1 sends to rank 0
where the others call all_sum, and ends); with ``threads`` two
threads of every rank call ``all_sum`` on the world at once; ``ok`` is the healthy job.

Printed lines (the test reads them): ``READY`` after the barrier; ``RESULT ok`` or
``RESULT WRONG got=... want=...`` whenever an operation returns; ``ERROR Class peer=P:
message`` for each meshcomm error caught (the error then propagates: exit status 1). ``--marker`` is only
there so the test can find every process of the job with ``pgrep -f``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import meshcomm as mc
import numpy as np


def report(got: np.ndarray, want: np.ndarray) -> None:
    ok = got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)
    print("RESULT ok" if ok else f"RESULT WRONG got={got!r} want={want!r}", flush=True)


def error(exc: mc.DistributedError) -> None:
    print(f"ERROR {type(exc).__name__} peer={getattr(exc, 'peer', None)}: {exc}".replace("\n", " | "), flush=True)


#: elements of every array (the failure matrix also runs 1 MiB arrays: the sockets backend's direct path)
E = int(os.environ.get("FAILURE_ELEMENTS", "4"))


def run(kind: str, r: int, n: int) -> None:
    ones = np.ones(E, np.float32)
    if kind in ("raise", "exit3", "exit0", "sigkill", "sigstop") and r == 1:
        time.sleep(0.3)  # let the others enter all_sum first
        if kind == "raise":
            raise KeyError("rank 1 fails on purpose")
        if kind in ("exit3", "exit0"):
            sys.exit(3 if kind == "exit3" else 0)
        os.kill(os.getpid(), signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
        print("rank 1 resumed after SIGSTOP", flush=True)
    if kind == "shape":
        x = np.ones(E + 1 if r == 1 else E, np.float32)
        report(mc.all_sum(x), x * n)
    elif kind == "dtype":
        x = np.ones(E, np.float64 if r == 1 else np.float32)
        report(mc.all_sum(x), x * n)
    elif kind == "op":
        x = ones * (r + 1)
        report((mc.all_max if r == 1 else mc.all_sum)(x), ones * (n if r == 1 else n * (n + 1) / 2))
    elif kind == "root":
        root = 1 if r == 1 else 0
        report(mc.broadcast(ones * (r + 1), root=root), ones * (root + 1))
    elif kind == "send" and r == 1:
        mc.send(ones, dst=0)  # may return at once (a buffered send); then this rank's program ends
        print("SENT", flush=True)
    elif kind == "threads":
        errors: list[mc.DistributedError] = []

        def call() -> None:
            try:
                report(mc.all_sum(ones * (r + 1)), ones * (n * (n + 1) / 2))
            except mc.DistributedError as exc:
                error(exc)
                errors.append(exc)

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    else:  # everyone else: an all_sum that needs rank 1
        report(mc.all_sum(ones), ones * n)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", required=True)
    p.add_argument("--marker", default="")
    kind = p.parse_args().kind
    g = mc.init(strict=True)
    g.barrier()
    print("READY", flush=True)
    try:
        run(kind, g.rank(), g.size())
    except mc.DistributedError as exc:
        error(exc)
        raise  # uncaught, as in a real program: the exit handling records it as a consequence


if __name__ == "__main__":
    main()
