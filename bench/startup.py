"""Start-up time against the number of ranks: from "launch" to "the first collective is done".

    python bench/startup.py --driver                      # sockets via meshcomm launch, mpi via mpiexec
    python bench/startup.py --driver --ranks 1 2 4 --reps 3 --backends sockets
    python bench/startup.py --driver --ranks 256 --reps 1 --backends sockets --netns 8   # 8 "hosts"

The driver takes ``t0 = time.time()`` just before it starts the job (``meshcomm launch -n N
--backend sockets bench/startup.py``, or the venv's ``mpiexec -n N --oversubscribe python
bench/startup.py`` with ``MLX_BACKEND=mpi``). Each rank records when its interpreter got
control (after ``import meshcomm, numpy``), then ``mc.init()``, a barrier and one
``all_sum`` (checked), and prints ``STARTUP {json}`` with those wall-clock times. The driver
reports, per N, the median over ``--reps`` runs of

* ``total``: the last rank's "first collective done" minus t0 (what a user waits for);
* ``python``: the last rank's "imports done" minus t0 (process start-up: launcher, interpreter,
  imports; the part meshcomm's connection set-up does not control);
* ``connect``: ``total - python``: init (rendezvous/handshakes), barrier and the first all_sum;

and, the slowest or largest rank of each run: one more barrier, a 1 MiB all_sum, the open
sockets and files, and the peak resident memory of a rank.

Ranks on one machine share its cores: with more ranks than cores the numbers are dominated by
interpreter start-up competing for CPU. Prints a Markdown table (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

T_START = time.time()

import meshcomm as mc  # noqa: E402
import numpy as np  # noqa: E402

_ = mc.init  # the API: `import meshcomm` imports it on first use, and it counts as imports here
T_IMPORTED = time.time()


def _open_files() -> tuple[int, int]:
    """(open file descriptors, of which sockets) of this process."""
    fds = sockets = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return fds, sockets


def rank_main() -> None:
    hosts = int(os.environ.get("STARTUP_HOSTS", "0"))
    if hosts:  # ranks r*hosts//n share memory only with those of the same "host" (sockets)
        rank, size = int(os.environ["MLX_RANK"]), int(os.environ["MLX_WORLD_SIZE"])
        os.environ["MESHCOMM_HOST_ID"] = f"startup-host-{rank * hosts // size}"
    g = mc.init(strict=True)
    t_init = time.time()
    g.barrier()
    x = mc.all_sum(np.ones(4, np.float32))
    assert np.array_equal(x, np.full(4, g.size(), np.float32)), x
    t_done = time.time()
    t0 = time.perf_counter()
    g.barrier()
    t_barrier = time.perf_counter() - t0
    big = np.ones(1 << 18, np.float32)  # 1 MiB
    t0 = time.perf_counter()
    y = mc.all_sum(big)
    t_mib = time.perf_counter() - t0
    assert y[0] == g.size(), y[0]
    fds, sockets = _open_files()
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        "STARTUP "
        + json.dumps(
            {
                "rank": g.rank(),
                "size": g.size(),
                "start": T_START,
                "imported": T_IMPORTED,
                "init": t_init,
                "done": t_done,
                "barrier": t_barrier,
                "mib": t_mib,
                "fds": fds,
                "sockets": sockets,
                "rss_mib": rss_mib,
            }
        ),
        flush=True,
    )


def run_once(backend: str, n: int, args: argparse.Namespace) -> dict[str, float]:
    here = os.path.abspath(__file__)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "OMPI_", "PMIX_", "SLURM_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", MLX_TIMEOUT="120")
    if args.connect:
        env["MESHCOMM_SOCKETS_CONNECT"] = args.connect
    if args.hosts:
        env["STARTUP_HOSTS"] = str(args.hosts)
    if backend == "mpi":
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        env["MLX_BACKEND"] = "mpi"
        cmd = [mpiexec, "-n", str(n), "--oversubscribe", sys.executable, here]
    else:
        cmd = [sys.executable, "-m", "meshcomm", "launch", "-n", str(n), "--backend", backend]
        if args.netns is not None:  # n/K ranks "on" each namespace, started through its "ssh"
            per = [n // len(args.netns.ips) + (i < n % len(args.netns.ips)) for i in range(len(args.netns.ips))]
            hosts = ",".join(f"{ip}:{k}" for ip, k in zip(args.netns.ips, per, strict=True))
            cmd += ["--hosts", hosts, "--ssh", args.netns.ssh_command, "--timeout", "120"]
            env.update(args.netns.env)
        cmd += ["--", here]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    t_end = time.time()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    recs = []
    for line in p.stdout.splitlines():
        i = line.find("STARTUP ")
        if i >= 0:
            recs.append(json.loads(line[i + 8 :]))
    if len(recs) != n:
        raise RuntimeError(f"{n} ranks but {len(recs)} STARTUP lines:\n{p.stdout[-3000:]}")
    total = max(r["done"] for r in recs) - t0
    python = max(r["imported"] for r in recs) - t0
    return {
        "total": total,
        "python": python,
        "connect": total - python,
        "exit": t_end - t0,
        "barrier": max(r["barrier"] for r in recs),
        "mib": max(r["mib"] for r in recs),
        "sockets": max(r["sockets"] for r in recs),
        "fds": max(r["fds"] for r in recs),
        "rss_mib": max(r["rss_mib"] for r in recs),
    }


def driver(args: argparse.Namespace) -> None:
    rows = []
    for backend in args.backends:
        for n in args.ranks:
            runs = [run_once(backend, n, args) for _ in range(args.reps)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append((backend, n, med, [r["total"] for r in runs]))
            print(
                f"{backend:8s} n={n:3d} total {med['total']:.2f} s (python {med['python']:.2f}, "
                f"connect {med['connect']:.2f}, job exit {med['exit']:.2f}) "
                f"runs {[round(r['total'], 2) for r in runs]}",
                file=sys.stderr,
                flush=True,
            )
    print(
        "| backend | ranks | launch -> first collective done (s) | of which process start + imports (s) | "
        "init + barrier + all_sum (s) | launch -> job exit (s) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for backend, n, med, _ in rows:
        starter = "meshcomm launch" if backend != "mpi" else "mpiexec"
        print(
            f"| {backend} ({starter}) | {n} | {med['total']:.2f} | {med['python']:.2f} | {med['connect']:.2f} | "
            f"{med['exit']:.2f} |"
        )
    print()
    print(
        "| backend | ranks | barrier (ms) | 1 MiB all_sum (ms) | open sockets per rank | open files per rank | "
        "peak RSS per rank (MiB) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for backend, n, med, _ in rows:  # the slowest / largest rank, median over the runs
        print(
            f"| {backend} | {n} | {med['barrier'] * 1e3:.2f} | {med['mib'] * 1e3:.1f} | {med['sockets']:.0f} | "
            f"{med['fds']:.0f} | {med['rss_mib']:.0f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--driver", action="store_true")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--backends", nargs="+", default=["sockets", "mpi"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--connect", choices=["auto", "all", "needed"], help="sockets: MESHCOMM_SOCKETS_CONNECT")
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="sockets: split the ranks into this many shared-memory groups (MESHCOMM_HOST_ID), as on that many hosts",
    )
    p.add_argument(
        "--netns",
        type=int,
        default=0,
        metavar="K",
        help="sockets: spread the ranks over K network namespaces standing for hosts (needs root and iproute2)",
    )
    args = p.parse_args()
    if args.driver and args.netns:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from netns import NetnsHosts

        hosts, args.netns = args.netns, NetnsHosts(args.netns)
        try:
            print(f"{hosts} network namespaces: {', '.join(args.netns.ips)}", file=sys.stderr, flush=True)
            driver(args)
        finally:
            args.netns.close()
    elif args.driver:
        args.netns = None
        driver(args)
    else:
        rank_main()


if __name__ == "__main__":
    main()
