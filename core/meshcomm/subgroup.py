"""The generic subgroup: a split that reuses its parent's point-to-point links."""

from __future__ import annotations

import numpy as np

from .backend import Backend

__all__ = ["SubgroupBackend"]


class SubgroupBackend(Backend):
    """Ranks ``members`` of ``parent`` as a group of their own; collectives come from the
    generic algorithms over the parent's send/recv, with ranks translated."""

    #: the generic algorithms accept the caller's out= buffers (see Backend.direct_out)
    direct_out = True

    def __init__(self, parent: Backend, members: list[int]) -> None:
        self.parent = parent
        self.members = list(members)
        self._rank = self.members.index(parent.rank())
        self.timeout = parent.timeout

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.members)

    def send(self, buf: np.ndarray, dst: int) -> None:
        self.parent.send(buf, self.members[dst])

    def recv(self, buf: np.ndarray, src: int) -> None:
        self.parent.recv(buf, self.members[src])

    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None:
        self.parent.sendrecv(sendbuf, self.members[dst], recvbuf, self.members[src])
