"""Cost of frame authentication: all_sum over TCP on 2 ranks at 64 KiB, 1 MiB and 64 MiB.

usage: python plugins/sockets/scripts/bench_integrity.py [--rounds R] [--code DIR=LABEL ...] [--mode M ...]

Runs one ``meshcomm launch -n 2`` job per (code, mode) and round, alternating them so the
machine's load hits every variant alike; each job times every size (the minimum and median
of its repetitions); prints a table of the medians over rounds of each job's median.
``--code DIR=LABEL``: a directory holding another copy of ``meshcomm_sockets`` (put first on
PYTHONPATH), e.g. an export of the previous commit; ``--mode``: values of
MESHCOMM_SOCKETS_INTEGRITY to try with the current code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SIZES = {"64 KiB": 64 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
RANK = """
import json, os, time
import numpy as np
import meshcomm as mc
import meshcomm_sockets
g = mc.init(strict=True)
out = {}
for label, nbytes in json.loads(os.environ["BENCH_SIZES"]).items():
    x = np.ones(nbytes // 4, np.float32)
    reps = max(5, min(200, (256 << 20) // nbytes))
    for _ in range(2):
        mc.all_sum(x)
    times = []
    for _ in range(reps):
        g.barrier()
        t = time.perf_counter()
        mc.all_sum(x)
        times.append(time.perf_counter() - t)
    times.sort()
    out[label] = times[len(times) // 2]
if g.rank() == 0:
    print("BENCH " + json.dumps({"file": meshcomm_sockets.__file__, "t": out}), flush=True)
"""


def run(code: str | None, mode: str | None) -> dict[str, float]:
    env = {**os.environ, "MESHCOMM_SOCKETS_SHM": "0", "BENCH_SIZES": json.dumps(SIZES), "MLX_TIMEOUT": "120"}
    if code:
        env["PYTHONPATH"] = code + os.pathsep + env.get("PYTHONPATH", "")
    if mode:
        env["MESHCOMM_SOCKETS_INTEGRITY"] = mode
    res = subprocess.run(
        [sys.executable, "-m", "meshcomm", "launch", "-n", "2", "--backend", "sockets", "--", "-c", RANK],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    line = next((ln for ln in res.stdout.splitlines() if "BENCH " in ln), None)
    if line is None:
        raise SystemExit(f"job failed: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    data = json.loads(line.split("BENCH ", 1)[1])
    if code:
        assert data["file"].startswith(code), data["file"]
    return data["t"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--code", action="append", default=[], help="DIR=LABEL")
    ap.add_argument("--mode", action="append", default=[])
    args = ap.parse_args()
    variants = [(c.split("=", 1)[0], None, c.split("=", 1)[1]) for c in args.code]
    variants += [(None, m, f"integrity={m}") for m in args.mode]
    got: dict[str, list[dict[str, float]]] = {v[2]: [] for v in variants}
    for i in range(args.rounds):
        for code, mode, label in variants if i % 2 == 0 else variants[::-1]:
            got[label].append(run(code, mode))
    print("| variant | " + " | ".join(SIZES) + " |")
    print("|---|" + "---|" * len(SIZES))
    for label, rounds in got.items():
        cells = [f"{statistics.median(r[s] for r in rounds) * 1e3:.3f} ms" for s in SIZES]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(json.dumps(got))


if __name__ == "__main__":
    main()
