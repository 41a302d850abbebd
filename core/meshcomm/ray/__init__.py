"""meshcomm groups among Ray actors (``pip install meshcomm[ray]``).

From the driver, over actors that already exist::

    import meshcomm.ray
    workers = [Worker.remote() for _ in range(4)]
    meshcomm.ray.create_group(workers, backend="sockets")
    # inside every Worker method from now on: mc.init() is the world, mc.all_sum(x) ...

or from inside each actor, given a group name and its size::

    world = meshcomm.ray.init("train", size=4)

The members meet through a named Ray actor (:mod:`._rendezvous`), which draws the job
secret and hands every member its rank and environment through Ray; the backend starts as
under ``meshcomm launch`` (every backend that ``meshcomm launch`` starts itself: sockets,
gloo, third-party ones; not mpi, whose ranks only mpiexec can start). One meshcomm world
per actor process.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from ..api.group import Group
from ..protocol.backend import DEFAULT_TIMEOUT
from ._member import start_in_actor, start_member
from ._rendezvous import NAMESPACE, Rendezvous, actor_name

__all__ = ["create_group", "init"]


def _remote_rendezvous(group: str, size: int, backend: str, timeout: float, *, get_if_exists: bool) -> Any:
    import ray

    remote: Any = ray.remote
    cls = remote(num_cpus=0, max_concurrency=max(size + 4, 8))(Rendezvous)
    return cls.options(name=actor_name(group), namespace=NAMESPACE, get_if_exists=get_if_exists).remote(
        group, size, backend, timeout
    )


def create_group(
    actors: Sequence[Any], backend: str = "sockets", *, name: str | None = None, timeout: float | None = None
) -> str:
    """Make ``actors`` (Ray actor handles) the ranks of one meshcomm world, in their order.

    Runs in the driver (or any Ray task or actor); returns when every member's world has
    started, after which ``meshcomm.init()`` inside each of them returns it. ``timeout``
    (default ``MLX_TIMEOUT``'s default, 300 s) bounds the meeting and every operation of
    the world. Returns the group's name.
    """
    import ray

    if not actors:
        raise ValueError("meshcomm.ray.create_group: no actors given; pass the actor handles of the ranks")
    limit = float(timeout if timeout is not None else DEFAULT_TIMEOUT)
    group = name or f"group-{uuid.uuid4().hex[:12]}"
    rdv = _remote_rendezvous(group, len(actors), backend, limit, get_if_exists=False)
    try:
        refs = [a.__ray_call__.remote(start_in_actor, group, rank, limit) for rank, a in enumerate(actors)]
        got = ray.get(refs, timeout=limit + 30)
    finally:
        ray.kill(rdv)
    if got != list(range(len(actors))):
        raise RuntimeError(f"meshcomm.ray.create_group: the members started as ranks {got}, not in their order")
    return group


def init(
    group: str = "default",
    *,
    size: int,
    backend: str = "sockets",
    rank: int | None = None,
    timeout: float | None = None,
) -> Group:
    """Inside a Ray actor: join the group ``group`` of ``size`` members and return the world.

    Every member calls it with the same name, size and backend; ranks follow arrival unless
    ``rank`` is given. The first member to arrive creates the meeting point.
    """
    import ray

    limit = float(timeout if timeout is not None else DEFAULT_TIMEOUT)
    rdv = _remote_rendezvous(group, size, backend, limit, get_if_exists=True)
    # the member that created the meeting point owns it, and Ray ends an actor whose owner let
    # go of every handle: keep this one until the last member has started
    _meetings[group] = rdv
    world = start_member(group, rank, limit)
    try:
        last = ray.get(rdv.leave.remote())
    except ray.exceptions.RayActorError:  # already ended: this member's world has started all the same
        last = False
    if last:  # the last member to start ends the meeting point
        ray.kill(rdv)
    return world


#: handles of the meeting points this process joined through :func:`init`
_meetings: dict[str, Any] = {}
