"""Network namespaces that stand in for hosts in the launcher tests.

``NetnsHosts(k)`` creates ``k`` namespaces ``mc-<id>-<i>``, each with loopback up and one
veth interface ``eth0`` with the address ``10.213.<x>.<i+1>/24``, all plugged into a bridge
that lives in one more namespace ``mc-<id>-br``. Nothing is added to the namespace the tests
run in, and traffic only flows between the namespaces made here. ``close()`` kills what is
still running inside them and deletes them all (the veths and the bridge go with them).

``tests/programs/netns_exec.sh`` is the ``--ssh`` command that starts a rank "on" one of
these hosts; ``env`` is the environment it needs.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["NetnsHosts", "NetnsUnavailable"]

WRAPPER = Path(__file__).resolve().parent / "programs" / "netns_exec.sh"


class NetnsUnavailable(RuntimeError):
    """``ip netns add`` is not permitted here (message: the exact reason)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


class NetnsHosts:
    def __init__(self, k: int) -> None:
        self.id = secrets.token_hex(3)
        self.bridge_ns = f"mc-{self.id}-br"
        self.names = [f"mc-{self.id}-{i}" for i in range(k)]
        subnet = random.randrange(1, 255)
        self.ips = [f"10.213.{subnet}.{i + 1}" for i in range(k)]
        self.created: list[str] = []
        try:
            self._add(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, (ns, ip) in enumerate(zip(self.names, self.ips, strict=True)):
                self._add(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.bridge_ns, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
            self._wait_reachable()
        except BaseException:
            self.close()
            raise

    def _add(self, name: str) -> None:
        p = _ip("netns", "add", name, check=False)
        if p.returncode != 0:
            err = p.stderr.strip()
            if "permission" in err.lower() or "not permitted" in err.lower():
                raise NetnsUnavailable(f"ip netns add {name}: {err}")
            raise RuntimeError(f"ip netns add {name} failed: {err}")
        self.created.append(name)

    def _wait_reachable(self) -> None:
        """Every namespace reaches the first one (a bridge port needs a moment to forward)."""
        deadline = time.monotonic() + 20
        for ns in self.names[1:]:
            while True:
                p = subprocess.run(
                    ["ip", "netns", "exec", ns, "ping", "-c", "1", "-W", "1", self.ips[0]],
                    capture_output=True,
                    text=True,
                    stdin=subprocess.DEVNULL,
                )
                if p.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{ns} cannot reach {self.ips[0]}: {p.stdout}{p.stderr}")
                time.sleep(0.2)

    @property
    def env(self) -> dict[str, str]:
        """What ``netns_exec.sh`` needs to map a host address to its namespace."""
        return {"MC_TEST_NETNS_MAP": " ".join(f"{ip}={ns}" for ip, ns in zip(self.ips, self.names, strict=True))}

    @property
    def ssh_command(self) -> str:
        return str(WRAPPER)

    def ns_inode(self, i: int) -> int:
        """The inode of namespace ``i`` (what /proc/PID/ns/net shows as net:[INODE])."""
        return os.stat(f"/run/netns/{self.names[i]}").st_ino

    def pids(self, name: str) -> list[int]:
        p = _ip("netns", "pids", name, check=False)
        return [int(x) for x in p.stdout.split()]

    def running(self) -> dict[str, list[int]]:
        """Processes still running in our namespaces."""
        return {ns: pids for ns in self.created if (pids := self.pids(ns))}

    def close(self) -> None:
        for ns in self.created:
            for pid in self.pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in reversed(self.created):
            _ip("netns", "del", ns, check=False)
        self.created.clear()
