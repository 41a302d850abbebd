"""Ports a rank will listen on later, picked where no outgoing connection can take them."""

from __future__ import annotations

import random
import socket

__all__ = ["outgoing_ports_from", "unclaimed_port"]


def outgoing_ports_from() -> int:
    """The first port of the kernel's range for outgoing connections (Linux's default
    32768-60999; ``bind`` to port 0 picks from it too)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def unclaimed_port(ip: str = "127.0.0.1") -> int:
    """A port free on this host now, below the range of ports for outgoing connections.

    A rank may listen on it seconds later (a gloo rank 0 imports torch first); a port from
    ``bind`` to port 0 is in that range, where any connection made meanwhile may take it as
    its own end (the rank then fails with EADDRINUSE). Only a process binding that very
    port on purpose can take this one."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    top = outgoing_ports_from()
    for _ in range(200):
        port = random.randrange(10000, max(10001, top))
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:  # every port tried below is taken
        s.bind((ip, 0))
        return int(s.getsockname()[1])
