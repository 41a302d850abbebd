"""Starting the world: the rendezvous store and the world's ProcessGroupGloo.

Nothing here touches torch.distributed's global state (no ``init_process_group``):
the store and process group are plain objects owned by the backend, so a user's own
torch.distributed default group in the same process is unaffected. Imports torch;
imported only by the factory.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from meshcomm.plugin import BackendUnavailableError, CommTimeoutError, Config

from .authstore import AuthStore
from .checkline import CheckLine, open_line
from .errors import ConnectAbandoned, store_timed_out
from .heartbeat import Heartbeat
from .liveness import RankProcess, endpoints, member, suspects
from .meshwait import build_watched
from .placing import is_address, resolve
from .sealing import Sealer
from .settings import GlooSettings

__all__ = ["make_store", "make_group", "connect", "device_of", "WORLD_PREFIX"]

#: key prefix of every store key meshcomm writes (the world group's own prefix is below it)
WORLD_PREFIX = "meshcomm/world"


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def make_store(config: Config, settings: GlooSettings, *, join: bool = False) -> tuple[Any, int, int, str]:
    """The rendezvous store (an :class:`.authstore.AuthStore`), this rank, the world size and a
    description of the store.

    Where the store is and who hosts it comes from :func:`.placing.resolve`; every value in it
    is sealed with the job secret (:mod:`.sealing`). A newcomer (``join``) is always a client
    of the running job's store, whatever rank its environment names.
    """
    rdv = resolve(config, settings)
    if join and rdv.kind == "host":
        rdv = dataclasses.replace(rdv, kind="client")
    rank, size, where = rdv.rank, rdv.size, rdv.describe()
    sealer = Sealer((settings.secret or "").encode(), rdv.job)
    inner: Any
    reopen: Callable[[float], Any] | None = None  # a second client (FileStore: none, it counts its users)
    if rdv.kind == "file":
        try:
            inner = dist.FileStore(str(rdv.file), size)
            inner.set_timeout(_delta(config.timeout))
        except Exception as exc:
            raise _store_error(exc, where, rank, size, config.timeout, host=False) from exc
    else:
        host = rdv.kind == "host"
        left = config.timeout if host else _wait_until_listening(rdv.addr, rdv.port, config.timeout)
        try:
            # rank 0 does not wait here for the others to connect: it waits for their start-up
            # challenges (:mod:`.session`), which names the ranks that never came
            inner = dist.TCPStore(rdv.addr, rdv.port, size, host, timeout=_delta(left), wait_for_workers=False)
            inner.set_timeout(_delta(config.timeout))
        except Exception as exc:
            raise _store_error(exc, where, rank, size, config.timeout, host=host) from exc

        def client(timeout: float) -> Any:
            # the store is up: a connection that takes seconds will not come
            c = dist.TCPStore(
                rdv.addr, rdv.port, None, False, timeout=_delta(min(timeout, 5.0)), wait_for_workers=False
            )
            c.set_timeout(_delta(timeout))
            return c

        reopen = client

    store = AuthStore(inner, sealer, namespace=rdv.namespace, rank=rank, where=where, reopen=reopen)
    return store, rank, size, where


#: seconds between a client's looks for rank 0's store before it is up
_LOOK_EVERY = 0.02


def _wait_until_listening(addr: str, port: int, timeout: float) -> float:
    """Wait until the store's port takes connections; the seconds of ``timeout`` left (at
    least one: TCPStore then reports a store that never came up in its own words).

    TCPStore's client retries a refused connection after growing pauses: a rank 0 that
    comes up 8 s late (importing torch on a loaded host) cost its peers 2-3 s more. A look
    every 20 ms lets TCPStore connect at once."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((addr, port), timeout=max(0.05, min(1.0, left))).close()
            return max(1.0, left)
        except OSError:
            if left <= 0:
                return 1.0
            time.sleep(_LOOK_EVERY)


def _store_error(exc: Exception, where: str, rank: int, size: int, timeout: float, host: bool) -> Exception:
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    low = said.lower()
    if "address already in use" in low or "eaddrinuse" in low:
        return BackendUnavailableError(
            f"gloo backend: rank {rank} cannot host the {where}: the port is in use. "
            "Pick another MESHCOMM_GLOO_PORT (or let `meshcomm launch` choose one)."
        )
    if "timed out" in low or "timeout" in low:
        role = f"waiting for all {size} ranks to connect" if host else "connecting to rank 0's store"
        return CommTimeoutError(
            f"gloo backend: rank {rank} timed out after {timeout:g} s (MLX_TIMEOUT) {role} at the {where}. "
            "Check that every rank was started with the same store address (MESHCOMM_GLOO_ADDR/PORT or "
            "MLX_COORDINATOR) and world size (MLX_WORLD_SIZE or the scheduler's) "
            f"and that rank 0 is running. torch said: {said}"
        )
    return BackendUnavailableError(f"gloo backend: rank {rank} could not open the {where}: {said}")


def device_of(settings: GlooSettings) -> str | None:
    """What gloo's data connections use: the interface named (MESHCOMM_GLOO_IFNAME), else
    the address MESHCOMM_GLOO_HOST gives unless GLOO_SOCKET_IFNAME names an interface
    (torch reads that one itself), else None (the host name's address)."""
    if settings.ifname:
        return settings.ifname
    if settings.host and not os.environ.get("GLOO_SOCKET_IFNAME"):
        return settings.host
    return None


