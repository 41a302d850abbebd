"""Starting the sockets backend without a hostfile: every rank's address from the coordinator.

Each rank opens its listener on an ephemeral port of the local address it uses to reach
the coordinator (so ranks on one host reach each other over loopback when the coordinator
is local, and over the network otherwise), registers ``{"ip", "port", "host_id"}`` through
:func:`.coordinator.exchange`, and gets the peer list a hostfile would have given;
start-up then goes on exactly as from a hostfile (the same handshake, the same shared
memory between ranks of one host: topology.py decides hosts from the same host key).
"""

from __future__ import annotations

import errno
import socket
import time

from meshcomm.plugin import Config, ConfigError, DistributedError

from .coordinator import exchange, local_address
from .hostfile import Peer, parse_hostfile
from .shm import host_key

__all__ = ["peers_from_coordinator"]


def _listen(rank: int, host: str, backlog: int) -> socket.socket:
    """A listener on an ephemeral port of ``host``."""
    try:
        family, stype, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"rank {rank}: cannot resolve the listen address {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, stype, proto)
    try:
        sock.bind(addr)
        sock.listen(max(backlog, 512))
    except OSError as exc:
        sock.close()
        fix = (
            " Set MESHCOMM_SOCKETS_BIND to a local address (e.g. 0.0.0.0)." if exc.errno == errno.EADDRNOTAVAIL else ""
        )
        raise DistributedError(f"rank {rank}: cannot listen on {host}: {exc.strerror or exc}.{fix}") from None
    return sock


def peers_from_coordinator(
    config: Config, bind: str | None, host_id: str | None, secret: bytes
) -> tuple[list[Peer], socket.socket, float]:
    """(every rank's address in rank order, this rank's listening socket, seconds of
    ``MLX_TIMEOUT`` left for connecting to the peers)."""
    coord = config.coordinator_address()
    rank, size = config.rank, config.world_size
    if coord is None or rank is None or size is None:
        raise ConfigError("the sockets backend without MLX_HOSTFILE needs a rank, a world size and a coordinator")
    start = time.monotonic()
    ip = local_address(coord)
    listener = _listen(rank, bind or ip, size)
    try:
        port = listener.getsockname()[1]
        entry = {"ip": ip, "port": port, "host_id": host_key(host_id).hex()}
        table = exchange(coord, rank, size, entry, secret=secret, timeout=config.timeout, warn_no_secret=False)
        peers = parse_hostfile(
            [{"ip": e.get("ip"), "port": e.get("port")} for e in table], f"the table of the coordinator at {coord}"
        )
    except BaseException:
        listener.close()
        raise
    left = config.timeout - (time.monotonic() - start)
    return peers, listener, max(left, min(config.timeout, 10.0))
