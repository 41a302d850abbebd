"""The size-1 backend: a group of one rank, registered by :mod:`meshcomm.runtime.single`."""

from __future__ import annotations

import numpy as np

from ..protocol.backend import DEFAULT_TIMEOUT, Backend

__all__ = ["SingleBackend"]


class SingleBackend(Backend):
    """A group of one rank: collectives copy, point-to-point has no peer."""

    #: the generic algorithms accept the caller's out= buffers (see Backend.direct_out)
    direct_out = True

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def send(self, buf: np.ndarray, dst: int) -> None:
        raise ValueError("cannot send in a group of size 1: there is no other rank")

    def recv(self, buf: np.ndarray, src: int) -> None:
        raise ValueError("cannot receive in a group of size 1: there is no other rank")

    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        recvbuf[...] = sendbuf

    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        recvbuf[...] = sendbuf

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        recvbuf[...] = sendbuf

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        return None

    def barrier(self) -> None:
        return None

    def split(self, color: int, key: int) -> Backend:
        return SingleBackend(self.timeout)
