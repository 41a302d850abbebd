"""Small all-reduces on the call check's channel: which calls go there, and the reduction.

A ProcessGroupGloo work item costs a few hundred microseconds however small its data (a
hand-off to gloo's threads and back on every rank), several times a round of the group's
own check channel (:mod:`.checkline`). So an all-reduce whose blocks from every rank fit
in :data:`~.checkline.BLOCKS_MAX` travels with its call check there: each rank collects
every rank's block and reduces them itself, in rank order, so every rank computes the same
operations on the same values and gets the same bits (ties of max/min, NaNs, signed zeros).
"""

from __future__ import annotations

import zlib

import numpy as np

from .checkline import BLOCKS_MAX

__all__ = ["on_line", "line_key", "reduce_rows"]

_UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum}
#: added to the call's hash: a rank reducing on the channel never meets one that checks
#: the same call there and then runs it in gloo (their settings differ) as "the same call"
_ON_LINE = 1 << 40


def on_line(buf: np.ndarray, op: str, size: int) -> bool:
    """True when ``buf``'s all-reduce (``op``) over ``size`` ranks runs on the channel:
    every rank's block fits in BLOCKS_MAX and NumPy reduces the dtype as meshcomm defines
    it (bool sums are logical or; integer sums wrap; complex numbers only sum)."""
    kind = buf.dtype.kind
    return (
        size * buf.nbytes <= BLOCKS_MAX
        and (kind in "biuf" or (kind == "c" and op == "sum"))
        and buf.dtype.isnative
        and buf.flags.c_contiguous
    )


def line_key(key: np.ndarray | None, buf: np.ndarray, op: str) -> np.ndarray:
    """The key this rank sends: the core's call key (int64 [h, -h]), or for a call the core
    did not key (its own calls, or checks turned off) one of op, dtype and size; marked as
    an all-reduce on the channel."""
    if key is None:
        h = zlib.crc32(f"all_{op} {buf.dtype.str} {buf.nbytes}".encode())
    else:
        h = int(key[0])
    h += _ON_LINE
    return np.array([h, -h], np.int64)


def reduce_rows(table: np.ndarray, dtype: np.dtype, op: str, rank: int, out: np.ndarray) -> None:
    """``out`` = the reduction with ``op`` of the rows of ``table`` (row ``j`` is rank
    ``(rank - j) % size``'s block, as :meth:`~.checkline.CheckLine.gather` leaves it), taken
    in the order rank 0, 1, 2, ... on every rank."""
    size = table.shape[0]
    rows = table.view(dtype)
    ufunc = _UFUNCS[op]
    direct = out.flags.c_contiguous
    flat = out.reshape(-1) if direct else np.empty(out.size, dtype)
    with np.errstate(all="ignore"):  # inf - inf, integer wrap: results as gloo's, without warnings
        ufunc(rows[rank % size], rows[(rank - 1) % size], out=flat)
        for q in range(2, size):
            ufunc(flat, rows[(rank - q) % size], out=flat)
    if not direct:
        out[...] = flat.reshape(out.shape)
