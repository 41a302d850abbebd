"""meshcomm: collective communication for NumPy arrays, with the transport as a plugin.

import meshcomm as mc
world = mc.init()
total = mc.all_sum(np.ones(4))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: where each public name lives: ``import meshcomm`` imports none of them, so a process that
#: only needs a submodule (``meshcomm launch``, ``python -m meshcomm.launch.rank``) does not pay
#: for NumPy, the API and the settings model; the first use of a name imports its module
_WHERE = {
    "Group": ".api.group",
    **dict.fromkeys(
        (
            "all_gather",
            "all_gather_object",
            "all_max",
            "all_min",
            "all_reduce_init",
            "all_sum",
            "all_to_all",
            "barrier",
            "broadcast",
            "broadcast_object",
            "gather",
            "recv",
            "recv_like",
            "reduce",
            "scatter",
            "send",
            "sum_scatter",
        ),
        ".api.ops",
    ),
    "Persistent": ".api.persistent",
    "Work": ".api.work",
    **dict.fromkeys(("backends", "init", "is_available"), ".api.world"),
    "Backend": ".protocol.backend",
    **dict.fromkeys(
        (
            "BackendUnavailableError",
            "CollectiveMismatchError",
            "CommTimeoutError",
            "ConfigError",
            "DistributedError",
            "NotSupportedError",
            "ObjectAuthError",
            "PeerLostError",
        ),
        ".protocol.errors",
    ),
    "BackendInfo": ".runtime.registry",
    "Config": ".runtime.config",
}

if TYPE_CHECKING:
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
    from .runtime.config import Config
    from .runtime.registry import BackendInfo


def __getattr__(name: str) -> Any:
    """A public name on its first use (see ``_WHERE``); kept as a module attribute after it."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


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