def make_group(store: Any, prefix: str, rank: int, size: int, timeout: float, ifname: str | None) -> Any:
    """A ProcessGroupGloo over ``PrefixStore(prefix, store)``; connects to every member.
    ``ifname`` (:func:`device_of`) is an interface name or an IP address of this host."""
    pstore = dist.PrefixStore(prefix, store)
    if not ifname:
        return dist.ProcessGroupGloo(pstore, rank, size, _delta(timeout))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, missing from the stubs
    device = (
        dist.ProcessGroupGloo.create_device(hostname=ifname)
        if is_address(ifname)
        else dist.ProcessGroupGloo.create_device(interface=ifname)
    )
    opts._devices = [device]
    opts._timeout = _delta(timeout)
    return dist.ProcessGroupGloo(pstore, rank, size, opts)


def connect(
    store: Any,
    prefix: str,
    rank: int,
    size: int,
    timeout: float,
    ifname: str | None,
    peers: list[RankProcess] | None = None,
    members: list[int] | None = None,
) -> tuple[Any, list[set[str]], CheckLine | None]:
    """:func:`make_group`, plus every member's TCP endpoints of that group (index = group rank)
    and this rank's call-check channel (:mod:`.checkline`; None in a group of one).

    gloo's connection is watched (:mod:`.meshwait`): it is given up with ConnectAbandoned after
    ``timeout`` (naming the members that gave no sign of life: :mod:`.heartbeat`) or as soon as
    a member on this host exits (``peers``: every world rank's process; ``members[i]``: the
    world rank of group rank ``i``, default ``range(size)``).
    The endpoints let a failure's address ("closed by peer [ip]:port") be traced to a rank
    (:func:`.liveness.owner`); an empty list when they could not be learnt.
    """
    world = list(range(size)) if members is None else members
    # gloo's rendezvous waits inside the store's client, holding it: on a connection of its own,
    # an abandoned connection cannot hold up this rank's later store calls (failure records,
    # the survivors' agreement), and the signs of life go over the usual one meanwhile
    own = _own_connection(store, timeout) if size > 1 else None
    before = endpoints()
    try:
        pg = build_watched(
            lambda: make_group(own or store, prefix, rank, size, timeout, ifname),
            timeout,
            lambda: suspects(peers or [], world, rank, dead_only=True),
            None if own is None else Heartbeat(store, prefix, rank, world, peers or []),
        )
    except ConnectAbandoned:
        if own is not None:
            own.abandon()  # gloo's rendezvous, left behind, leaves its store wait now
        raise
    if own is not None:
        own.use_connection_of(store)
    mine = endpoints() - before
    ends = _exchange_ends(store, prefix, rank, size, timeout, mine, world, peers or [])
    return pg, ends, open_line(store, prefix, rank, size, timeout, _reachable_ip(mine, ifname))


def _own_connection(store: Any, timeout: float) -> Any:
    """A second client of ``store`` (:meth:`.authstore.AuthStore.twin`); None where there is none."""
    twin = getattr(store, "twin", None)
    if twin is None:
        return None
    try:
        return twin(timeout)
    except Exception:  # noqa: BLE001 - the store is unreachable: gloo's rendezvous will say so on the usual one
        return None


def _exchange_ends(
    store: Any,
    prefix: str,
    rank: int,
    size: int,
    timeout: float,
    mine: set[str],
    world: list[int],
    peers: list[RankProcess],
) -> list[set[str]]:
    """Every member's TCP endpoints of the new group (empty if the store fails: only error
    messages then lose a name). A member that has not published its own within ``timeout``
    has not finished connecting (its side of gloo's mesh may have completed against a stopped
    process's listen queue), so this raises ConnectAbandoned naming it instead of also waiting
    a timeout for its check channel."""
    keys = [f"{prefix}/meshcomm-ends/{q}" for q in range(size)]
    try:
        store.set(keys[rank], " ".join(sorted(mine)))
        store.wait(keys, _delta(timeout))
        return [set(bytes(v).decode().split()) for v in store.multi_get(keys)]
    except Exception as exc:  # noqa: BLE001 - sorted out below
        if not store_timed_out(exc):
            return []
    try:
        missing = [q for q in range(size) if not store.check([keys[q]])]
    except Exception:  # noqa: BLE001 - the store is gone too: the check channel will say so
        return []
    if not missing:
        return []
    named = [(q, f"{member(q, world, peers)} did not finish connecting") for q in missing]
    raise ConnectAbandoned(
        f"timed out after {timeout:g} s waiting for every member to finish connecting to the group",
        named,
        seen="",
    )


def _reachable_ip(mine: set[str], ifname: str | None) -> str:
    """The local address of this rank's gloo connections (where its peers reach it)."""
    for end in sorted(mine):
        ip = end.rpartition(":")[0].strip("[]")
        if ip not in ("0.0.0.0", "::", ""):
            return ip
    if ifname and is_address(ifname):
        return ifname
    return socket.gethostbyname(socket.gethostname())
