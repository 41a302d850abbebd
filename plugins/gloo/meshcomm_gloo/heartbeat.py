"""Signs of life in the rendezvous store while a process group connects, to name a silent member.

gloo's mesh connection never says which member it is waiting for, and ``/proc``
(:mod:`.liveness`) shows only the members on this host. So while meshcomm waits for gloo
(:mod:`.meshwait`), a member that has waited :data:`BEGIN` seconds counts up a key of its own
in the store every :data:`EVERY` seconds (gloo's rendezvous runs on a connection of its own,
:func:`.rendezvous.connect`, so the store's usual one is free). The members whose count did not
move during the last :data:`WINDOW` seconds before meshcomm gives up are the ones named: dead,
stopped or cut off, wherever they run. A connection that ends within :data:`BEGIN` seconds
writes nothing.
"""

from __future__ import annotations

from typing import Any

from .errors import StoreAuthError
from .liveness import RankProcess, member

__all__ = ["Heartbeat", "BEGIN", "EVERY", "WINDOW"]

#: seconds of waiting before a member starts to give signs of life
BEGIN = 0.5
#: seconds between two signs of one member
EVERY = 0.25
#: seconds over which a member that gives no sign is called silent
WINDOW = 1.0


class Heartbeat:
    """This member's signs of life while group ``prefix`` connects, and the members that gave none.

    ``store`` is the rendezvous store (an :class:`.authstore.AuthStore`: signs are sealed like
    every other value, so no stranger can make a dead member look alive) on a connection that
    gloo is not using; ``rank`` is this member's group rank, ``members[i]`` the world rank of
    group rank ``i`` and ``peers`` every world rank's process (for the names in messages).
    """

    def __init__(self, store: Any, prefix: str, rank: int, members: list[int], peers: list[RankProcess]) -> None:
        self._store = store
        self._prefix, self._rank, self._members, self._peers = prefix, rank, members, peers
        self._broken = False
        self._count = 0
        self._last = float("-inf")
        self._seen: dict[int, bytes | None] | None = None

    def _key(self, i: int) -> str:
        return f"{self._prefix}/meshcomm-beat/{i}"

    def beat(self, now: float) -> None:
        """Give a sign of life if one is due."""
        if self._broken or now - self._last < EVERY:
            return
        try:
            self._count += 1
            self._store.set(self._key(self._rank), str(self._count))
        except Exception:  # noqa: BLE001 - a store that cannot be reached names nobody
            self._broken = True
            return
        self._last = now

    def _read(self) -> dict[int, bytes | None] | None:
        """Every other member's last sign (None: none yet, or one that failed the seal)."""
        got: dict[int, bytes | None] = {}
        for i in range(len(self._members)):
            if i == self._rank:
                continue
            key = self._key(i)
            try:
                got[i] = bytes(self._store.get(key)) if self._store.check([key]) else None
            except StoreAuthError:  # written without the job secret: no sign of that member
                got[i] = None
            except Exception:  # noqa: BLE001 - see beat()
                return None
        return got

    def mark(self) -> bool:
        """Note every member's sign now; False when that cannot be done (then :meth:`silent` names none)."""
        if self._broken or not self._count:
            return False
        self._seen = self._read()
        return self._seen is not None

    def silent(self) -> list[tuple[int, str]]:
        """(group rank, description) of the members whose sign did not change since :meth:`mark`."""
        if self._seen is None or self._broken:
            return []
        now = self._read()
        if now is None:
            return []
        return [
            (
                i,
                f"{member(i, self._members, self._peers)} gave no sign of life in the rendezvous store "
                f"for {WINDOW:g} s while the others waited (it died, stopped, or lost its network)",
            )
            for i, sign in now.items()
            if sign is None or sign == self._seen.get(i)
        ]
