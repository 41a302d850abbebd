"""How long survivors take to go on: from a rank's loss to the first collective of the
shrunk world, for each way of losing it.

    python bench/survivors.py [--backend sockets|gloo|mpi] [--ranks 4] [--runs 5] [--timeout 3]

Each run is a real job (``meshcomm launch --keep-going -n R --timeout T --
tests/programs/survivors.py --kind K``): rank 1 prints the wall-clock time just before it
dies (SIGKILL, an exception, or SIGSTOP: then it never runs again until the end); every
survivor prints the time its first all_sum on the shrunk world returned, and how long
``shrink()`` itself took. One host, so the clocks are one clock. Prints per kind the median
and the worst of the survivors' (first collective - loss) and of shrink(), in seconds.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "programs" / "survivors.py"


def one_run(ranks: int, kind: str, timeout: float, backend: str) -> tuple[list[float], list[float]]:
    """(first collective - loss, shrink time) of every survivor of one job."""
    cmd = [sys.executable, "-m", "meshcomm", "launch", "-n", str(ranks), "--backend", backend, "--keep-going"]
    cmd += ["--timeout", f"{timeout:g}"]
    cmd += ["--", str(PROGRAM), "--kind", kind]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
    died = [float(m) for m in re.findall(r"DYING at ([\d.]+)", out)]
    firsts = [float(m) for m in re.findall(r"FIRST-COLLECTIVE [\d.]+ s, at ([\d.]+)", out)]
    shrinks = [float(m) for m in re.findall(r"SHRUNK in ([\d.]+) s", out)]
    if len(died) != 1 or len(firsts) != ranks - 1:
        raise SystemExit(f"unexpected output of {' '.join(cmd)}:\n{out}")
    return [t - died[0] for t in firsts], shrinks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--timeout", type=float, default=3.0, help="MLX_TIMEOUT: how long a stopped rank takes to notice")
    p.add_argument("--kinds", default="sigkill,raise,sigstop")
    p.add_argument("--backend", default="sockets", help="sockets, gloo or mpi")
    args = p.parse_args()
    print(
        f"{args.backend}, {args.ranks} ranks, rank 1 lost, MLX_TIMEOUT={args.timeout:g}, "
        f"{args.runs} jobs per row; seconds"
    )
    print("| rank 1 … | loss → first collective, median | worst | shrink(), median | worst |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind in args.kinds.split(","):
        gaps: list[float] = []
        shrinks: list[float] = []
        for _ in range(args.runs):
            g, s = one_run(args.ranks, kind, args.timeout, args.backend)
            gaps += g
            shrinks += s
        print(
            f"| {kind} | {statistics.median(gaps):.3f} | {max(gaps):.3f} | "
            f"{statistics.median(shrinks):.3f} | {max(shrinks):.3f} |"
        )


if __name__ == "__main__":
    main()
