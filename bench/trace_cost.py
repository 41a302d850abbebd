"""What tracing costs: median time of a small ``all_sum`` with tracing off and on (issue 19).

    meshcomm launch -n 2 --backend sockets -- bench/trace_cost.py --bytes 8 --iters 20000
    MESHCOMM_TRACE=/tmp/t meshcomm launch -n 2 -- bench/trace_cost.py
    python bench/trace_cost.py --driver     # off, stall inspector only, tracing on; repeated
    python bench/trace_cost.py --driver --before /tmp/old/core   # and the core without the hook
    python bench/trace_cost.py --inprocess  # the recorder's own cost per call, on a size-1 world

Each rank runs ``--iters`` blocking ``all_sum`` of ``--bytes`` bytes of uint8 in
``--rounds`` rounds (a barrier before each) and keeps the mean per-operation time of
each round; rank 0 prints one JSON line prefixed ``TRACECOST`` with the median and the
fastest of the rounds (on a shared machine the fastest round is the one least disturbed
by other processes). ``--driver`` runs the configurations interleaved ``--repeats`` times
(the machine's load drifts) and prints the median of each run's fastest round; ``--before DIR`` adds a
configuration that imports meshcomm from ``DIR`` with tracing and the inspector off (a
copy of ``core/`` without the recorder's hook, or of an earlier commit's, for the "free
when off" comparison). ``--inprocess`` times the
recorder's own work per operation without any transport or second process: the same
call on a size-1 world with the hook unset, with the stall inspector's bookkeeping
(progress record included), and with tracing on (best of 7 repeats of 100000 calls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["main", "driver"]


def main(argv: list[str] | None = None) -> None:
    """One rank: time ``all_sum`` of ``--bytes`` bytes and print rank 0's median."""
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    import meshcomm as mc

    world = mc.init(strict=True)
    x = np.ones(args.bytes, np.uint8)
    for _ in range(200):
        world.all_sum(x)
    per_op = []
    for _ in range(args.rounds):
        world.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters // args.rounds):
            world.all_sum(x)
        per_op.append((time.perf_counter() - t0) / (args.iters // args.rounds))
    if world.rank() == 0:
        print(
            "TRACECOST "
            + json.dumps(
                {
                    "us": statistics.median(per_op) * 1e6,
                    "min_us": min(per_op) * 1e6,
                    "bytes": args.bytes,
                    "trace": bool(os.environ.get("MESHCOMM_TRACE")),
                    "stall_after": os.environ.get("MESHCOMM_STALL_AFTER", ""),
                }
            )
        )


def _run(env: dict[str, str], extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "meshcomm", "launch", "-n", "2", "--backend", "sockets", "--", __file__, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, check=True).stdout
    line = next(ln for ln in out.splitlines() if "TRACECOST " in ln)
    return float(json.loads(line.split("TRACECOST ", 1)[1])["min_us"])


def driver(argv: list[str] | None = None) -> None:
    """Off (inspector off too), inspector only (the default under meshcomm launch), tracing on."""
    p = argparse.ArgumentParser()
    p.add_argument("--driver", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--before", default=None, metavar="DIR", help="a core/ directory without the hook")
    args = p.parse_args(argv)
    extra = ["--bytes", str(args.bytes), "--iters", str(args.iters)]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        configs = (
            {}
            if args.before is None
            else {"before": {"PYTHONPATH": args.before, "MESHCOMM_TRACE": "", "MESHCOMM_STALL_AFTER": "0"}}
        )
        configs |= {
            "off": {"MESHCOMM_STALL_AFTER": "0", "MESHCOMM_TRACE": ""},
            "stall only": {"MESHCOMM_TRACE": ""},
            "trace on": {"MESHCOMM_TRACE": tmp},
        }
        for _ in range(args.repeats):
            for name, env in configs.items():
                results.setdefault(name, []).append(_run(env, extra))
    for name, vals in results.items():
        print(f"{name:<11} median {statistics.median(vals):7.2f} us  runs {' '.join(f'{v:.2f}' for v in vals)}")


def inprocess() -> None:
    """The per-call cost of the hook itself, on a size-1 world (no transport, no peer)."""
    import timeit

    import meshcomm as mc
    from meshcomm.trace import recorder
    from meshcomm.trace.progress import ProgressWriter

    world = mc.init(backend="any")
    x = np.ones(8, np.uint8)
    n = 100_000

    def best() -> float:
        return min(timeit.repeat(lambda: world.all_sum(x), number=n, repeat=7)) / n * 1e6

    with tempfile.TemporaryDirectory() as tmp:
        rows = {"off": best()}
        rec = recorder.Recorder(
            world, folder=None, capacity=100_000, progress=ProgressWriter(Path(tmp) / "progress", 0)
        )
        recorder.active = rec
        rows["stall only"] = best()
        recorder.stop()
        recorder.active = recorder.Recorder(world, folder=Path(tmp), capacity=100_000, progress=None)
        rows["trace on"] = best()
        recorder.stop()
    for name, us in rows.items():
        print(f"{name:<11} {us:6.2f} us per all_sum on a size-1 world (+{us - rows['off']:.2f})")


if __name__ == "__main__":
    if "--inprocess" in sys.argv:
        inprocess()
    elif "--driver" in sys.argv:
        driver(sys.argv[1:])
    else:
        main()
