"""Naming the rank behind a gloo failure, since gloo's own messages name only an address.

At start-up every rank publishes where it runs (host name, pid, host key) in the rendezvous
store and reads everyone else's (:func:`.admission.admit`; one small key per rank, read while
all ranks are certainly up, so no store access is needed later, when rank 0 and its store may
be gone). When an operation fails, ranks on this host (same host key: same boot and PID
namespace) are looked up in ``/proc``: gone, a zombie, or stopped. Ranks elsewhere cannot be
inspected there.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshcomm.plugin import crowded, host_key

__all__ = ["RankProcess", "member", "suspects", "endpoints", "owner", "process_state", "spin_for"]


@dataclass(frozen=True)
class RankProcess:
    """Where one world rank runs: its host's name (for messages), its pid, and its
    :func:`meshcomm.plugin.host_key` (its pid is looked up in ``/proc`` only where that key is
    this process's)."""

    host: str
    pid: int
    key: int

    @staticmethod
    def here() -> RankProcess:
        """This process."""
        return RankProcess(socket.gethostname(), os.getpid(), host_key())

    @property
    def local(self) -> bool:
        """Whether this process can see that one in ``/proc``."""
        return self.key == host_key()

    def encode(self) -> list[str | int]:
        """The JSON form (``[host, pid, key]``) of store records."""
        return [self.host, self.pid, self.key]

    @staticmethod
    def decode(item: list[Any]) -> RankProcess:
        host, pid, key = item
        return RankProcess(str(host), int(pid), int(key))


def process_state(pid: int) -> str | None:
    """'gone', 'exited (zombie)', 'stopped' or None (running / unknown) for a local pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    state = stat.rpartition(")")[2].split()[:1]
    code = state[0] if state else ""
    return {"Z": "exited (zombie)", "X": "gone", "T": "stopped", "t": "stopped"}.get(code)


def suspects(
    peers: list[RankProcess], members: list[int], me: int, *, dead_only: bool = False
) -> list[tuple[int, str]]:
    """(group rank, description) of the members on this host that are not running normally
    (with ``dead_only``, only those gone or a zombie: a stopped one may resume).

    ``members[i]`` is the world rank of group rank ``i``; ``me`` is this process's group rank.
    """
    if not peers or not Path("/proc").is_dir():
        return []
    out = []
    for i, world in enumerate(members):
        if i == me or world >= len(peers) or not peers[world].local:
            continue
        state = process_state(peers[world].pid)
        if state is not None and not (dead_only and state == "stopped"):
            out.append((i, f"rank {i} (world rank {world}, pid {peers[world].pid}) is {state}"))
    return out


def member(i: int, members: list[int], peers: list[RankProcess]) -> str:
    """``rank i (world rank w, pid P on H)``: group rank ``i`` where it runs, as far as known."""
    world = members[i] if i < len(members) else i
    where = f", pid {peers[world].pid} on {peers[world].host}" if world < len(peers) else ""
    return f"rank {i} (world rank {world}{where})"


# -- which rank owns the address in a gloo message ---------------------------------------
# gloo names a lost peer only by an address ("Connection closed by peer [10.0.0.5]:41234"),
# the remote end of one of its connections: the peer's listening port or the port it
# connected from. Each rank records the TCP endpoints its process group opened and
# publishes them; a failure's address is then looked up, which names ranks on other hosts.

_ADDR = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d+)")


def _ip(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    ip = socket.inet_ntop(socket.AF_INET6, words)
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def endpoints() -> set[str]:
    """``ip:port`` of every TCP socket this process holds (empty where /proc is unavailable)."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    out = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[9] in inodes:
                addr, _, port = f[1].rpartition(":")
                out.add(f"{_ip(addr)}:{int(port, 16)}")
    return out


def owner(message: str, ends: list[set[str]], me: int) -> int | None:
    """The group rank whose endpoints include the address in gloo's ``message``, if exactly one does."""
    m = _ADDR.search(message)
    if not m or not ends:
        return None
    ip, printed = m.group(1), int(m.group(2))
    # torch 2.13's gloo prints the port in network byte order: try both readings
    for port in dict.fromkeys((((printed & 0xFF) << 8) | (printed >> 8), printed)):
        exact = [q for q, e in enumerate(ends) if q != me and f"{ip}:{port}" in e]
        if len(exact) == 1:
            return exact[0]
        by_port = [q for q, e in enumerate(ends) if q != me and any(x.rpartition(":")[2] == str(port) for x in e)]
        if len(by_port) == 1:
            return by_port[0]
    return None


def spin_for(spin_us: float, peers: list[RankProcess], world_rank: int) -> float:
    """Seconds a rank's channel reads poll before they sleep: ``spin_us``, or none where this
    host runs more of the job's ranks than it has cores (a polling rank would take the core
    the rank it waits for needs)."""
    if not peers or world_rank >= len(peers):
        return 0.0
    here = peers[world_rank].key
    local = sum(1 for p in peers if p.key == here)
    return 0.0 if crowded(local) else spin_us * 1e-6
