"""meshcomm in Ray actors against Ray's own collectives (``ray.util.collective``, gloo), side by side.

    python bench/ray_collective.py [--sizes 8,1024,...] [--reps 50]

Needs root (network namespaces): starts a Ray cluster of two nodes, each in its own
network namespace with 2 CPUs (tests/ray_cluster.py), and runs this script again inside the
head's namespace as the driver. There, 4 actors, placed 2 + 2 on the two nodes and then
all 4 on one node, each join a meshcomm world (``meshcomm.ray.create_group``, sockets; and
gloo) and a ``ray.util.collective`` group (backend gloo: torch.distributed's
ProcessGroupGloo); every size is all-reduced (sum, float32) by each in turn: two warm-up
calls, a barrier, then ``--reps`` calls timed on every rank; the slowest rank's mean per
call counts. Prints one table per placement: microseconds per all_sum and the ratios
(below 1: meshcomm is faster). On the two-node placement meshcomm's sockets ranks spin 50 us
before sleeping (``MESHCOMM_SOCKETS_SPIN_US``): both "nodes" share this machine's 2 cores,
which a rank cannot tell, and its default spin would take its peer's core. Ray's group is told the interface to use
(``GLOO_SOCKET_IFNAME=eth0``): on these hosts the host name resolves to a loopback address.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = "8,1024,65536,1048576,16777216,67108864"


def driver(args: argparse.Namespace) -> int:
    import meshcomm as mc
    import meshcomm.ray as mcray
    import numpy as np
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        def ray_group(self, size: int, rank: int, name: str) -> None:
            import ray.util.collective as col

            col.init_collective_group(size, rank, backend="gloo", group_name=name)

        def time(self, who: str, nbytes: int, reps: int, name: str) -> float:
            import ray.util.collective as col

            x = np.ones(max(1, nbytes // 4), np.float32)
            if who == "ray":
                call = lambda: col.allreduce(x, group_name=name)  # noqa: E731
                barrier = lambda: col.barrier(group_name=name)  # noqa: E731
            else:
                world = mc.init()
                out = np.empty_like(x)
                call = lambda: world.all_sum(x, out=out)  # noqa: E731
                barrier = world.barrier
            call()
            call()
            barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            return (time.perf_counter() - t0) / reps

    ray.init(address=args.address, logging_level="ERROR")
    sizes = [int(s) for s in args.sizes.split(",")]
    report: dict[str, Any] = {}
    both = args.nodes.split(",")
    # the two "nodes" share this machine's 2 cores, which a rank cannot see: its default spin
    # (waiting without sleeping, right for a node of its own) would take the core of the peer it
    # waits for, so there it spins 50 us (on one node it sees 4 ranks on 2 cores and yields itself)
    for placement, nodes, spin in (
        ("2 nodes x 2 actors", both, {"MESHCOMM_SOCKETS_SPIN_US": "50"}),
        ("1 node x 4 actors", both[1:], {}),
    ):
        rows: dict[str, list[float]] = {}
        for who in ("meshcomm sockets", "meshcomm gloo", "ray.util.collective gloo"):
            env = {"env_vars": {"GLOO_SOCKET_IFNAME": "eth0", **spin}}
            ranks = [
                Rank.options(resources={f"node:{nodes[i % len(nodes)]}": 0.001}, runtime_env=env).remote()  # type: ignore[attr-defined]
                for i in range(4)
            ]
            name = f"bench-{os.getpid()}-{len(report)}-{len(rows)}"
            if who.startswith("meshcomm"):
                mcray.create_group(ranks, backend=who.split()[1], name=name, timeout=60)
                tag = "meshcomm"
            else:
                ray.get([r.ray_group.remote(4, i, name) for i, r in enumerate(ranks)])
                tag = "ray"
            times = []
            for n in sizes:
                reps = max(3, min(args.reps, int(args.reps * 65536 / max(n, 65536))))
                times.append(max(ray.get([r.time.remote(tag, n, reps, name) for r in ranks])))
            rows[who] = times
            for r in ranks:
                ray.kill(r)
        report[placement] = rows
    print("RAY-BENCH " + json.dumps({"sizes": sizes, "report": report}), flush=True)
    ray.shutdown()
    return 0


def _size(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n // k} {unit}"
    return f"{n} B"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="bytes per all_sum, comma-separated")
    p.add_argument("--reps", type=int, default=50, help="timed calls per size (fewer above 64 KiB)")
    p.add_argument("--address", help=argparse.SUPPRESS)  # set when run as the driver
    p.add_argument("--nodes", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.address:
        return driver(args)
    sys.path.insert(0, str(ROOT / "tests"))
    from netns import NetnsHosts
    from ray_cluster import RayCluster

    hosts = NetnsHosts(2)
    try:
        cluster = RayCluster(hosts)
        try:
            argv = [__file__, "--address", cluster.head, "--nodes", ",".join(hosts.ips)]
            argv += ["--sizes", args.sizes, "--reps", str(args.reps)]
            got = cluster.python(0, argv, timeout=3600)
        finally:
            cluster.close()
    finally:
        hosts.close()
    line = next((ln for ln in got.stdout.splitlines() if ln.startswith("RAY-BENCH ")), None)
    if got.returncode != 0 or line is None:
        print(got.stdout[-4000:], got.stderr[-4000:], file=sys.stderr)
        return 1
    data = json.loads(line.split(" ", 1)[1])
    for placement, rows in data["report"].items():
        ray_t = rows["ray.util.collective gloo"]
        print(f"\n{placement}: all_sum of float32, microseconds per call (slowest of 4 ranks)")
        print("| size | meshcomm sockets | meshcomm gloo | ray.util.collective gloo | sockets / ray | gloo / ray |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for i, n in enumerate(data["sizes"]):
            s, g, r = rows["meshcomm sockets"][i], rows["meshcomm gloo"][i], ray_t[i]
            print(f"| {_size(n)} | {s * 1e6:.1f} | {g * 1e6:.1f} | {r * 1e6:.1f} | {s / r:.2f} | {g / r:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
