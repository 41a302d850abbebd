"""Naming the rank behind a gloo failure, since gloo's own messages name only an address.

At start-up every rank publishes ``host pid`` in the rendezvous store and reads
everyone else's (one small key per rank, read while all ranks are certainly up, so
no store access is needed later, when rank 0 and its store may be gone). When an
operation fails, ranks on this host are looked up in ``/proc``: gone, a zombie, or
stopped. Ranks on other hosts cannot be inspected and are not named.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Peer", "exchange", "suspects"]

_KEY = "meshcomm/proc/"


@dataclass(frozen=True)
class Peer:
    """Where one world rank runs."""

    host: str
    pid: int


def exchange(store: Any, rank: int, size: int) -> list[Peer]:
    """Publish this rank's host and pid, and return every world rank's (index = rank)."""
    store.set(f"{_KEY}{rank}", f"{socket.gethostname()} {os.getpid()}")
    out = []
    for q in range(size):
        host, _, pid = store.get(f"{_KEY}{q}").decode().rpartition(" ")
        out.append(Peer(host, int(pid)))
    return out


def _state(pid: int) -> str | None:
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


def suspects(peers: list[Peer], members: list[int], me: int) -> list[tuple[int, str]]:
    """(group rank, description) of the members on this host that are not running normally.

    ``members[i]`` is the world rank of group rank ``i``; ``me`` is this process's group rank.
    """
    if not peers or not Path("/proc").is_dir():
        return []
    here = socket.gethostname()
    out = []
    for i, world in enumerate(members):
        if i == me or world >= len(peers) or peers[world].host != here:
            continue
        state = _state(peers[world].pid)
        if state is not None:
            out.append((i, f"rank {i} (world rank {world}, pid {peers[world].pid}) is {state}"))
    return out
