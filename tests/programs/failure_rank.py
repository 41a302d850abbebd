"""One rank of a failure-matrix job: ``failure_rank.py --kind KIND [--marker M]``.

Rank 1 is the odd one out. After a barrier (every rank is up), rank 1 fails (kinds
``raise``, ``exit3``, ``exit0``, ``sigkill``, ``sigstop``) or calls something different
from the others (``shape``, ``dtype``, ``op``, ``root``; ``send``: rank 1 sends to rank 0
where the others call all_sum, and ends); with ``threads`` two
threads of every rank call ``all_sum`` on the world, the second while the first is in flight
(rank 1 starts 0.3 s late, so the others' first calls wait for it); ``ok`` is the healthy job.

The second-round operations: ``--op OP [--root R]`` makes the ranks that wait for a failing
rank 1 call OP (``all_to_all``, ``gather``, ``scatter``, ``reduce``, ``all_gather_object``;
``--root 1`` makes the failing rank the root) instead of ``all_sum``; mismatches between
them are the kinds ``gather_scatter`` (rank 1 calls gather, the others scatter),
``gather_root`` (rank 1 gathers to itself, the others to rank 0), ``a2a_shape`` (rank 1's
all_to_all has twice the rows) and ``reduce_op`` (rank 1 reduces with max, the others sum).

Printed lines (the test reads them): ``GUARD compiled`` or ``GUARD python`` (the world's
one-thread guard) and ``READY`` after the barrier; ``RESULT ok`` or
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


def report_any(got: object, want: object) -> None:
    """:func:`report` for results that may be None (a non-root) or a list (object collectives)."""
    if isinstance(want, np.ndarray) and isinstance(got, np.ndarray):
        report(got, want)
    else:
        print("RESULT ok" if got == want else f"RESULT WRONG got={got!r} want={want!r}", flush=True)


def error(exc: mc.DistributedError) -> None:
    print(f"ERROR {type(exc).__name__} peer={getattr(exc, 'peer', None)}: {exc}".replace("\n", " | "), flush=True)


#: elements of every array (the failure matrix also runs 4 MiB arrays: the sockets backend's direct path)
E = int(os.environ.get("FAILURE_ELEMENTS", "4"))


def blocks(r: int, n: int, rows: int = 1) -> np.ndarray:
    """Rank ``r``'s all_to_all/scatter input: block j (``rows`` x E) holds ``10 * r + j``."""
    return np.repeat(np.arange(n, dtype=np.float32) + 10 * r, rows * E).reshape(n * rows, E)


def second_round(op: str, root: int, r: int, n: int) -> None:
    """Call ``op`` as every rank would in a healthy job and report the result."""
    ones = np.ones(E, np.float32)
    me = r == root
    if op == "all_to_all":
        want = np.repeat(10 * np.arange(n, dtype=np.float32) + r, E).reshape(n, E)
        report(mc.all_to_all(blocks(r, n)), want)
    elif op == "gather":
        report_any(mc.gather(ones * (r + 1), root), np.repeat(np.arange(1, n + 1, dtype=np.float32), E) if me else None)
    elif op == "scatter":
        report(mc.scatter(blocks(r, n), root), blocks(root, n)[r : r + 1])
    elif op == "reduce":
        report_any(mc.reduce(ones * (r + 1), root), ones * (n * (n + 1) / 2) if me else None)
    elif op == "all_gather_object":
        report_any(mc.all_gather_object({"rank": r}), [{"rank": q} for q in range(n)])
    else:
        raise SystemExit(f"failure_rank.py: unknown --op {op!r}")


def mismatch(kind: str, r: int, n: int) -> None:
    """The second-round mismatches: rank 1 calls something else than ranks 0 and 2."""
    ones = np.ones(E, np.float32)
    if kind == "gather_scatter":
        if r == 1:
            report_any(mc.gather(ones, 0), None)
        else:
            report(mc.scatter(blocks(r, n), 0), blocks(0, n)[r : r + 1])
    elif kind == "gather_root":
        root = 1 if r == 1 else 0
        report_any(mc.gather(ones, root), np.ones(n * E, np.float32) if r == root else None)
    elif kind == "a2a_shape":
        x = blocks(r, n, rows=2 if r == 1 else 1)
        report(mc.all_to_all(x), x)  # any result is wrong here
    elif kind == "reduce_op":
        got = mc.reduce(ones * (r + 1), 0, op="max" if r == 1 else "sum")
        report_any(got, None if r else ones * (n * (n + 1) / 2))


MORE_MISMATCHES = ("gather_scatter", "gather_root", "a2a_shape", "reduce_op")


def run(kind: str, r: int, n: int, op: str = "all_sum", root: int = 0) -> None:
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
    elif kind in MORE_MISMATCHES:
        mismatch(kind, r, n)
    elif op != "all_sum":  # a second-round operation that needs rank 1
        second_round(op, root, r, n)
    elif kind == "threads":
        errors: list[mc.DistributedError] = []

        def call() -> None:
            try:
                report(mc.all_sum(ones * (r + 1)), ones * (n * (n + 1) / 2))
            except mc.DistributedError as exc:
                error(exc)
                errors.append(exc)

        threads = [threading.Thread(target=call) for _ in range(2)]
        # The first thread's all_sum cannot end before rank 1 joins it, 0.3 s later, so on the
        # other ranks the second thread surely calls while the first is in flight (started at
        # once, both threads could each finish before the other began: a true result, no error)
        if r == 1:
            time.sleep(0.3)
        threads[0].start()
        time.sleep(0.05)
        threads[1].start()
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
    p.add_argument("--op", default="all_sum")
    p.add_argument("--root", type=int, default=0)
    args = p.parse_args()
    kind = args.kind
    g = mc.init(strict=True)
    g.barrier()
    # which one-thread guard this rank's world runs (MESHCOMM_COMPILED picks it)
    print("GUARD", "compiled" if type(g._guard).__module__.endswith("._callpath") else "python", flush=True)
    print("READY", flush=True)
    try:
        run(kind, g.rank(), g.size(), args.op, args.root)
    except mc.DistributedError as exc:
        error(exc)
        raise  # uncaught, as in a real program: the exit handling records it as a consequence


if __name__ == "__main__":
    main()
