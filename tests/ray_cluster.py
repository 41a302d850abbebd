"""A real Ray cluster on network-namespace hosts (tests/netns.py): ``ray start --head`` on the
first, ``ray start --address`` on the others, each node with 2 CPUs and its own short temp
directory; ``close()`` stops every node and removes the directories. Used by tests/test_ray.py
and bench/ray_collective.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from netns import NetnsHosts

__all__ = ["RayCluster", "PORT"]

ROOT = Path(__file__).resolve().parent.parent
RAY = Path(sys.executable).parent / "ray"
PORT = 6390


class RayCluster:
    """``ray start --head`` in namespace 0, ``ray start --address`` in namespace 1."""

    def __init__(self, hosts: NetnsHosts) -> None:
        self.hosts = hosts
        self.temp = Path(f"/tmp/mcray-{hosts.id}")  # short: Ray's socket paths must fit 107 bytes
        self.head = f"{hosts.ips[0]}:{PORT}"
        # HOME inside the temp directory: Ray keeps state there (~/.ray/auth_token), which must
        # neither come from the user's home nor stay behind
        self.env = {
            **os.environ,
            "HOME": str(self.temp / "home"),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
        }
        (self.temp / "home").mkdir(parents=True, exist_ok=True)
        try:
            for i, ip in enumerate(hosts.ips):
                args = ["start", "--node-ip-address", ip, "--num-cpus", "2", "--temp-dir", str(self.temp / str(i))]
                if i == 0:
                    args += ["--head", "--port", str(PORT), "--include-dashboard=false"]
                else:
                    args += ["--address", self.head]
                p = self.run(i, [str(RAY), *args], timeout=120)
                if p.returncode != 0:
                    raise RuntimeError(f"ray start on node {i} failed:\n{p.stdout}\n{p.stderr}")
            self._wait_nodes(len(hosts.ips))
        except BaseException:
            self.close()
            raise

    def run(self, i: int, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        cmd = ["ip", "netns", "exec", self.hosts.names[i], *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=ROOT)

    def _wait_nodes(self, n: int) -> None:
        code = (
            f"import ray; ray.init(address='{self.head}', logging_level='ERROR'); "
            "print(len([x for x in ray.nodes() if x['Alive']]))"
        )
        deadline = time.monotonic() + 60
        while True:
            p = self.run(0, [sys.executable, "-c", code], timeout=60)
            if p.returncode == 0 and p.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not reach {n} nodes: {p.stdout}{p.stderr}")
            time.sleep(1)

    def python(self, i: int, argv: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
        """This interpreter running ``argv`` on node ``i`` (a driver: ``ray.init(address=self.head)``)."""
        return self.run(i, [sys.executable, *argv], timeout=timeout)

    def close(self) -> None:
        for i in reversed(range(len(self.hosts.ips))):
            try:
                self.run(i, [str(RAY), "stop", "--force"], timeout=60)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)
