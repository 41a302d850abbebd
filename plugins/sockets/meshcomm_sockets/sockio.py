"""Reading an exact number of bytes from a TCP socket before a deadline (start-up exchanges).

Used by the coordinator's rendezvous and by the connections' handshakes, so that both
wait the same way: in slices (any ``MLX_TIMEOUT``, even one beyond what a single
``settimeout`` takes), checking the deadline between them.
"""

from __future__ import annotations

import socket
import time

__all__ = ["recv_exact", "WAIT_SLICE"]

#: the longest single wait; the loop checks the deadline after each
WAIT_SLICE = 3600.0


def recv_exact(sock: socket.socket, n: int, deadline: float, *, during: str = "") -> bytes:
    """``n`` bytes from ``sock`` by ``deadline`` (``time.monotonic()``).

    Raises TimeoutError when the deadline passes and ConnectionError when the peer closes
    first; ``during`` (e.g. ``"the handshake"``) is named in both messages.
    """
    where = f" during {during}" if during else ""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out{where}")
        sock.settimeout(min(left, WAIT_SLICE))
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            continue  # a slice ended: the loop checks the deadline
        if not chunk:
            raise ConnectionError(f"connection closed{where}")
        buf += chunk
    return bytes(buf)
