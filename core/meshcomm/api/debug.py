"""Cross-rank call checks (``MLX_DEBUG=1``): compare op, shape and dtype before the payload.

Collectives all-gather a small fixed-size fingerprint, so every rank sees every rank's
call and raises the same error. Point-to-point messages exchange fingerprints with the
peer first. Fingerprints are the same size for both, so a send met by a collective
is detected too instead of corrupting either.
"""

from __future__ import annotations

import functools
import zlib
from typing import TYPE_CHECKING

import numpy as np

from ..protocol import operations
from ..protocol.dtypes import dtype_code, dtype_from_code
from ..protocol.errors import CallsDiffer, CollectiveMismatchError
from ..protocol.operations import REDUCTIONS

if TYPE_CHECKING:
    from ..protocol.backend import Backend

__all__ = ["check_collective", "quick_check", "call_key", "name_mismatch", "check_send", "check_recv"]

_MAGIC = 0x6D657368  # "mesh"
#: slots: magic, op, dtype, ndim, arg, crc of the shape, 6 dims, then the user's call number
#: (named in messages, never compared: the ranks' calls are compared by what they are)
_WIDTH = 13
_DIMS = 6
_NUMBER = 12
#: the op slot holds the operation's code plus (reduction index + 1) << 8 for ``reduce``
_VARIANT = 256


def _opword(op: str, reduction: str | None) -> int:
    code = operations.get(op).code
    return code if reduction is None else code + _VARIANT * (REDUCTIONS.index(reduction) + 1)


def _fingerprint(
    op: str, shape: tuple[int, ...], dtype: np.dtype | None, arg: int, reduction: str | None = None, number: int = 0
) -> np.ndarray:
    fp = np.zeros(_WIDTH, dtype=np.int64)
    dims = list(shape)[:_DIMS]
    fp[:6] = [
        _MAGIC,
        _opword(op, reduction),
        0 if dtype is None else dtype_code(dtype),
        len(shape),
        arg,
        zlib.crc32(repr(tuple(shape)).encode()),
    ]
    fp[6 : 6 + len(dims)] = dims
    fp[_NUMBER] = number
    return fp


def _number(b: Backend) -> int:
    """The user's call in flight on ``b`` (0: none), for the fingerprint's number slot."""
    return b.user_no if b.user_op else 0


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two fingerprints are the same call (whatever their numbers)."""
    return bool((a[..., :_NUMBER] == b[..., :_NUMBER]).all())


def _describe(fp: np.ndarray) -> str:
    word = int(fp[1])
    spec = operations.by_code(word % _VARIANT) if word >= 0 else None
    variant = word // _VARIANT
    if int(fp[0]) != _MAGIC or spec is None or variant > len(REDUCTIONS):
        return "something that is not a meshcomm call (a message of another kind)"
    op = spec.name
    if int(fp[_NUMBER]) > 0:  # "all_sum #2 (shape=...)", "barrier #3"
        op = f"{op} #{int(fp[_NUMBER])}"
        if spec.name in ("barrier", "split") or (spec.kind == "object" and not spec.rooted):
            return op
        op += " "
    if spec.name in ("barrier", "split"):
        return f"{op}()"
    if spec.kind == "object":
        return f"{op}({'root=' + str(int(fp[4])) if spec.rooted else ''})"
    ndim = int(fp[3])
    shape = tuple(int(d) for d in fp[6 : 6 + min(ndim, _DIMS)])
    shown = str(shape) if ndim <= _DIMS else f"{ndim}-d shape starting {shape}"
    dt = dtype_from_code(int(fp[2]))
    extra = (
        f", root={int(fp[4])}"
        if spec.rooted
        else {"send": f", dst={int(fp[4])}", "recv": f", src={int(fp[4])}"}.get(op, "")
    )
    if variant:
        extra += f", op={REDUCTIONS[variant - 1]!r}"
    return f"{op}(shape={shown}, dtype={dt}{extra})"


def check_collective(
    b: Backend,
    group_name: str,
    op: str,
    shape: tuple[int, ...],
    dtype: np.dtype | None,
    arg: int = 0,
    *,
    label: str = "MLX_DEBUG: ",
    reduction: str | None = None,
) -> None:
    """All-gather this call's fingerprint; raise the same error on every rank on a mismatch.

    ``op`` is a name from :mod:`meshcomm.protocol.operations`; ``reduction`` the one ``reduce`` applies.
    """
    n = b.size()
    mine = _fingerprint(op, shape, dtype, arg, reduction, _number(b))
    table = np.empty(n * _WIDTH, dtype=np.int64).reshape(n, _WIDTH)
    b.all_gather(mine, table.reshape(-1))
    if _same(table, table[0]):
        return
    calls: dict[str, list[int]] = {}
    for q in range(n):
        calls.setdefault(_describe(table[q]), []).append(q)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} called {d}" for d, rs in calls.items()]
    raise CollectiveMismatchError(
        f"{label}ranks of {group_name} (size {n}) disagree on the call: "
        + "; ".join(parts)
        + ". Every rank must make the same collective calls in the same order with the same shapes, "
        "dtypes and roots."
    )


@functools.lru_cache(maxsize=256)
def _call_hash(op: str, dtype: np.dtype | None, shape: tuple[int, ...], arg: int, reduction: str | None) -> np.ndarray:
    """[h, -h] for a 32-bit hash h of the call (remembered: a loop repeats the same calls;
    read-only, as every caller shares it)."""
    h = zlib.crc32(repr((op, None if dtype is None else dtype.str, shape, arg, reduction)).encode())
    mine = np.array([h, -h], dtype=np.int64)
    mine.flags.writeable = False
    return mine


def quick_check(
    b: Backend,
    group_name: str,
    op: str,
    shape: tuple[int, ...],
    dtype: np.dtype | None,
    arg: int = 0,
    *,
    reduction: str | None = None,
) -> None:
    """The default call check: one all-reduce (max) of a 32-bit hash of the call and its negation.

    Every rank made the same call exactly when max(h) == min(h); then nothing more is sent.
    Otherwise every rank sees the same result and runs :func:`check_collective`, which
    names what each rank called.
    """
    mine = _call_hash(op, dtype, shape, arg, reduction)
    both = np.empty(2, dtype=np.int64)
    b.check_key(mine, both)
    if both[0] == -both[1]:
        return
    check_collective(b, group_name, op, shape, dtype, arg, label="", reduction=reduction)
    raise _calls_differ(b, group_name, op, "their call checks differ")


def _calls_differ(b: Backend, group_name: str, op: str, why: str) -> CollectiveMismatchError:
    """The mismatch error when the calls' keys differ but their fingerprints name no difference."""
    return CollectiveMismatchError(
        f"ranks of {group_name} (size {b.size()}) disagree on the call {op}: {why}. Every rank must make "
        "the same collective calls in the same order with the same shapes, dtypes and roots."
    )


