"""A group of Ray actors as a job the backends' launcher support understands.

``meshcomm launch`` asks a backend's :class:`~meshcomm.runtime.launchspec.RankEnvLauncher`
for each rank's environment given a :class:`~meshcomm.runtime.launchspec.JobSpec`. The
same question is asked here, of a job whose ranks are Ray actors that have already opened
their listening sockets and picked a spare port on their node (their *offers*), so every
backend that ``meshcomm launch`` can start (sockets, gloo, third parties) starts in Ray
without code of its own. Files a backend writes for its ranks (the sockets hostfile) are
handed to every member to write on its own node.
"""

from __future__ import annotations

import secrets
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime.launchspec import RankPlace

__all__ = ["Offer", "RayJob"]


@dataclass(frozen=True)
class Offer:
    """What one member brings: where it runs and the sockets it opened."""

    ip: str  #: its node's address
    node: str  #: Ray's node id
    port: int  #: its listening socket's port
    fd: int  #: that socket's file descriptor, in the member's process
    spare_port: int  #: a port that was free on its node a moment ago (gloo's store, if rank 0)
    pid: int

    @staticmethod
    def of(raw: dict[str, Any]) -> Offer:
        ip, node, port, fd = str(raw["ip"]), str(raw["node"]), int(raw["port"]), int(raw["fd"])
        return Offer(ip, node, port, fd, int(raw["spare_port"]), int(raw["pid"]))


@dataclass
class RayJob:
    """:class:`~meshcomm.runtime.launchspec.JobSpec` of members that already made their offers."""

    offers: list[Offer]
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    verbose: bool = False
    shm_dir: Path | None = None
    keep_going: bool = False
    files: dict[str, str] = field(default_factory=dict, repr=False)
    #: ranks whose listening socket the backend took (the others close theirs)
    listened: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.nranks = len(self.offers)
        seen: dict[str, int] = {}
        self.places: list[RankPlace] = []
        for rank, o in enumerate(self.offers):
            self.places.append(RankPlace(rank, None, o.ip, seen.get(o.node, 0)))
            seen[o.node] = seen.get(o.node, 0) + 1
        self.local_sizes = [seen[o.node] for o in self.offers]
        #: where files of the job are written on every member's node (then removed)
        self.dir = Path(tempfile.gettempdir()) / f"meshcomm-ray-{self.job_id}"

    def free_port(self, place: RankPlace) -> int:
        return self.offers[place.rank].spare_port

    def listen_socket(self, place: RankPlace) -> tuple[int, int | None]:
        o = self.offers[place.rank]
        self.listened.add(place.rank)
        return o.port, o.fd

    def add_file(self, name: str, content: str) -> str:
        path = str(self.dir / name)
        self.files[path] = content
        return path
