"""Who the other ranks are as processes: pid and host identity, and whether one is alive.

At start-up the ranks exchange (pid, :func:`meshcomm.plugin.host_key`). When a peer does not
answer, a peer on the same host (same boot, same PID namespace) can be looked at in ``/proc``:
gone or a zombie means it died, state ``T`` means it is stopped (SIGSTOP, a debugger).
Peers on other hosts cannot be looked at; they are reported as not answering.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["PeerTable"]


class PeerTable:
    """Every world rank's pid and host key (from one all-gather at start-up).

    Args:
        table: int64 array of shape (size, 2): pid, host key per world rank.
        rank: this process's world rank.
    """

    def __init__(self, table: np.ndarray, rank: int) -> None:
        self.table = table
        self.pids = [int(p) for p in table[:, 0]]
        keys = [int(k) for k in table[:, 1]]
        self.local = [keys[q] == keys[rank] for q in range(len(keys))]
        self.local_count = sum(self.local)

    def keep(self, ranks: list[int], rank: int) -> PeerTable:
        """The table of a smaller world: these world ``ranks`` in order, this process its ``rank``."""
        return PeerTable(self.table[ranks], rank)

    def state(self, peer: int) -> str | None:
        """ "dead", "stopped", "running" for a peer on this host; None when it cannot be seen."""
        if not self.local[peer]:
            return None
        try:
            with open(f"/proc/{self.pids[peer]}/stat", encoding="ascii", errors="replace") as fh:
                text = fh.read()
        except OSError:
            return "dead"
        st = text.rsplit(")", 1)[-1].split()[:1]
        code = st[0] if st else "?"
        if code in ("Z", "X", "x"):
            return "dead"
        if code in ("T", "t"):
            return "stopped"
        return "running"

    def first_dead(self, ranks: Iterable[int]) -> int | None:
        """The first of ``ranks`` whose process on this host is gone (None: none seen dead)."""
        return next((w for w in ranks if self.local[w] and self.state(w) == "dead"), None)

    def describe(self, peer: int) -> str:
        """How a peer that did not answer looks from here, for error messages."""
        s = self.state(peer)
        pid = self.pids[peer]
        if s == "dead":
            return f"died (its process, pid {pid} on this host, is gone)"
        if s == "stopped":
            return f"is stopped (pid {pid} on this host is in state T: SIGSTOP, Ctrl-Z or a debugger)"
        if s == "running":
            return (
                f"did not answer (pid {pid} on this host is running, but not inside a meshcomm "
                "operation: busy in other code, or blocked in another library)"
            )
        return "did not answer (it runs on another host: stopped, busy outside meshcomm, or its host is unreachable)"
