from typing import Any

import numpy as np

from .guard import Ticket

class Guard:
    """The one-thread guard of a world, compiled (see meshcomm.api.guard.WorldGuard)."""

    def enter(self, op: str, who: str) -> Ticket: ...
    def leave(self, ticket: Ticket, op: str, who: str, ok: bool) -> None: ...

class Running:
    """What the compiled lanes' operation in progress is (an observer's ``current``)."""

    def current(self) -> tuple[Any, ...] | None: ...

class Lane:
    """A group's blocking all_sum/all_max/all_min, persistent starts and barrier, compiled."""

    def __init__(
        self,
        group: Any,
        guard: Guard,
        world: Any,
        worker: Any,
        backend: Any,
        moves: Any,
        who: str,
        observers: Any,
        plain: bool,
        keyed: bool,
        piped: bool,
    ) -> None: ...
    def run(self, x: Any, k: int, out: np.ndarray | None = None) -> np.ndarray: ...
    def start(self, p: Any) -> np.ndarray: ...
    def barrier(self) -> None: ...

def setup(movable: Any, shape_keys: Any, calls_differ: type, kept: tuple[type, ...]) -> None: ...
