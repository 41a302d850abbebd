from .guard import Ticket

class Guard:
    """The one-thread guard of a world, compiled (see meshcomm.api.guard.WorldGuard)."""

    def enter(self, op: str, who: str) -> Ticket: ...
    def leave(self, ticket: Ticket, op: str, who: str, ok: bool) -> None: ...