def call_key(
    op: str, shape: tuple[int, ...], dtype: np.dtype | None, arg: int = 0, *, reduction: str | None = None
) -> np.ndarray:
    """The call check's key for a backend that carries it with the data (``Backend.call_key``):
    the same [h, -h] :func:`quick_check` reduces, read-only."""
    return _call_hash(op, dtype, shape, arg, reduction)


def name_mismatch(
    b: Backend,
    exc: CallsDiffer,
    group_name: str,
    op: str,
    shape: tuple[int, ...],
    dtype: np.dtype | None,
    arg: int = 0,
    *,
    reduction: str | None = None,
) -> CollectiveMismatchError:
    """The error for a carried call check that failed on ``b``: every rank's call, compared over
    the backend's ``exc.details`` (the ranks are there together: they all saw the keys differ)."""
    details = exc.details
    if details is not None:
        details.user_op, details.user_no = b.user_op, b.user_no
        try:
            check_collective(details, group_name, op, shape, dtype, arg, label="", reduction=reduction)
        except CollectiveMismatchError as named:
            return named
    return _calls_differ(b, group_name, op, str(exc))


def check_send(b: Backend, group_name: str, shape: tuple[int, ...], dtype: np.dtype, dst: int) -> None:
    """Send this call's fingerprint to ``dst`` and compare the one it answers with."""
    _check_pair(b, group_name, shape, dtype, dst, "send", "recv")


def check_recv(b: Backend, group_name: str, shape: tuple[int, ...], dtype: np.dtype, src: int) -> None:
    """Receive the sender's fingerprint, answer with ours, and compare."""
    _check_pair(b, group_name, shape, dtype, src, "recv", "send")


def _check_pair(
    b: Backend, group_name: str, shape: tuple[int, ...], dtype: np.dtype, peer: int, mine_op: str, their_op: str
) -> None:
    """Exchange fingerprints with ``peer``: this rank's ``mine_op`` must meet its ``their_op``
    of the same shape and dtype."""
    mine = _fingerprint(mine_op, shape, dtype, peer, None, _number(b))
    theirs = np.empty(_WIDTH, dtype=np.int64)
    b.sendrecv(mine, peer, theirs, peer)
    expected = _fingerprint(their_op, shape, dtype, b.rank())
    if not _same(theirs, expected):
        raise CollectiveMismatchError(
            f"MLX_DEBUG: in {group_name}, rank {b.rank()} called {_describe(mine)} but rank {peer} "
            f"called {_describe(theirs)}. Match every send with a recv of the same shape and dtype."
        )
