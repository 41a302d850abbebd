"""What a rank is doing: the description of one operation in flight, and its sequence numbers.

Every communicator (the world and each split) counts its operations: collectives in
one sequence shared by all members (every member calls them in the same order), and
point-to-point messages per peer and direction (the k-th send to rank d matches d's k-th
receive from this rank). From those numbers alone a rank can tell whether a peer has
reached the operation it waits in, given the peer's own counts (from an answer to a
query, or from the peer's exit notice).
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Counts", "Desc"]


class Counts(NamedTuple):
    """A peer's counts on one communicator, as seen from the asking rank."""

    coll: int  #: collectives the peer entered on the communicator
    sent: int  #: messages the peer sent to the asking rank
    recvd: int  #: messages the peer received from the asking rank


class Desc:
    """One operation in flight on one communicator (built only when a wait is slow).

    Args:
        backend: the MPIBackend (gives communicator id, label, members and counters).
        what: ``("coll", name)``, ``("send", dst)``, ``("recv", src)`` or
            ``("sendrecv", dst, src)`` with group-local ranks.
    """

    __slots__ = (
        "cid",
        "label",
        "kind",
        "name",
        "seq",
        "dst",
        "src",
        "send_k",
        "recv_k",
        "members",
        "local",
        "me",
        "me_world",
        "shown",
    )

    def __init__(self, backend: Any, what: tuple[Any, ...]) -> None:
        self.cid: str = backend.cid
        self.label: str = backend.label
        self.members: list[int] = backend.members
        self.local: dict[int, int] = backend.local_of
        self.me: int = backend.rank()
        self.me_world: int = self.members[self.me]
        self.kind: str = what[0]
        self.dst: int | None = None
        self.src: int | None = None
        self.send_k = self.recv_k = 0
        self.seq = backend.coll_count
        #: a collective as the user called it (Backend.call_text): the communicator's own
        #: count (``seq``, compared across ranks) also counts meshcomm's internal calls
        self.shown: str | None = None
        if self.kind == "coll":
            self.name: str = what[1]
            if backend.user_op:
                self.shown = backend.call_text(self.name)
        elif self.kind == "send":
            self.name, self.dst = "send", what[1]
            self.send_k = backend.sent[what[1]]
        elif self.kind == "recv":
            self.name, self.src = "recv", what[1]
            self.recv_k = backend.recvd[what[1]]
        else:
            self.name, self.dst, self.src = "sendrecv", what[1], what[2]
            self.send_k, self.recv_k = backend.sent[what[1]], backend.recvd[what[2]]

    def who(self, local: int) -> str:
        """``rank 2`` in the world, ``rank 1 (world rank 3)`` in a split."""
        w = self.members[local]
        return f"rank {local}" if w == local and self.cid == "world" else f"rank {local} (world rank {w})"

    @property
    def text(self) -> str:
        """``all_sum #6``, ``send #2 to rank 1``, ``recv #1 from rank 0``."""
        if self.kind == "coll":
            return self.shown or f"{self.name} #{self.seq}"
        if self.kind == "send":
            return f"send #{self.send_k} to rank {self.dst}"
        if self.kind == "recv":
            return f"recv #{self.recv_k} from rank {self.src}"
        return f"sendrecv (send #{self.send_k} to rank {self.dst}, recv #{self.recv_k} from rank {self.src})"

    @property
    def where(self) -> str:
        return f"{self.text} on {self.label}"

    def asked(self) -> list[int]:
        """World ranks of the peers this operation needs."""
        if self.kind == "coll":
            return [w for q, w in enumerate(self.members) if q != self.me]
        peers = [p for p in (self.dst, self.src) if p is not None]
        return [self.members[p] for p in dict.fromkeys(peers)]

    def joined(self, world_peer: int, c: Counts) -> bool:
        """Has the peer reached (or passed) its part of this operation, judging by its counts?"""
        q = self.local.get(world_peer)
        if q is None:
            return True
        if self.kind == "coll":
            return c.coll >= self.seq
        ok = True
        if q == self.dst:
            ok = ok and c.recvd >= self.send_k
        if q == self.src:
            ok = ok and c.sent >= self.recv_k
        return ok

    def public(self) -> dict[str, Any]:
        """What a peer is told about this operation (picklable)."""
        return {
            "cid": self.cid,
            "label": self.label,
            "text": self.text,
            "kind": self.kind,
            "name": self.name,
            "seq": self.seq,
        }
