"""meshcomm: collective communication for NumPy arrays, with the transport as a plugin.

import meshcomm as mc
world = mc.init()
total = mc.all_sum(np.ones(4))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .api.group import Group
from .api.ops import (
    all_gather,
    all_gather_object,
    all_max,
    all_min,
    all_reduce_init,
    all_sum,
    all_to_all,
    barrier,
    broadcast,
    broadcast_object,
    gather,
    recv,
    recv_like,
    reduce,
    scatter,
    send,
    sum_scatter,
)
from .api.persistent import Persistent
from .api.work import Work
from .api.world import backends, init, is_available
from .protocol.backend import Backend
from .protocol.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CommTimeoutError,
    ConfigError,
    DistributedError,
    NotSupportedError,
    ObjectAuthError,
    PeerLostError,
)
from .runtime.registry import BackendInfo

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .runtime.config import Config


def __getattr__(name: str) -> Any:
    """``Config`` on first use: the settings model needs pydantic, which ``init()`` imports
    anyway and ``import meshcomm`` need not (start-up of every rank)."""
    if name == "Config":
        from .runtime.config import Config

        return Config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "init",
    "is_available",
    "backends",
    "Group",
    "Config",
    "Backend",
    "BackendInfo",
    "all_sum",
    "all_max",
    "all_min",
    "all_gather",
    "sum_scatter",
    "broadcast",
    "send",
    "recv",
    "recv_like",
    "all_to_all",
    "gather",
    "scatter",
    "reduce",
    "all_gather_object",
    "broadcast_object",
    "barrier",
    "all_reduce_init",
    "Persistent",
    "Work",
    "DistributedError",
    "NotSupportedError",
    "PeerLostError",
    "CommTimeoutError",
    "CollectiveMismatchError",
    "BackendUnavailableError",
    "ConfigError",
    "ObjectAuthError",
]
