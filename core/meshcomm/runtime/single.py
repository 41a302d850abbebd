"""The size-1 backend's registration: what ``init()`` returns when no multi-process backend
is set up (the backend itself: :mod:`meshcomm.runtime.single_backend`).

Registered through the same hook as every other backend. It imports only the hook
vocabulary (:mod:`meshcomm.runtime.hookspecs`), never the registry, which loads it, and
imports the backend when one is started, so that loading the registry (``meshcomm launch``
does) does not import NumPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .hookspecs import BackendRegistrar, hookimpl

if TYPE_CHECKING:
    from ..protocol.backend import Backend
    from .config import Config

__all__ = ["meshcomm_register_backends"]


def _factory(config: Config, settings: Any) -> Backend:
    from .single_backend import SingleBackend

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
