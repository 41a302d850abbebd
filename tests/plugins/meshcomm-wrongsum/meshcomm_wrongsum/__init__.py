"""A deliberately broken backend for testing the conformance kit: the sockets backend, except
that every ``all_sum`` result has one bit flipped in its first byte (on every rank alike, so
only a check against NumPy notices). Everything else, start-up and launcher included, is the
sockets backend's."""

from __future__ import annotations

from typing import Any

import meshcomm_sockets.plugin as sockets
import numpy as np
from meshcomm.plugin import Backend, hookimpl


def _factory(config: Any, settings: Any) -> Backend:
    backend = sockets._factory(config, settings)
    right = backend.all_reduce

    def all_reduce(sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        right(sendbuf, recvbuf, op)
        if op == "sum" and recvbuf.size:
            recvbuf.view(np.uint8)[0] ^= 1

    backend.all_reduce = all_reduce  # type: ignore[method-assign]
    return backend


@hookimpl
def meshcomm_register_backends(register: Any) -> None:
    register(
        "wrongsum",
        factory=_factory,
        environment=sockets._environment,
        settings=sockets.SocketsSettings,
        launcher=sockets.SocketsLauncher(),
        priority=1000,
        description="test: sockets with a wrong all_sum",
    )
