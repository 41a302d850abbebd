"""A member's side, inside its Ray actor: open a listening socket, meet the others, start the world.

The member opens its listening socket on its node's address (the kernel picks the port:
no race for it) and notes a spare free port, offers both to the group's rendezvous actor,
and waits for its answer: its rank and environment (the job secret among it) and the files
the backend writes for its ranks. It writes those files into a private directory of its own, sets the
variables in this process (one meshcomm world per actor process, as one per launched
rank), starts the world with ``meshcomm.init`` and removes the files again.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any

from ..api.group import Group
from ..api.world import init as world_init
from ..protocol.errors import CommTimeoutError
from ..runtime.ports import unclaimed_port
from ..runtime.private_files import write_atomic
from ._rendezvous import NAMESPACE, actor_name

__all__ = ["start_member", "start_in_actor"]


def _listener(ip: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, 0))
    s.listen(128)
    return s


def _write_files(folder: str, files: dict[str, str], env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Write the job's ``files`` (paths under ``folder``) into a new private directory of this
    member's own, so that members sharing a node never read each other's half-written or
    removed files; returns that directory and ``env`` pointing into it."""
    own = tempfile.mkdtemp(prefix="meshcomm-ray-")  # mode 0700, a fresh random name
    for path, content in files.items():
        write_atomic(own, os.path.basename(path), content.encode())
    return own, {k: v.replace(folder, own) for k, v in env.items()}


def start_member(group: str, rank: int | None, timeout: float) -> Group:
    """Offer this process to ``group``'s rendezvous actor and start the world it answers."""
    import ray

    rdv = ray.get_actor(actor_name(group), namespace=NAMESPACE)
    ip = ray.util.get_node_ip_address()
    listener = _listener(ip)
    offer: dict[str, Any] = {
        "ip": ip,
        "node": ray.get_runtime_context().get_node_id(),
        "port": listener.getsockname()[1],
        "fd": listener.fileno(),
        "spare_port": unclaimed_port(ip),
        "pid": os.getpid(),
    }
    try:
        got: Any = ray.get(rdv.join.remote(offer, rank), timeout=timeout + 5)
    except ray.exceptions.GetTimeoutError:
        listener.close()
        raise CommTimeoutError(
            f"meshcomm.ray group {group!r}: the rendezvous did not answer within {timeout:g} s", peer=None
        ) from None
    except BaseException:
        listener.close()
        raise
    answer: dict[str, Any] = dict(got)
    if answer["keep_listener"]:
        listener.detach()  # the backend owns the socket from now on (its fd is in the environment)
    else:
        listener.close()
    own, env = _write_files(answer["dir"], answer["files"], answer["env"])
    try:
        os.environ.update(env)
        return world_init(strict=True, backend=env["MLX_BACKEND"])
    finally:
        shutil.rmtree(own, ignore_errors=True)


def start_in_actor(actor: Any, group: str, rank: int, timeout: float) -> int:
    """Run by :func:`meshcomm.ray.create_group` in each actor (``__ray_call__``): its rank."""
    return start_member(group, rank, timeout).rank()
