"""The one table of meshcomm's operations: names, stable codes, and what each needs.

Every part of the core that lists operations reads it from here: the cross-rank call
checks (:mod:`meshcomm.api.debug`) put :attr:`Operation.code` in their fingerprints, the
reductions a backend may be asked for are :data:`REDUCTIONS`, the benchmarks' and the
trace summary's bus bandwidth is :func:`bus_factor` of :attr:`Operation.traffic`, and a
transport that tags its frames with an operation code should use :func:`wire_names`
(index = code), whose first ten entries are the codes the sockets wire protocol has always used.

Adding an operation touches: this table (a new, never reused code), the ``Group`` method
and the function in :mod:`meshcomm.api.ops` (exported from ``meshcomm``), a default in
:class:`meshcomm.protocol.backend.Backend` built from point-to-point messages (:mod:`meshcomm.protocol.algorithms`)
when a backend may do it natively, and a conformance check in :mod:`meshcomm.testing.contract`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Operation", "OPERATIONS", "REDUCTIONS", "get", "by_code", "wire_names", "names", "bus_factor"]

#: reductions a backend may be asked for (``all_reduce``, ``reduce_scatter``, ``reduce``)
REDUCTIONS: tuple[str, ...] = ("sum", "max", "min")


@dataclass(frozen=True)
class Operation:
    """One operation of the public API."""

    #: the public name (``mc.<name>``, ``Group.<name>``)
    name: str
    #: a small integer naming the operation on the wire and in call checks; never reused
    code: int
    #: "collective" (every rank of the group), "p2p" (two ranks), "object" (pickled
    #: Python objects, built by the core from array collectives) or "group" (split)
    kind: str
    #: how much each rank's link carries per byte of the operation's size, as nccl-tests
    #: counts it (:func:`bus_factor`): "reduce" 2(n-1)/n, "share" (n-1)/n, "whole" 1,
    #: "none" 0 (bandwidth means nothing: barrier, split, the object collectives)
    traffic: str
    #: takes a ``root`` (broadcast, gather, scatter, reduce, broadcast_object)
    rooted: bool = False
    #: the reduction it applies (all_sum: "sum"); "any" when the caller chooses (reduce)
    reduction: str | None = None


OPERATIONS: tuple[Operation, ...] = (
    # codes 1-9: the sockets wire protocol's op codes since protocol 1 (keep them)
    Operation("all_sum", 1, "collective", "reduce", reduction="sum"),
    Operation("all_max", 2, "collective", "reduce", reduction="max"),
    Operation("all_min", 3, "collective", "reduce", reduction="min"),
    Operation("all_gather", 4, "collective", "share"),
    Operation("sum_scatter", 5, "collective", "share", reduction="sum"),
    Operation("broadcast", 6, "collective", "whole", rooted=True),
    Operation("send", 7, "p2p", "whole"),
    Operation("barrier", 8, "collective", "none"),
    Operation("split", 9, "group", "none"),
    # added later: new codes only
    Operation("recv", 10, "p2p", "whole"),
    Operation("all_to_all", 11, "collective", "share"),
    Operation("gather", 12, "collective", "share", rooted=True),
    Operation("scatter", 13, "collective", "share", rooted=True),
    Operation("reduce", 14, "collective", "whole", rooted=True, reduction="any"),
    Operation("all_gather_object", 15, "object", "none"),
    Operation("broadcast_object", 16, "object", "none", rooted=True),
    # a start of a persistent all-reduce (Group.all_reduce_init), checked as its own call:
    # a backend may run it as an MPI persistent collective, which MPI matches only with its kind
    Operation("all_reduce_init", 17, "collective", "reduce", reduction="any"),
)

_BY_NAME = {o.name: o for o in OPERATIONS}
_BY_CODE = {o.code: o for o in OPERATIONS}
assert len(_BY_NAME) == len(OPERATIONS) and len(_BY_CODE) == len(OPERATIONS), "duplicate operation"


def get(name: str) -> Operation:
    """The operation called ``name``; ValueError listing the known ones otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown operation {name!r}; known: {', '.join(_BY_NAME)}") from None


def by_code(code: int) -> Operation | None:
    """The operation with ``code``, or None (a code from another version or not a call)."""
    return _BY_CODE.get(int(code))


def names() -> tuple[str, ...]:
    """Every operation's name, in code order."""
    return tuple(o.name for o in OPERATIONS)


def wire_names() -> tuple[str, ...]:
    """Names indexed by code, ``"?"`` at 0 and at unused codes (a transport's opcode table)."""
    top = max(_BY_CODE)
    return tuple(_BY_CODE[c].name if c in _BY_CODE else "?" for c in range(top + 1))


def bus_factor(op: str, n: int) -> float:
    """Bus bandwidth over algorithm bandwidth of ``op`` on ``n`` ranks, as nccl-tests defines
    it (algbw = the operation's size in bytes / time; for ``all_gather`` and ``gather`` the
    size is the gathered result), from the operation's :attr:`Operation.traffic`. ``op`` is a
    name of the table or a pairing of its point-to-point operations (``sendrecv``, the
    benchmark's exchange; ``send/recv``, a matched pair in a trace). Used by ``meshcomm
    bench`` and ``meshcomm trace summary``."""
    if n < 1:
        raise ValueError(f"rank count must be >= 1, got {n}")
    traffic = get(_P2P_PAIRS.get(op, op)).traffic
    return _TRAFFIC[traffic](n)


#: pairings of point-to-point operations that benchmarks and traces name as one
_P2P_PAIRS = {"sendrecv": "send", "send/recv": "send"}
#: bus bandwidth over algorithm bandwidth for each kind of :attr:`Operation.traffic`
_TRAFFIC = {
    "reduce": lambda n: 2 * (n - 1) / n,
    "share": lambda n: (n - 1) / n,
    "whole": lambda n: 1.0,
    "none": lambda n: 0.0,
}
assert {o.traffic for o in OPERATIONS} <= set(_TRAFFIC), "an operation with an unknown traffic"
