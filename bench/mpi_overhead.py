"""meshcomm-mpi ``all_sum`` against raw mpi4py ``Allreduce``: paired, interleaved jobs, any MPI flavour.

    python bench/mpi_overhead.py                          # .venv (Open MPI) and .venv-mpich, 2 and 4 ranks
    python bench/mpi_overhead.py --pythons .venv-mpich/bin/python --ranks 4 --rounds 3
    python bench/mpi_overhead.py --layers --pythons .venv-mpich/bin/python --ranks 4   # where the time goes

Each flavour lives in its own venv (the Open MPI and MPICH wheels cannot share one), so the
driver takes the venvs' interpreters. For every interpreter and rank count it runs
``--rounds`` rounds; a round is one raw-mpi4py job and one meshcomm job, started one right
after the other by ``meshcomm launch --backend mpi`` (the same launcher, mpiexec and
environment for both), the order alternating from round to round so that a drift in the
machine's load hits both sides alike. The ratio of a size is the median over rounds of
(meshcomm median / raw median) within the round: each ratio compares two jobs that ran
seconds apart. Times are the median over rounds of each job's median.

Both workers use the same timer (:func:`meshcomm.bench.measure.time_op`: warm-up, a barrier
before every iteration, the slowest rank's time per iteration, median) with the same
synchronisation (raw ``MPI.COMM_WORLD.Barrier`` and a MAX ``Allreduce``), float32 inputs
``i % 7 + rank`` and a checked result:

* ``raw``: ``comm.Allreduce(x, out, MPI.SUM)`` on ``MPI.COMM_WORLD`` into a preallocated
  ``out`` (what meshcomm/bench/peers.py times; meshcomm is not even imported beyond its timer);
* ``meshcomm``: ``mc.all_sum(x)`` after ``mc.init(backend="mpi")`` (a new result array
  per call, the core's call check, the backend's Allreduce on its duplicated communicator).

``--layers`` instead runs one job per interpreter and rank count in which every rank starts
meshcomm and then times, interleaved block by block, each layer of the call: raw Allreduce
on COMM_WORLD, raw Allreduce on the backend's communicator (a ``Dup`` with ERRORS_RETURN),
``backend.all_reduce`` into a preallocated buffer, ``all_sum`` through a Group without the
call check, and ``all_sum`` as users call it. ``--env K=V`` sets variables on every job (e.g.
``MPIR_CVAR_...`` of MPICH, ``MPI4PY_RC_THREAD_LEVEL``, ``MESHCOMM_CHECK_CALLS``).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
DEFAULT_SIZES = "8B,64KiB,1MiB,2MiB,16MiB"

# -- rank side ----------------------------------------------------------------------------------


class _WorldSync:
    """Barrier and max-over-ranks on raw ``MPI.COMM_WORLD``: the same for every side timed."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self._comm, self._max = MPI.COMM_WORLD, MPI.MAX

    def barrier(self) -> None:
        self._comm.Barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        self._comm.Allreduce(np.ascontiguousarray(values), out, self._max)
        return out


