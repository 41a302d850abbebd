"""The size-1 backend: what ``init()`` returns when no multi-process backend is set up.

Registered through the same hook as every other backend. It imports only the hook
vocabulary (:mod:`meshcomm.runtime.hookspecs`), never the registry, which loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..protocol.backend import DEFAULT_TIMEOUT, Backend
from .hookspecs import BackendRegistrar, hookimpl

if TYPE_CHECKING:
    from .config import Config

__all__ = ["SingleBackend", "meshcomm_register_backends"]


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


def _factory(config: Config, settings: Any) -> Backend:
    return SingleBackend(config.timeout)


@hookimpl
def meshcomm_register_backends(register: BackendRegistrar) -> None:
    register(
        "single",
        factory=_factory,
        multiprocess=False,
        priority=1000,
        description="one process alone (the fallback of 'any')",
    )
