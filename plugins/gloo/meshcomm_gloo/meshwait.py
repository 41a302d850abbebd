"""Waiting for gloo's mesh connection no longer than MLX_TIMEOUT, and not at all for a dead member.

Building a ProcessGroupGloo connects every pair of members. When a member dies after it
published its address, gloo keeps waiting for that member's connection far longer than the
timeout it was given (measured with torch 2.13: 40 s with an 8 s timeout). So the process
group is built in a helper thread (gloo releases the GIL while it waits) and the calling
thread watches: a member on this host that is gone ends the wait at once, naming it, and
so does the deadline (the timeout plus a second, so that gloo's own errors, which say more,
come first when gloo keeps to its timeout). At the deadline, and when gloo reports a lost
connection that no member on this host explains, the members that gave no sign of life in
the store (:mod:`.heartbeat`) are named, wherever they run. An abandoned build finishes or
fails on its own in the background; its result is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import ConnectAbandoned, first_line, lost_connection
from .heartbeat import BEGIN, EVERY, WINDOW, Heartbeat

__all__ = ["build_watched"]

#: seconds between looks at the members' processes while gloo connects
LOOK_EVERY = 0.05
#: seconds gloo gets past the timeout before the wait is given up
GRACE = 1.0


def build_watched(
    build: Callable[[], Any],
    timeout: float,
    lost: Callable[[], list[tuple[int, str]]],
    signs: Heartbeat | None = None,
) -> Any:
    """``build()``'s result; raises what it raised, or ConnectAbandoned when ``lost()`` names a
    dead member or ``timeout`` + GRACE seconds passed first (naming the members ``signs`` found
    silent)."""
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
    # the members' signs are noted once everyone waiting has given a few, a window before the deadline
    mark_at = max(deadline - WINDOW, started + BEGIN + 2 * EVERY)
    marked = float("inf")  # when the signs were noted
    while not done.wait(LOOK_EVERY):
        now = time.monotonic()
        if signs is not None and now >= started + BEGIN:
            signs.beat(now)
            if marked == float("inf") and now >= mark_at and signs.mark():
                marked = now
        dead = lost()
        if dead:
            said = "; ".join(text for _, text in dead)
            raise ConnectAbandoned(f"connection closed while connecting to every member: {said}", dead)
        if now >= deadline:
            # (a window shorter than two signs, with a tiny MLX_TIMEOUT, would name live members)
            silent = signs.silent() if signs is not None and now - marked >= 2 * EVERY else []
            raise ConnectAbandoned(
                f"timed out after {now - started:.1f} s connecting to every member "
                "(gloo was still waiting for a member's connection)",
                silent,
                seen="",
            )
    if "error" in box:
        error = box["error"]
        if signs is not None and lost_connection(error) and not lost():
            silent = _listen(signs, started)
            if silent:
                raise ConnectAbandoned(
                    f"gloo lost a connection while connecting to every member: {first_line(error)}",
                    silent,
                    seen="",
                ) from error
        raise error
    return box["value"]


def _listen(signs: Heartbeat, started: float) -> list[tuple[int, str]]:
    """The members that give no sign of life over the next window (gloo lost a connection and
    did not say whose): this member keeps giving its own meanwhile."""
    now = time.monotonic()
    until = max(now, started + BEGIN + 2 * EVERY)
    while True:
        signs.beat(now)
        if now >= until:
            break
        time.sleep(LOOK_EVERY)
        now = time.monotonic()
    if not signs.mark():
        return []
    end = now + WINDOW
    while now < end:
        time.sleep(LOOK_EVERY)
        now = time.monotonic()
        signs.beat(now)
    return signs.silent()