def _inputs(nbytes: int, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    from meshcomm.bench.collectives import rank_input

    count = max(1, nbytes // 4)
    x = rank_input(count, np.dtype(np.float32), rank)
    want = sum(rank_input(count, np.dtype(np.float32), k) for k in range(size))
    return x, np.asarray(want, dtype=np.float32)


def _sides(kind: str) -> tuple[int, int, dict[str, Callable[[np.ndarray], Callable[[], Any]]]]:
    """(rank, size, {side name: make(x) -> call}) for one worker kind."""
    if kind == "raw":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD

        def make_raw(x: np.ndarray) -> Callable[[], Any]:
            out = np.empty_like(x)
            return lambda: (comm.Allreduce(x, out, MPI.SUM), out)[1]

        return comm.Get_rank(), comm.Get_size(), {"raw": make_raw}
    import meshcomm as mc
    from mpi4py import MPI

    g = mc.init(strict=True, backend="mpi")
    if kind == "meshcomm":
        return g.rank(), g.size(), {"meshcomm": lambda x: lambda: mc.all_sum(x, group=g)}
    b: Any = g.transport
    try:
        plain = mc.Group(b, "mpi", check_calls=False)
    except TypeError:  # a core from before the call check (PYTHONPATH to an older checkout)
        plain = mc.Group(b, "mpi")

    ctl = getattr(b, "control", None)  # the non-blocking backend's wait loop (absent before it)

    def with_spin(call: Callable[[], Any]) -> Callable[[], Any]:
        """``call`` with the backend's wait loop spinning (never sleeping) for up to 1 s."""

        def run() -> Any:
            saved, ctl.spin = ctl.spin, 1.0
            try:
                return call()
            finally:
                ctl.spin = saved

        return run

    def world(x: np.ndarray) -> Callable[[], Any]:
        out = np.empty_like(x)
        return lambda: (MPI.COMM_WORLD.Allreduce(x, out, MPI.SUM), out)[1]

    def dup(x: np.ndarray) -> Callable[[], Any]:
        out = np.empty_like(x)
        return lambda: (b.comm.Allreduce(x, out, MPI.SUM), out)[1]

    def iwait(x: np.ndarray) -> Callable[[], Any]:
        out = np.empty_like(x)
        return lambda: (b.comm.Iallreduce(x, out, MPI.SUM).Wait(), out)[1]

    def backend(x: np.ndarray) -> Callable[[], Any]:
        out = np.empty_like(x)
        return lambda: (b.all_reduce(x, out, "sum"), out)[1]

    sides: dict[str, Callable[[np.ndarray], Callable[[], Any]]] = {
        "raw-world": world,
        "raw-dup": dup,
        "Iallreduce+Wait": iwait,
        "backend": backend,
        "all_sum-nocheck": lambda x: lambda: mc.all_sum(x, group=plain),
        "all_sum": lambda x: lambda: mc.all_sum(x, group=g),
    }
    if ctl is not None and hasattr(ctl, "spin"):
        sides["backend-spin"] = lambda x: with_spin(backend(x))
        sides["all_sum-spin"] = lambda x: with_spin(lambda: mc.all_sum(x, group=g))
    return g.rank(), g.size(), sides


def worker(kind: str, sizes: list[int], min_time: float, blocks: int, out_path: str) -> int:
    """One rank: for each size, ``blocks`` rounds of every side (rotating order); rank 0 writes JSON."""
    from meshcomm.bench.measure import time_op

    rank, size, sides = _sides(kind)
    sync = _WorldSync()
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    names = list(sides)
    for nbytes in sizes:
        x, want = _inputs(nbytes, rank, size)
        calls = {name: make(x) for name, make in sides.items()}
        for name, call in calls.items():
            got = np.asarray(call())
            if not np.array_equal(got, want):
                sys.stderr.write(f"rank {rank}: {name} all_sum of {nbytes} B is wrong\n")
                return 1
        for blk in range(blocks):
            k = blk % len(names)
            for name in names[k:] + names[:k]:
                t = time_op(calls[name], sync, warmup=3, min_time=min_time / blocks)
                rows[name].setdefault(str(x.nbytes), []).append(t.stats.median)
    if rank == 0:
        with open(out_path, "w") as f:
            import meshcomm

            json.dump(
                {
                    "kind": kind,
                    "ranks": size,
                    "library": _library(),
                    "rows": rows,
                    "meshcomm": os.path.dirname(meshcomm.__file__),
                    "env": {k: v for k, v in os.environ.items() if k.startswith(("MPIR_", "MPI4PY_", "MESHCOMM_"))},
                },
                f,
            )
    return 0


def _library() -> str:
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().split("\n")[0].split()).rstrip(",")


# -- driver ---------------------------------------------------------------------------------------


def _job(python: str, n: int, kind: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Run one worker job under ``meshcomm launch --backend mpi``; its JSON, or an ``error``."""
    with tempfile.TemporaryDirectory(prefix="meshcomm-mpi-overhead-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [
            python,
            "-m",
            "meshcomm",
            "launch",
            "-n",
            str(n),
            "--backend",
            "mpi",
            "--",
            str(HERE),
            "--worker",
            kind,
            "--sizes",
            args.sizes,
            "--min-time",
            str(args.min_time),
            "--blocks",
            str(args.blocks),
            "--json",
            str(out),
        ]
        clean = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MLX_", "MESHCOMM_", "OMPI_COMM", "PMI", "PMIX_", "HYDRA_"))
        }
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                cmd, env={**clean, **env}, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.timeout:.0f} s"}
        if p.returncode != 0 or not out.exists():
            tail = (p.stderr or p.stdout).strip().splitlines()[-4:]
            return {"error": f"exit {p.returncode}: {' | '.join(tail)}"}
        doc: dict[str, Any] = json.loads(out.read_text())
        doc["wall"] = time.monotonic() - t0
        doc["loadavg"] = os.getloadavg()[0]
        return doc


def _flavour(python: str) -> str:
    code = "from meshcomm_mpi.discover import find_library as f; l = f(); print(l.version)"
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return " ".join(p.stdout.split()) or f"unknown ({p.stderr.strip()[-200:]})"


def _fmt_size(nbytes: int) -> str:
    from meshcomm.bench.sizes import format_size

    return format_size(nbytes)


def paired(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Rounds of (raw, meshcomm) jobs per interpreter and rank count; per-round ratios."""
    runs: dict[str, Any] = {}
    for python in args.pythons:
        lib = _flavour(python)
        for n in args.ranks:
            key = f"{lib} | {n} ranks"
            jobs: dict[str, list[dict[str, Any]]] = {"raw": [], "meshcomm": []}
            for rnd in range(args.rounds):
                order = ["raw", "meshcomm"] if rnd % 2 == 0 else ["meshcomm", "raw"]
                for kind in order:
                    res = _job(python, n, kind, args, env)
                    jobs[kind].append(res)
                    what = res.get("error") or f"{res['wall']:.0f} s, load {res['loadavg']:.1f}, {res['meshcomm']}"
                    sys.stderr.write(f"{key}: round {rnd + 1} {kind}: {what}\n")
            runs[key] = _summarise(jobs)
    return runs


def _summarise(jobs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ok = [(r, m) for r, m in zip(jobs["raw"], jobs["meshcomm"], strict=True) if "rows" in r and "rows" in m]
    out: dict[str, Any] = {
        "rounds": len(ok),
        "errors": [j["error"] for js in jobs.values() for j in js if "error" in j],
        "sizes": {},
    }
    if not ok:
        return out
    for size in ok[0][0]["rows"]["raw"]:
        raw = [statistics.median(r["rows"]["raw"][size]) for r, _ in ok]
        ours = [statistics.median(m["rows"]["meshcomm"][size]) for _, m in ok]
        out["sizes"][size] = {
            "raw": statistics.median(raw),
            "meshcomm": statistics.median(ours),
            "ratio": statistics.median(o / r for o, r in zip(ours, raw, strict=True)),
            "raw_rounds": raw,
            "meshcomm_rounds": ours,
        }
    return out


def paired_table(runs: dict[str, Any]) -> str:
    lines = [
        "| MPI | ranks | size | raw mpi4py (µs) | meshcomm-mpi (µs) | ratio | rounds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, res in runs.items():
        lib, n = key.split(" | ")
        for size, cell in res["sizes"].items():
            lines.append(
                f"| {lib} | {n.split()[0]} | {_fmt_size(int(size))} | {cell['raw'] * 1e6:.1f} | "
                f"{cell['meshcomm'] * 1e6:.1f} | {cell['ratio']:.2f} | {res['rounds']} |"
            )
        lines += [f"| {lib} | {n.split()[0]} | error: {e} |" for e in res["errors"]]
    return "\n".join(lines)


def layers(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """One job per interpreter and rank count timing every layer of all_sum, interleaved."""
    runs: dict[str, Any] = {}
    for python in args.pythons:
        lib = _flavour(python)
        for n in args.ranks:
            res = _job(python, n, "layers", args, env)
            what = res.get("error") or f"{res['wall']:.0f} s"
            sys.stderr.write(f"{lib} | {n} ranks: layers: {what}\n")
            runs[f"{lib} | {n} ranks"] = res
    return runs


def layers_table(runs: dict[str, Any]) -> str:
    names = [
        "raw-world",
        "raw-dup",
        "Iallreduce+Wait",
        "backend",
        "backend-spin",
        "all_sum-nocheck",
        "all_sum",
        "all_sum-spin",
    ]
    lines = [
        "| MPI | ranks | size | " + " | ".join(f"{n} (µs)" for n in names) + " |",
        "|---|---:|---:|" + "---:|" * len(names),
    ]
    for key, res in runs.items():
        lib, n = key.split(" | ")
        if "rows" not in res:
            lines.append(f"| {lib} | {n.split()[0]} | error: {res.get('error')} |")
            continue
        for size in res["rows"]["raw-world"]:
            cells = [
                f"{statistics.median(res['rows'][name][size]) * 1e6:.1f}" if name in res["rows"] else "-"
                for name in names
            ]
            lines.append(f"| {lib} | {n.split()[0]} | {_fmt_size(int(size))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=["raw", "meshcomm", "layers"], help=argparse.SUPPRESS)
    p.add_argument("--json", help="worker: where rank 0 writes its rows; driver: where the summary goes")
    p.add_argument(
        "--pythons",
        nargs="+",
        default=[str(ROOT / ".venv/bin/python"), str(ROOT / ".venv-mpich/bin/python")],
        help="one interpreter per MPI flavour (default: .venv and .venv-mpich)",
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list (default {DEFAULT_SIZES})")
    p.add_argument("--rounds", type=int, default=4, help="paired rounds per flavour and rank count (default 4)")
    p.add_argument("--blocks", type=int, default=3, help="timed blocks per size within a job (default 3)")
    p.add_argument("--min-time", type=float, default=0.3, help="timed seconds per size and side in a job")
    p.add_argument("--layers", action="store_true", help="time each layer of all_sum instead (one job each)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="set on every job")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    from meshcomm.bench.sizes import parse_sizes

    sizes = list(parse_sizes(args.sizes))
    if args.worker:
        return worker(args.worker, sizes, args.min_time, args.blocks, args.json)
    env = dict(kv.split("=", 1) for kv in args.env)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if args.layers:
        runs = layers(args, env)
        text = layers_table(runs)
    else:
        runs = paired(args, env)
        text = paired_table(runs)
    head = (
        f"float32 all_sum, {os.cpu_count()} cores, started {started}, load {os.getloadavg()[0]:.1f} at the end, "
        f"env {env or '-'}"
    )
    sys.stdout.write(head + "\n\n" + text + "\n")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"started": started, "env": env, "argv": sys.argv[1:], "runs": runs}, indent=1) + "\n"
        )
    ok = all(not r.get("errors") and "error" not in r for r in runs.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
