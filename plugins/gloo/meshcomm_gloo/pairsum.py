"""The all-reduce of a two-rank group with no copy of the input.

torch's process group reduces only in place, so the new array ``all_sum(x)`` returns
costs a copy of ``x`` before gloo's own all-reduce (16 MiB: a 2.1-2.6 ms copy in a call of
about 20 ms on a 2-core machine). Two ranks need neither the copy nor a ring: each sends
the other the half of its input that the other owns, adds the half it receives to its own
half straight into the result, and sends that sum back. The halves travel in segments, so
adding one segment overlaps the transfer of the next. The result may be the input itself
(``out=x``), and must be allowed to: each rank chooses this path from what every rank
shares (group size, dtype, op, size), never from its own ``out=``, so that ranks that
differ in ``out=`` still meet.

A reduce-scatter (``sum_scatter``) of two ranks is the first half of that: each rank's
block is the half it owns, so the sums are not sent back.

Used where NumPy's reduction on the wire dtype is the one gloo would do bit for bit
(integers, float32 and float64; see :func:`exact`); the two ranks' results are the same
bits, as each half is reduced once, by its owner.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .calls import MAX_SEGMENTS, call_code, pair_tag
from .codecs import Plan
from .tensors import tensor

__all__ = ["MIN_BYTES", "SEGMENT_BYTES", "exact", "fits", "pair_reduce"]

#: from this size on a two-rank all-reduce exchanges halves (below it, gloo's all-reduce of
#: a copy measured as fast or faster: the copy is cheap there)
MIN_BYTES = 8 << 20
#: the unit of transfer and addition; each is one gloo send/recv pair
SEGMENT_BYTES = 2 << 20

_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}
#: wire dtypes whose NumPy reduction is gloo's (float16/bfloat16 round through float32)
_EXACT = frozenset(np.dtype(t) for t in ("int8", "uint8", "int32", "int64", "float32", "float64"))


def exact(size: int, plan: Plan) -> bool:
    """Whether a reduction by ``plan`` on ``size`` ranks can run here, bit for bit as gloo's."""
    return size == 2 and plan.codec is None and not plan.generic and plan.wire in _EXACT


def fits(size: int, nbytes: int, plan: Plan) -> bool:
    """Whether an all-reduce of ``nbytes`` (into a new result or in place) goes through :func:`pair_reduce`."""
    return nbytes >= MIN_BYTES and exact(size, plan)


def pair_reduce(pg: Any, rank: int, x: np.ndarray, out: np.ndarray, op: str, *, scatter: bool = False) -> None:
    """Reduce 1-D ``x`` (this rank's) with the peer's into ``out`` over ``pg``'s send/recv.

    Rank 0 owns the first half, rank 1 the second; with ``scatter`` ``out`` is only this
    rank's half (a reduce-scatter). ``out`` may be ``x`` (in place): the peer's sums land on
    a segment of this rank's input only after the peer has received that whole segment.
    Every receive is posted before any wait, so neither rank's sends can block the other's;
    gloo's errors (a lost peer, the group's timeout) come out of the waits as torch's
    RuntimeError. Tags carry a code of the call's size, dtype and op (:func:`.calls.pair_tag`),
    so ranks whose calls differ (call checks turned off) wait for the timeout instead of
    pairing their segments."""
    peer = 1 - rank
    n = x.size
    half = n // 2
    mine, theirs = ((0, half), (half, n)) if rank == 0 else ((half, n), (0, half))
    base = mine[0] if scatter else 0  # the index of x that out[0] stands for
    # at most MAX_SEGMENTS per half: the segment's number has that many tags
    per = max(
        1,
        SEGMENT_BYTES // x.itemsize,
        -(-(mine[1] - mine[0]) // MAX_SEGMENTS),
        -(-(theirs[1] - theirs[0]) // MAX_SEGMENTS),
    )
    call = call_code(x.dtype, n, op, scatter)

    def segments(span: tuple[int, int]) -> list[tuple[int, int]]:
        return [(lo, min(lo + per, span[1])) for lo in range(span[0], span[1], per)]

    tmp = np.empty(mine[1] - mine[0], x.dtype)
    reduce = _REDUCE[op]
    incoming = []
    for j, (lo, hi) in enumerate(segments(mine)):
        part = tmp[lo - mine[0] : hi - mine[0]]
        incoming.append((pg.recv([tensor(part)], peer, pair_tag(0, j, call)), lo, hi, part))
    owed = segments(theirs)
    results = (
        []
        if scatter
        else [pg.recv([tensor(out[lo:hi])], peer, pair_tag(1, j, call)) for j, (lo, hi) in enumerate(owed)]
    )
    sends = [pg.send([tensor(x[lo:hi])], peer, pair_tag(0, j, call)) for j, (lo, hi) in enumerate(owed)]
    for j, (work, lo, hi, part) in enumerate(incoming):
        work.wait()
        with np.errstate(all="ignore"):  # inf - inf: NaN as gloo gives it, without NumPy's warning
            reduce(x[lo:hi], part, out=out[lo - base : hi - base])
        if not scatter:
            sends.append(pg.send([tensor(out[lo:hi])], peer, pair_tag(1, j, call)))
    for work in results:
        work.wait()
    for work in sends:
        work.wait()
