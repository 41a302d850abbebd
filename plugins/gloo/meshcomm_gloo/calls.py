"""What each rank is calling, so a gloo failure can be explained as a mismatch.

gloo itself never compares calls: a send met by a recv of another size is silently
truncated or aborts the process (``gloo::EnforceNotMet``), and a collective met by a
send just waits. Two things here prevent that:

* **Point-to-point tags carry the dtype and element count** (:func:`p2p_tag`). A send
  and a recv that disagree use different gloo slots, so gloo never matches them (no
  abort, no wrong data); both sides wait until MLX_TIMEOUT. Counts of ``BIG`` elements
  or more do not fit in the tag: such a message is preceded by a 16-byte header (dtype,
  count) that the receiver checks before posting the payload receive.
* **Every operation has a :class:`Call` descriptor.** When an operation fails, the rank
  publishes its descriptor in the rendezvous store and reads the others' (see
  :mod:`.records`); :func:`conflicts` says which ranks called something that cannot
  meet this rank's call, which turns a timeout into a CollectiveMismatchError.

Pure Python + NumPy (no torch), so it is testable without processes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from meshcomm.plugin import dtype_code

__all__ = ["Call", "BIG", "MAX_SEGMENTS", "p2p_tag", "pair_tag", "call_code", "conflicts", "dtype_code"]

#: element counts from here on travel with a header instead of in the tag
BIG = 1 << 25


def p2p_tag(dtype: np.dtype, count: int, part: int = 0) -> int:
    """The gloo tag of a message of ``count`` elements of ``dtype`` (31 bits, never negative).

    ``code`` is meshcomm's wire code of the dtype (1..15, five bits). Below :data:`BIG`:
    ``code << 25 | count``. From :data:`BIG` on: bit 30 set, ``part`` 0
    for the header and 1 for the payload.
    """
    code = dtype_code(dtype)
    if count < BIG:
        return (code << 25) | count
    return (1 << 30) | (code << 25) | part


#: segments per half of a two-rank all-reduce that :func:`pair_tag` can number
MAX_SEGMENTS = 1 << 12


def call_code(wire: np.dtype, count: int, op: str, scatter: bool) -> int:
    """11 bits of a two-rank all-reduce's wire dtype, element count, op and kind, for :func:`pair_tag`."""
    kind = ("sum", "max", "min").index(op) * 2 + scatter
    return (dtype_code(wire) * 0x9E3779B1 ^ count * 0x85EBCA77 ^ kind * 0xC2B2AE3D) % 2039


def pair_tag(phase: int, segment: int, call: int) -> int:
    """The gloo tag of one segment of a two-rank all-reduce (:mod:`.pairsum`): bit 30 with
    dtype code 0, which no :func:`p2p_tag` uses; ``phase`` 0 carries inputs, 1 sums; ``call``
    (:func:`call_code`) keeps the segments of calls that differ apart."""
    return (1 << 30) | (phase << 23) | (call << 12) | segment


def _name(dtype: Any) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


class Call(NamedTuple):
    """One operation as this rank called it.

    ``kind`` is ``"coll"`` (``seq`` counts this group's collectives), ``"send"``,
    ``"recv"`` or ``"sendrecv"``; ``peer``/``peer2`` are group ranks (send: destination,
    recv: source, sendrecv: destination then source); ``count2``/``dtype2`` describe the
    received half of a sendrecv.
    """

    kind: str
    name: str
    dtype: Any = "-"  # a NumPy dtype on the fast path (its .name is slow); a name once parsed
    count: int = 0  # type: ignore[assignment]  # a field named like tuple.count
    seq: int = 0
    root: int = -1
    peer: int = -1
    peer2: int = -1
    dtype2: Any = "-"
    count2: int = 0
    #: the user's call this is (or is part of), as Backend.call_text names it ("all_sum #2"):
    #: filled in only when a message needs it; not compared across ranks (see conflicts)
    shown: str = ""

    def text(self) -> str:
        """One line that :meth:`parse` reads back (stored in the rendezvous store)."""
        return " ".join(
            str(v)
            for v in (
                self.kind,
                self.name,
                _name(self.dtype),
                self.count,
                self.seq,
                self.root,
                self.peer,
                self.peer2,
                _name(self.dtype2),
                self.count2,
                self.shown,
            )
        )

    @classmethod
    def parse(cls, text: str) -> Call:
        k, name, dt, count, seq, root, peer, peer2, dt2, count2, *shown = text.split(maxsplit=10)
        return cls(
            k,
            name,
            dt,
            int(count),
            int(seq),
            int(root),
            int(peer),
            int(peer2),
            dt2,
            int(count2),
            shown[0].strip() if shown else "",
        )

    def describe(self) -> str:
        """What a user reads: ``all_sum #2 of 4 float32``, ``send #1 of 4 float32 to rank 0``;
        by the group's own count (``all_sum of 4 float32 (collective #3 of the group)``) only
        when the user's call is not known."""
        if self.kind == "coll":
            root = f" from root {self.root}" if self.root >= 0 else ""
            what = f"{self.name} of {self.count} {self.dtype}" if self.count else self.name
            if "(" in self.shown:  # a step inside the user's call: "all_sum #2 (the call check before it)"
                return f"{self.shown[:-1]}: {what}{root})"
            if self.shown:
                return f"{self.shown}{what[len(self.name) :]}{root}"
            check = (
                ", most likely meshcomm's call check before the next collective"
                if self.name == "all_max" and self.count == 2 and _name(self.dtype) == "int64"
                else ""
            )
            return f"{what}{root} (collective #{self.seq} of the group{check})"
        name = self.shown or self.kind
        if self.kind == "send":
            return f"{name} of {self.count} {self.dtype} to rank {self.peer}"
        if self.kind == "recv":
            return f"{name} of {self.count} {self.dtype} from rank {self.peer}"
        return (
            f"{name} ({self.count} {self.dtype} to rank {self.peer}, "
            f"{self.count2} {self.dtype2} from rank {self.peer2})"
        )

    # what this call sends to / expects from a given rank, as (dtype, count), or None
    def _sends_to(self, q: int) -> tuple[str, int] | None:
        if self.kind in ("send", "sendrecv") and self.peer == q:
            return self.dtype, self.count
        return None

    def _recvs_from(self, q: int) -> tuple[str, int] | None:
        if self.kind == "recv" and self.peer == q:
            return self.dtype, self.count
        if self.kind == "sendrecv" and self.peer2 == q:
            return self.dtype2, self.count2
        return None

    def involves(self, q: int) -> bool:
        """Whether this call needs rank ``q`` (every rank for a collective)."""
        return self.kind == "coll" or q in (self.peer, self.peer2)


def conflicts(me: int, mine: Call, q: int, theirs: Call) -> bool:
    """Whether rank ``q``'s call ``theirs`` can never meet rank ``me``'s call ``mine``."""
    if not mine.involves(q):
        return False
    if mine.kind == "coll":
        return theirs[:-1] != mine[:-1]  # all but ``shown``
    if theirs.kind == "coll":
        return True
    want_out, want_in = mine._sends_to(q), mine._recvs_from(q)
    if want_out is not None and theirs._recvs_from(me) != want_out:
        return True
    return want_in is not None and theirs._sends_to(me) != want_in
