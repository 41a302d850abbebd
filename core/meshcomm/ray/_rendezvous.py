"""The group's meeting point: one named Ray actor per group, holding the members' offers.

Each member calls :meth:`Rendezvous.join` with its offer and waits; when the last one
arrives, the rendezvous asks the backend's launcher support for every rank's environment
(:mod:`._job`), adds the job's variables (rank, size, job id, the job secret it drew) and
answers every member with its own. The secret travels only in these answers, through Ray's
object store, never in a log or on a command line. The actor ends itself once every member
has said it started (:meth:`Rendezvous.leave`); if the group does not fill within the
timeout, every waiting member gets an error naming how many came.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..protocol.errors import ConfigError
from ..runtime.launchspec import RankEnvLauncher
from ..runtime.registry import get_registry
from ._job import Offer, RayJob

__all__ = ["Rendezvous", "actor_name", "NAMESPACE"]

#: Ray namespace of the rendezvous actors (named actors are found within one namespace)
NAMESPACE = "meshcomm"


def actor_name(group: str) -> str:
    return f"meshcomm-group:{group}"


class Rendezvous:
    """Wrapped with ``ray.remote`` by :func:`meshcomm.ray.create_group` / :func:`meshcomm.ray.init`."""

    def __init__(self, group: str, size: int, backend: str, timeout: float) -> None:
        self.group, self.size, self.backend, self.timeout = group, size, backend, timeout
        self.offers: dict[int, Offer] = {}
        self.arrivals = 0
        self.ready = asyncio.Event()
        self.answers: list[dict[str, Any]] | None = None
        self.failure: str | None = None
        self.left = 0

    async def join(self, raw: dict[str, Any], rank: int | None) -> dict[str, Any]:
        """Add this member's offer; its rank, environment and files once every member came."""
        if rank is None:
            rank = self.arrivals
            while rank in self.offers:
                rank += 1
        if not 0 <= rank < self.size or rank in self.offers:
            raise ConfigError(
                f"meshcomm.ray group {self.group!r}: rank {rank} is taken or outside 0..{self.size - 1}; give each "
                f"of the {self.size} members its own rank (or none)"
            )
        self.arrivals += 1
        self.offers[rank] = Offer.of(raw)
        if len(self.offers) == self.size:
            try:
                self.answers = self._answers()
            except Exception as exc:  # noqa: BLE001 - every waiting member must hear it
                self.failure = f"{type(exc).__name__}: {exc}"
            self.ready.set()
        try:
            await asyncio.wait_for(self.ready.wait(), self.timeout)
        except asyncio.TimeoutError:
            missing = sorted(set(range(self.size)) - set(self.offers))
            raise TimeoutError(
                f"meshcomm.ray group {self.group!r}: {len(self.offers)} of {self.size} members came within "
                f"{self.timeout:g} s (ranks {missing} did not); start every member (create_group starts them all), "
                "or raise the timeout"
            ) from None
        if self.failure is not None or self.answers is None:
            raise ConfigError(
                f"meshcomm.ray group {self.group!r}: the {self.backend} backend cannot start: {self.failure}"
            )
        return self.answers[rank]

    def _answers(self) -> list[dict[str, Any]]:
        spec = get_registry().spec(self.backend)
        reason = spec.unavailable_reason()
        if reason is not None:
            raise ConfigError(f"backend {self.backend!r} is not usable here: {reason}")
        support = spec.launcher
        if not isinstance(support, RankEnvLauncher):
            raise ConfigError(
                f"backend {self.backend!r} is started by its own launcher (mpiexec), not by meshcomm, so its ranks "
                "cannot be Ray actors; use sockets or gloo"
            )
        job = RayJob([self.offers[r] for r in range(self.size)])
        envs = support.rank_env(job)
        answers = []
        for place, env in zip(job.places, envs, strict=True):
            full = {
                "MLX_BACKEND": self.backend,
                "MLX_RANK": str(place.rank),
                "MLX_WORLD_SIZE": str(job.nranks),
                "MLX_LOCAL_RANK": str(place.local_index),
                "MLX_LOCAL_SIZE": str(job.local_sizes[place.rank]),
                "MESHCOMM_JOB_ID": job.job_id,
                "MESHCOMM_JOB_SECRET": job.secret,
                "MLX_TIMEOUT": f"{self.timeout:g}",
                **env,
            }
            answers.append(
                {
                    "rank": place.rank,
                    "env": full,
                    "files": dict(job.files),
                    "dir": str(job.dir),
                    "keep_listener": place.rank in job.listened,
                }
            )
        return answers

    def leave(self) -> bool:
        """A member started (or gave up): the actor ends once all have."""
        self.left += 1
        return self.left >= self.size
