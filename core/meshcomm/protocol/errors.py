"""The errors meshcomm raises: one base class and one subclass per way a job can fail."""

from __future__ import annotations

from typing import Any

__all__ = [
    "DistributedError",
    "PeerLostError",
    "CommTimeoutError",
    "CollectiveMismatchError",
    "CallsDiffer",
    "BackendUnavailableError",
    "NotSupportedError",
    "ConfigError",
    "ObjectAuthError",
]


class DistributedError(RuntimeError):
    """Base of every error meshcomm raises about communication."""


class PeerLostError(DistributedError):
    """A peer closed its connection, reset it, or died."""

    def __init__(self, message: str, *, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class CommTimeoutError(DistributedError, TimeoutError):
    """A peer did not answer within the configured timeout (``MLX_TIMEOUT``)."""

    def __init__(self, message: str, *, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class CollectiveMismatchError(DistributedError):
    """Ranks called different operations, or the same one with different shapes or dtypes."""


class CallsDiffer(CollectiveMismatchError):
    """Raised by a backend that carries the core's call check with the data
    (``Backend.pipelines_calls``) when the ranks' call keys differ. Every rank raises it at
    the same call; the core then compares the calls over ``details`` (a backend of the same
    ranks whose channel is still in step, or None) and raises a CollectiveMismatchError
    naming what each rank called."""

    def __init__(self, message: str, *, details: Any = None) -> None:
        super().__init__(message)
        self.details = details


class ObjectAuthError(DistributedError):
    """An object collective's payload failed its seal (its tag under the job secret): it was
    changed on the way, or not sent by that rank of this job. Nothing was unpickled."""


class BackendUnavailableError(DistributedError):
    """A backend was asked for but cannot start (not installed, or its environment is broken)."""


class NotSupportedError(DistributedError):
    """The backend cannot do what was asked (for example shrink a group after a failure
    without the fault-tolerance its library lacks); the message names what is missing."""


class ConfigError(ValueError):
    """A setting has an invalid value; the message names the setting and what it accepts."""
