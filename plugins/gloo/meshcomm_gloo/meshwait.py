"""Waiting for gloo's mesh connection no longer than MLX_TIMEOUT, and not at all for a dead member.

Building a ProcessGroupGloo connects every pair of members. When a member dies after it
published its address, gloo keeps waiting for that member's connection far longer than the
timeout it was given (measured with torch 2.13: 40 s with an 8 s timeout). So the process
group is built in a helper thread (gloo releases the GIL while it waits) and the calling
thread watches: a member on this host that is gone ends the wait at once, naming it, and
so does the deadline (the timeout plus a second, so that gloo's own errors, which say more,
come first when gloo keeps to its timeout). An abandoned build finishes or fails on its own
in the background; its result is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import ConnectAbandoned

__all__ = ["build_watched"]

#: seconds between looks at the members' processes while gloo connects
LOOK_EVERY = 0.05
#: seconds gloo gets past the timeout before the wait is given up
GRACE = 1.0


def build_watched(build: Callable[[], Any], timeout: float, lost: Callable[[], list[tuple[int, str]]]) -> Any:
    """``build()``'s result; raises what it raised, or ConnectAbandoned when ``lost()`` names a
    dead member or ``timeout`` + GRACE seconds passed first."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        finally:
            done.set()

    started = time.monotonic()
    threading.Thread(target=run, name="meshcomm-gloo-connect", daemon=True).start()
    deadline = started + timeout + GRACE
    while not done.wait(LOOK_EVERY):
        dead = lost()
        if dead:
            said = "; ".join(text for _, text in dead)
            raise ConnectAbandoned(f"connection closed while connecting to every member: {said}", dead)
        if time.monotonic() >= deadline:
            raise ConnectAbandoned(
                f"timed out after {time.monotonic() - started:.1f} s connecting to every member "
                "(gloo was still waiting for a member's connection)",
                [],
            )
    if "error" in box:
        raise box["error"]
    return box["value"]
