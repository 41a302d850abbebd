"""What tracing costs: median time of a small ``all_sum`` with tracing off and on (issue 19).

    meshcomm launch -n 2 --backend sockets -- bench/trace_cost.py --bytes 8 --iters 20000
    MESHCOMM_TRACE=/tmp/t meshcomm launch -n 2 -- bench/trace_cost.py
    python bench/trace_cost.py --driver     # off, stall inspector only, tracing on; repeated

Each rank runs ``--iters`` blocking ``all_sum`` of ``--bytes`` bytes of uint8 in
``--rounds`` rounds (a barrier before each) and keeps the median per-operation time of
each round; rank 0 prints one JSON line prefixed ``TRACECOST`` with the median over
rounds. ``--driver`` runs the three configurations interleaved ``--repeats`` times (the
machine's load drifts) and prints the median of each.
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

import numpy as np

__all__ = ["main", "driver"]


def main(argv: list[str] | None = None) -> None:
    """One rank: time ``all_sum`` of ``--bytes`` bytes and print rank 0's median."""
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
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
        print("TRACECOST " + json.dumps({"us": statistics.median(per_op) * 1e6, "bytes": args.bytes,
                                         "trace": bool(os.environ.get("MESHCOMM_TRACE")),
                                         "stall_after": os.environ.get("MESHCOMM_STALL_AFTER", "")}))


def _run(env: dict[str, str], extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "meshcomm", "launch", "-n", "2", "--backend", "sockets", "--", __file__, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, check=True).stdout
    line = next(ln for ln in out.splitlines() if "TRACECOST " in ln)
    return float(json.loads(line.split("TRACECOST ", 1)[1])["us"])


def driver(argv: list[str] | None = None) -> None:
    """Off (inspector off too), inspector only (the default under meshcomm launch), tracing on."""
    p = argparse.ArgumentParser()
    p.add_argument("--driver", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--iters", type=int, default=20000)
    args = p.parse_args(argv)
    extra = ["--bytes", str(args.bytes), "--iters", str(args.iters)]
    results: dict[str, list[float]] = {"off": [], "stall only": [], "trace on": []}
    with tempfile.TemporaryDirectory() as tmp:
        configs = {"off": {"MESHCOMM_STALL_AFTER": "0", "MESHCOMM_TRACE": ""},
                   "stall only": {"MESHCOMM_TRACE": ""},
                   "trace on": {"MESHCOMM_TRACE": tmp}}
        for _ in range(args.repeats):
            for name, env in configs.items():
                results[name].append(_run(env, extra))
    for name, vals in results.items():
        print(f"{name:<11} median {statistics.median(vals):7.2f} us  runs {' '.join(f'{v:.2f}' for v in vals)}")


if __name__ == "__main__":
    if "--driver" in sys.argv:
        driver(sys.argv[1:])
    else:
        main()
