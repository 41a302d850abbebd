"""A meshcomm group of Ray actors on a running Ray cluster: every collective, then a killed actor.

    python tests/programs/ray_group.py --address HOST:PORT --actors 4 --backend sockets

The driver starts ``--actors`` actors (actor i on the node whose address is entry
``i mod n`` of ``--nodes``, or wherever Ray puts them), makes them one meshcomm world with
``meshcomm.ray.create_group`` (``--how init``: each actor calls ``meshcomm.ray.init``
itself instead), and checks every collective of the contract on every rank against NumPy
(``meshcomm.testing.contract``'s checks). With ``--kill R`` the driver then kills actor R
(``ray.kill``) while the others wait in an all_sum, and each survivor reports the error it
raised. Prints one JSON line per actor (``RESULT {...}``) and ``NODES n`` (the nodes the
actors ran on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import meshcomm as mc
import meshcomm.ray as mcray
import numpy as np
import ray


@ray.remote(num_cpus=0)
class Worker:
    """A rank: its checks run in its own process, the world it was given by create_group."""

    def where(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def join(self, group: str, size: int, backend: str, timeout: float) -> int:
        return mcray.init(group, size=size, backend=backend, timeout=timeout).rank()

    def checks(self) -> dict[str, Any]:
        from meshcomm.testing.contract import CHECKS, run_checks

        world = mc.init()
        failed = [f"{name}: {error}" for name, error in run_checks(world)]
        return {"rank": world.rank(), "size": world.size(), "checks": len(CHECKS), "failed": failed}

    def sum_until_lost(self, victim: int) -> str:
        world = mc.init()
        x = np.ones(8, np.float32)
        world.all_sum(x)
        if world.rank() == victim:
            time.sleep(60)  # the driver kills this actor now
        t0 = time.monotonic()
        try:
            world.all_sum(x)
            return "RETURNED"
        except mc.DistributedError as exc:
            return f"{type(exc).__name__} peer={getattr(exc, 'peer', None)} after {time.monotonic() - t0:.2f}s: {exc}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--backend", default="sockets")
    p.add_argument("--how", choices=["create_group", "init"], default="create_group")
    p.add_argument("--nodes", default="", help="comma-separated node addresses the actors go to in turn")
    p.add_argument("--kill", type=int, default=None)
    p.add_argument("--timeout", type=float, default=20)
    args = p.parse_args()
    ray.init(address=args.address, logging_level="ERROR", log_to_driver=True)
    nodes = [n for n in args.nodes.split(",") if n]
    workers = [
        Worker.options(resources={f"node:{nodes[i % len(nodes)]}": 0.001} if nodes else {}).remote()  # type: ignore[attr-defined]
        for i in range(args.actors)
    ]
    print(f"NODES {len({n for n, _ in ray.get([w.where.remote() for w in workers])})}", flush=True)
    if args.how == "create_group":
        mcray.create_group(workers, backend=args.backend, timeout=args.timeout)
    else:
        group = f"init-{os.getpid()}"
        ray.get([w.join.remote(group, args.actors, args.backend, args.timeout) for w in workers])
    for res in ray.get([w.checks.remote() for w in workers]):
        print("RESULT", json.dumps(res), flush=True)
    if args.kill is not None:
        refs = [w.sum_until_lost.remote(args.kill) for w in workers]
        time.sleep(1.0)
        ray.kill(workers[args.kill])
        for r, ref in enumerate(refs):
            if r == args.kill:
                continue
            print("SURVIVOR", r, ray.get(ref, timeout=args.timeout + 30), flush=True)
    for w in workers:
        ray.kill(w)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
