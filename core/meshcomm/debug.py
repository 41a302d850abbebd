"""Cross-rank call checks (``MLX_DEBUG=1``): compare op, shape and dtype before the payload.

Collectives all-gather a small fixed-size fingerprint, so every rank sees every rank's
call and raises the same error. Point-to-point messages exchange fingerprints with the
peer first. Fingerprints are the same size for both, so a send met by a collective
is detected too instead of corrupting either.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

from .dtypes import dtype_code, dtype_from_code
from .errors import CollectiveMismatchError

if TYPE_CHECKING:
    from .backend import Backend

__all__ = ["check_collective", "quick_check", "check_send", "check_recv", "OPS"]

_MAGIC = 0x6D657368  # "mesh"
OPS = ("all_sum", "all_max", "all_min", "all_gather", "sum_scatter", "broadcast", "send",
       "recv", "barrier", "split")
_WIDTH = 12
_DIMS = 6


def _fingerprint(op: str, shape: tuple[int, ...], dtype: np.dtype | None, arg: int) -> np.ndarray:
    fp = np.zeros(_WIDTH, dtype=np.int64)
    dims = list(shape)[:_DIMS]
    fp[:6] = [_MAGIC, OPS.index(op), 0 if dtype is None else dtype_code(dtype), len(shape), arg,
              zlib.crc32(repr(tuple(shape)).encode())]
    fp[6 : 6 + len(dims)] = dims
    return fp


def _describe(fp: np.ndarray) -> str:
    if int(fp[0]) != _MAGIC or not 0 <= int(fp[1]) < len(OPS):
        return "something that is not a meshcomm call (a message of another kind)"
    op = OPS[int(fp[1])]
    if op in ("barrier", "split"):
        return f"{op}()"
    ndim = int(fp[3])
    shape = tuple(int(d) for d in fp[6 : 6 + min(ndim, _DIMS)])
    shown = str(shape) if ndim <= _DIMS else f"{ndim}-d shape starting {shape}"
    dt = dtype_from_code(int(fp[2]))
    extra = {"broadcast": f", root={int(fp[4])}", "send": f", dst={int(fp[4])}",
             "recv": f", src={int(fp[4])}"}.get(op, "")
    return f"{op}(shape={shown}, dtype={dt}{extra})"


def check_collective(
    b: Backend, group_name: str, op: str, shape: tuple[int, ...], dtype: np.dtype | None, arg: int = 0,
    *, label: str = "MLX_DEBUG: ",
) -> None:
    """All-gather this call's fingerprint; raise the same error on every rank on a mismatch."""
    n = b.size()
    mine = _fingerprint(op, shape, dtype, arg)
    table = np.empty(n * _WIDTH, dtype=np.int64).reshape(n, _WIDTH)
    b.all_gather(mine, table.reshape(-1))
    if (table == table[0]).all():
        return
    calls: dict[str, list[int]] = {}
    for q in range(n):
        calls.setdefault(_describe(table[q]), []).append(q)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} called {d}" for d, rs in calls.items()]
    raise CollectiveMismatchError(
        f"{label}ranks of {group_name} (size {n}) disagree on the call: " + "; ".join(parts)
        + ". Every rank must make the same collective calls in the same order with the same shapes, "
        "dtypes and roots."
    )


def quick_check(
    b: Backend, group_name: str, op: str, shape: tuple[int, ...], dtype: np.dtype | None, arg: int = 0
) -> None:
    """The default call check: one all-reduce (max) of a 32-bit hash of the call and its negation.

    Every rank made the same call exactly when max(h) == min(h); then nothing more is sent.
    Otherwise every rank sees the same result and runs :func:`check_collective`, which
    names what each rank called.
    """
    h = zlib.crc32(repr((op, None if dtype is None else dtype.str, shape, arg)).encode())
    mine = np.array([h, -h], dtype=np.int64)
    both = np.empty(2, dtype=np.int64)
    b.all_reduce(mine, both, "max")
    if both[0] == -both[1]:
        return
    check_collective(b, group_name, op, shape, dtype, arg, label="")
    raise CollectiveMismatchError(
        f"ranks of {group_name} (size {b.size()}) disagree on the call {op}: their call checks "
        "differ. Every rank must make the same collective calls in the same order with the same "
        "shapes, dtypes and roots."
    )


def check_send(b: Backend, group_name: str, shape: tuple[int, ...], dtype: np.dtype, dst: int) -> None:
    """Send this call's fingerprint to ``dst`` and compare the one it answers with."""
    mine = _fingerprint("send", shape, dtype, dst)
    theirs = np.empty(_WIDTH, dtype=np.int64)
    b.sendrecv(mine, dst, theirs, dst)
    expected = _fingerprint("recv", shape, dtype, b.rank())
    if not np.array_equal(theirs, expected):
        raise CollectiveMismatchError(
            f"MLX_DEBUG: in {group_name}, rank {b.rank()} called {_describe(mine)} but rank {dst} "
            f"called {_describe(theirs)}. Match every send with a recv of the same shape and dtype."
        )


def check_recv(b: Backend, group_name: str, shape: tuple[int, ...], dtype: np.dtype, src: int) -> None:
    """Receive the sender's fingerprint, answer with ours, and compare."""
    mine = _fingerprint("recv", shape, dtype, src)
    theirs = np.empty(_WIDTH, dtype=np.int64)
    b.sendrecv(mine, src, theirs, src)
    expected = _fingerprint("send", shape, dtype, b.rank())
    if not np.array_equal(theirs, expected):
        raise CollectiveMismatchError(
            f"MLX_DEBUG: in {group_name}, rank {b.rank()} called {_describe(mine)} but rank {src} "
            f"called {_describe(theirs)}. Match every send with a recv of the same shape and dtype."
        )
