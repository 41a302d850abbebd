"""The job secret's settings and start-up check, shared by every backend that authenticates with it.

``MESHCOMM_JOB_SECRET`` (``meshcomm launch`` sets a fresh one) keys the authentication of a
job's connections; ``MESHCOMM_REQUIRE_SECRET=1`` turns a job without one into an error
instead of a warning. A backend's settings model inherits :class:`JobSecretSettings` and its
factory calls :func:`check_job_secret` once, so every backend defines and enforces these
two variables the same way.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict

from .config import setting
from .errors import ConfigError

__all__ = ["JobSecretSettings", "check_job_secret", "SECRET_HINT"]

#: how to make and share a secret, for messages
SECRET_HINT = (
    "give every rank the same secret, e.g. export MESHCOMM_JOB_SECRET=$(python -c 'import secrets;"
    "print(secrets.token_hex(16))') once and pass it to every rank (meshcomm launch sets one itself)"
)

#: warnings already given in this process (one per backend and text)
_WARNED: set[str] = set()


class JobSecretSettings(BaseModel):
    """``secret`` and ``require_secret``: inherit this in a backend's settings model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret: str | None = setting(
        None, env="MESHCOMM_JOB_SECRET", accepts="any string, the same on every rank",
        description="per-job secret that authenticates the job's connections (meshcomm launch generates one)",
    )
    require_secret: bool = setting(
        False, env="MESHCOMM_REQUIRE_SECRET", accepts="1/0, true/false",
        description="a job without MESHCOMM_JOB_SECRET is a ConfigError instead of a warning on rank 0",
    )


def check_job_secret(settings: JobSecretSettings, *, who: str, rank: int | None, size: int | None,
                     warning: str, log: logging.Logger) -> None:
    """A job without a secret: ConfigError under ``MESHCOMM_REQUIRE_SECRET`` (whatever its
    size: the setting asks for one), else ``warning`` logged once per process by rank 0 of a
    job of several ranks. ``who`` names the backend in the error (e.g. ``"sockets backend"``)."""
    if settings.secret:
        return
    if settings.require_secret:
        raise ConfigError(
            f"{who}, rank {'?' if rank is None else rank}: MESHCOMM_REQUIRE_SECRET is set but "
            f"MESHCOMM_JOB_SECRET is not: {SECRET_HINT}"
        )
    if rank == 0 and (size is None or size > 1) and warning not in _WARNED:
        _WARNED.add(warning)
        log.warning(warning)
