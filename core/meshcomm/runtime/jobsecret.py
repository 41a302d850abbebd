"""The job secret's settings and start-up check, shared by every backend that authenticates with it.

``MESHCOMM_JOB_SECRET`` (``meshcomm launch`` sets a fresh one) keys the authentication of a
job's connections; ``MESHCOMM_REQUIRE_SECRET=1`` turns a job without one into an error
instead of a warning. A one-host job without one authenticates with the per-user key
(:mod:`.userkey`), so other local users cannot join it. A backend's settings model inherits
:class:`JobSecretSettings` and its factory calls :func:`check_job_secret` once, so every
backend defines and enforces these two variables the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from ..protocol.errors import ConfigError
from .config import setting
from .userkey import KeyUnavailable, all_loopback, user_key

__all__ = ["JobSecretSettings", "check_job_secret", "user_key_warning", "SECRET_HINT"]

#: how to make and share a secret: the one wording of every message that asks for one (rank 0's
#: warnings of the coordinator and the backends, the ConfigError of MESHCOMM_REQUIRE_SECRET)
SECRET_HINT = (
    "meshcomm launch sets a fresh secret itself; for ranks started otherwise make one secret and give "
    "the same value to every rank, e.g. export MESHCOMM_JOB_SECRET=$(python -c 'import secrets;"
    "print(secrets.token_hex(16))') before starting them (srun, mpirun and torchrun pass the "
    "environment on; elsewhere put it in each rank's environment)"
)

#: warnings already given in this process (one per backend and text)
_WARNED: set[str] = set()


class JobSecretSettings(BaseModel):
    """``secret`` and ``require_secret``: inherit this in a backend's settings model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret: str | None = setting(
        None,
        env="MESHCOMM_JOB_SECRET",
        accepts="any string, the same on every rank",
        description="per-job secret that authenticates the job's connections (meshcomm launch generates one)",
    )
    require_secret: bool = setting(
        False,
        env="MESHCOMM_REQUIRE_SECRET",
        accepts="1/0, true/false",
        description="a job without MESHCOMM_JOB_SECRET is a ConfigError instead of a warning on rank 0",
    )


def user_key_warning(who: str, path: object) -> str:
    """What rank 0 logs when a job authenticates with the per-user key at ``path``."""
    return (
        f"meshcomm {who}, rank 0: MESHCOMM_JOB_SECRET is not set, so this one-host job authenticates with "
        f"the per-user key at {path} (mode 0600): other users of this machine cannot join it or read or "
        "replace its objects; any process of this user can, and a job across hosts needs "
        "MESHCOMM_JOB_SECRET. Set MESHCOMM_REQUIRE_SECRET=1 to make a missing secret an error."
    )


def check_job_secret(
    settings: JobSecretSettings,
    *,
    who: str,
    rank: int | None,
    size: int | None,
    warning: str,
    log: logging.Logger,
    hosts: Iterable[str] | None = None,
) -> bytes | None:
    """A job without a secret: ConfigError under ``MESHCOMM_REQUIRE_SECRET`` (whatever its
    size: the setting asks for one). Else, when ``hosts`` (every rendezvous address) are all
    loopback and the job has several ranks, the per-user key (:func:`.userkey.user_key`) to
    authenticate with instead, noted once by rank 0; otherwise None and ``warning`` logged once
    per process by rank 0 of a job of several ranks. ``who`` names the backend in messages
    (e.g. ``"sockets backend"``)."""
    if settings.secret:
        return None
    if settings.require_secret:
        raise ConfigError(
            f"{who}, rank {'?' if rank is None else rank}: MESHCOMM_REQUIRE_SECRET is set but "
            f"MESHCOMM_JOB_SECRET is not: {SECRET_HINT}"
        )
    several = size is None or size > 1
    if several and hosts is not None and all_loopback(hosts):
        try:
            key, path = user_key()
        except KeyUnavailable as exc:
            warning = f"{warning} (The per-user key file was not used: {exc}.)"
        else:
            _warn_once(user_key_warning(who, path), rank, log)
            return key
    if several:
        _warn_once(warning, rank, log)
    return None


def _warn_once(text: str, rank: int | None, log: logging.Logger) -> None:
    """Log ``text`` on rank 0, once per process."""
    if rank == 0 and text not in _WARNED:
        _WARNED.add(text)
        log.warning(text)
