"""meshcomm: collective communication for NumPy arrays, with the transport as a plugin.

    import meshcomm as mc
    world = mc.init()
    total = mc.all_sum(np.ones(4))
"""

from __future__ import annotations

from .backend import Backend
from .config import Config
from .errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CommTimeoutError,
    ConfigError,
    DistributedError,
    PeerLostError,
)
from .group import Group
from .ops import (
    all_gather,
    all_gather_object,
    all_max,
    all_min,
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
from .registry import BackendInfo
from .work import Work
from .world import backends, init, is_available

__version__ = "0.1.0"

__all__ = [
    "init", "is_available", "backends", "Group", "Config", "Backend", "BackendInfo",
    "all_sum", "all_max", "all_min", "all_gather", "sum_scatter", "broadcast", "send", "recv",
    "recv_like", "all_to_all", "gather", "scatter", "reduce", "all_gather_object", "broadcast_object",
    "barrier", "Work", "DistributedError", "PeerLostError", "CommTimeoutError",
    "CollectiveMismatchError", "BackendUnavailableError", "ConfigError",
]
