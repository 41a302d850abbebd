"""Collectives built from point-to-point messages, for any group size.

These are the defaults of :class:`meshcomm.protocol.backend.Backend`: a transport that only
moves bytes between two ranks gets every collective from here. Large reductions use
the bandwidth-optimal ring (reduce-scatter then all-gather, each rank sends about
``2 (n-1)/n`` of the array); small ones use recursive doubling (``log2 n`` rounds).
Reductions combine operands in a fixed rank order and each result element is computed
on one rank only, so every rank ends with bit-identical bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .dtypes import reducer

__all__ = [
    "PointToPoint",
    "SMALL_BYTES",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all",
    "gather",
    "scatter",
    "reduce",
    "block_bounds",
    "recursive_doubling",
    "ring_reduce_scatter",
    "ring_all_gather",
    "split_members",
    "split_plan",
    "SplitPlan",
    "reduce_scatter_by_all_reduce",
]

#: arrays up to this many bytes use the latency-optimal algorithms
SMALL_BYTES = 64 * 1024


class PointToPoint(Protocol):
    """What the algorithms use of a group: its rank and size, messages between two ranks,
    and (for the few that build on them) its all_gather and all_reduce. Every
    :class:`meshcomm.protocol.backend.Backend` is one; the algorithms need nothing else of it."""

    def rank(self) -> int: ...
    def size(self) -> int: ...
    def send(self, buf: np.ndarray, dst: int) -> None: ...
    def recv(self, buf: np.ndarray, src: int) -> None: ...
    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None: ...
    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None: ...
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None: ...


def block_bounds(length: int, n: int) -> list[int]:
    """Boundaries of ``n`` nearly equal blocks of ``length`` elements (``n + 1`` offsets)."""
    return [(length * i) // n for i in range(n + 1)]


# -- all-reduce ---------------------------------------------------------------------------
def all_reduce(b: PointToPoint, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
    """Reduce ``sendbuf`` over all ranks into ``recvbuf`` (ring for large, doubling for small)."""
    recvbuf[...] = sendbuf
    n = b.size()
    if n == 1 or recvbuf.size == 0:
        return
    if recvbuf.nbytes <= SMALL_BYTES or recvbuf.size < n:
        recursive_doubling(b, recvbuf, op)
    else:
        bounds = block_bounds(recvbuf.size, n)
        ring_reduce_scatter(b, recvbuf, bounds, op, offset=0)
        ring_all_gather(b, recvbuf, bounds, offset=1)


def recursive_doubling(b: PointToPoint, acc: np.ndarray, op: str) -> None:
    """In-place all-reduce in ``ceil(log2 n) + 2`` rounds; non-powers of two fold in first."""
    f = reducer(op)
    n, r = b.size(), b.rank()
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    rem = n - p
    tmp = np.empty_like(acc)
    # fold: the first 2*rem ranks pair up so that p ranks remain
    if r < 2 * rem:
        if r % 2:  # odd: hand the data to the even neighbour, get the result at the end
            b.send(acc, r - 1)
            b.recv(acc, r - 1)
            return
        b.recv(tmp, r + 1)
        f(acc, tmp, out=acc)  # lower rank's operand first
        vrank = r // 2
    else:
        vrank = r - rem

    def real(v: int) -> int:
        return v * 2 if v < rem else v + rem

    mask = 1
    while mask < p:
        vpeer = vrank ^ mask
        peer = real(vpeer)
        b.sendrecv(acc, peer, tmp, peer)
        if vrank < vpeer:
            f(acc, tmp, out=acc)
        else:
            f(tmp, acc, out=acc)
        mask <<= 1
    if r < 2 * rem:
        b.send(acc, r + 1)


def ring_reduce_scatter(b: PointToPoint, buf: np.ndarray, bounds: list[int], op: str, *, offset: int) -> None:
    """Ring reduce-scatter in place: afterwards rank r holds the full reduction of block
    ``(r + 1 + offset) % n`` (the other blocks hold partial sums)."""
    f = reducer(op)
    n, r = b.size(), b.rank()
    right, left = (r + 1) % n, (r - 1) % n
    biggest = max(bounds[i + 1] - bounds[i] for i in range(n))
    tmp = np.empty(biggest, dtype=buf.dtype)
    for step in range(n - 1):
        s = (r - step + offset) % n
        d = (r - step - 1 + offset) % n
        incoming = tmp[: bounds[d + 1] - bounds[d]]
        b.sendrecv(buf[bounds[s] : bounds[s + 1]], right, incoming, left)
        block = buf[bounds[d] : bounds[d + 1]]
        f(incoming, block, out=block)


def ring_all_gather(b: PointToPoint, buf: np.ndarray, bounds: list[int], *, offset: int) -> None:
    """Ring all-gather in place, starting from rank r owning block ``(r + offset) % n``."""
    n, r = b.size(), b.rank()
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        s = (r - step + offset) % n
        d = (r - step - 1 + offset) % n
        b.sendrecv(buf[bounds[s] : bounds[s + 1]], right, buf[bounds[d] : bounds[d + 1]], left)


# -- reduce-scatter ---------------------------------------------------------------------
def reduce_scatter(b: PointToPoint, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
    """Block ``rank`` of the reduction of ``sendbuf`` (whose length is ``size * len(recvbuf)``)."""
    n, r = b.size(), b.rank()
    m = recvbuf.size
    if n == 1 or m == 0:
        recvbuf[...] = sendbuf
        return
    if sendbuf.nbytes <= SMALL_BYTES:
        reduce_scatter_by_all_reduce(b, sendbuf, recvbuf, op, lambda s, d, o: all_reduce(b, s, d, o))
        return
    work = sendbuf.copy()
    bounds = [i * m for i in range(n + 1)]
    ring_reduce_scatter(b, work, bounds, op, offset=-1)
    recvbuf[...] = work[r * m : (r + 1) * m]


def reduce_scatter_by_all_reduce(
    b: PointToPoint,
    sendbuf: np.ndarray,
    recvbuf: np.ndarray,
    op: str,
    reduce_all: Callable[[np.ndarray, np.ndarray, str], None] | None = None,
) -> None:
    """Reduce-scatter as an all-reduce of the whole buffer, then this rank's block.

    For small buffers (latency dominates) or transports whose native reduce-scatter is
    slower than their all-reduce. ``reduce_all(sendbuf, recvbuf, op)`` defaults to
    ``b.all_reduce``; ``sendbuf`` is never written.
    """
    m, r = recvbuf.size, b.rank()
    full = np.empty_like(sendbuf)
    (reduce_all or b.all_reduce)(sendbuf, full, op)
    recvbuf[...] = full[r * m : (r + 1) * m]


# -- all-gather -------------------------------------------------------------------------
def all_gather(b: PointToPoint, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """Concatenate every rank's ``sendbuf`` into ``recvbuf`` in rank order."""
    n, r = b.size(), b.rank()
    m = sendbuf.size
    recvbuf[r * m : (r + 1) * m] = sendbuf
    if n == 1 or m == 0:
        return
    if sendbuf.nbytes * n <= SMALL_BYTES:
        _bruck_all_gather(b, sendbuf, recvbuf)
    else:
        ring_all_gather(b, recvbuf, [i * m for i in range(n + 1)], offset=0)


def _bruck_all_gather(b: PointToPoint, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """All-gather in ``ceil(log2 n)`` rounds (Bruck): blocks collect in rotated order."""
    n, r = b.size(), b.rank()
    m = sendbuf.size
    rot = np.empty(n * m, dtype=sendbuf.dtype)  # rot block i = rank (r + i) % n
    rot[:m] = sendbuf
    have = 1
    dist = 1
    while have < n:
        count = min(dist, n - have)
        b.sendrecv(rot[: count * m], (r - dist) % n, rot[have * m : (have + count) * m], (r + dist) % n)
        have += count
        dist <<= 1
    # un-rotate: rank q's block sits at rot block (q - r) % n
    recvbuf[r * m :] = rot[: (n - r) * m]
    recvbuf[: r * m] = rot[(n - r) * m :]


# -- broadcast --------------------------------------------------------------------------
def broadcast(b: PointToPoint, buf: np.ndarray, root: int) -> None:
    """Root's ``buf`` to every rank: binomial tree, or scatter + ring all-gather when large."""
    n, r = b.size(), b.rank()
    if n == 1 or buf.size == 0:
        return
    if buf.nbytes > SMALL_BYTES and n > 2 and buf.size >= n:
        bounds = block_bounds(buf.size, n)
        if r == root:
            for peer in range(n):
                if peer != root:
                    b.send(buf[bounds[peer] : bounds[peer + 1]], peer)
        else:
            b.recv(buf[bounds[r] : bounds[r + 1]], root)
        ring_all_gather(b, buf, bounds, offset=0)
        return
    vr = (r - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            b.recv(buf, (vr - mask + root) % n)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            b.send(buf, (vr + mask + root) % n)
        mask >>= 1


# -- all-to-all, gather, scatter, reduce ------------------------------------------------
def all_to_all(b: PointToPoint, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """Block j of ``sendbuf`` to rank j; block i of ``recvbuf`` from rank i (pairwise exchange).

    Step s (1 .. n-1) sends to rank ``r + s`` and receives from rank ``r - s`` at once, so
    no rank waits on a rank that is itself waiting.
    """
    n, r = b.size(), b.rank()
    m = sendbuf.size // n
    recvbuf[r * m : (r + 1) * m] = sendbuf[r * m : (r + 1) * m]
    if n == 1 or m == 0:
        return
    for step in range(1, n):
        dst, src = (r + step) % n, (r - step) % n
        b.sendrecv(sendbuf[dst * m : (dst + 1) * m], dst, recvbuf[src * m : (src + 1) * m], src)


def gather(b: PointToPoint, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> None:
    """Root's ``recvbuf`` = every rank's ``sendbuf`` in rank order (``recvbuf`` is None elsewhere)."""
    n, r = b.size(), b.rank()
    m = sendbuf.size
    if r != root:
        if m:
            b.send(sendbuf, root)
        return
    assert recvbuf is not None
    recvbuf[r * m : (r + 1) * m] = sendbuf
    if m:
        for q in range(n):
            if q != root:
                b.recv(recvbuf[q * m : (q + 1) * m], q)


def scatter(b: PointToPoint, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> None:
    """Block r of root's ``sendbuf`` into rank r's ``recvbuf`` (``sendbuf`` is None off the root)."""
    n, r = b.size(), b.rank()
    m = recvbuf.size
    if r != root:
        if m:
            b.recv(recvbuf, root)
        return
    assert sendbuf is not None
    recvbuf[...] = sendbuf[r * m : (r + 1) * m]
    if m:
        for q in range(n):
            if q != root:
                b.send(sendbuf[q * m : (q + 1) * m], q)


def reduce(b: PointToPoint, sendbuf: np.ndarray, recvbuf: np.ndarray | None, op: str, root: int) -> None:
    """Root's ``recvbuf`` = the reduction of every rank's ``sendbuf`` (None elsewhere).

    Runs the backend's own ``all_reduce`` and keeps the result on the root only: the
    contract wants ``reduce`` bit-identical to ``all_sum`` & co., and a tree reduction
    would add floats in another order than whatever ``all_reduce`` the backend uses (its
    ring, or MPI's). The price is the all-gather half of the traffic.
    """
    out = recvbuf if recvbuf is not None else np.empty_like(sendbuf)
    b.all_reduce(sendbuf, out, op)


# -- barrier ----------------------------------------------------------------------------
def barrier(b: PointToPoint) -> None:
    """Dissemination barrier: ``ceil(log2 n)`` rounds of one-byte messages."""
    n, r = b.size(), b.rank()
    token = np.zeros(1, dtype=np.uint8)
    got = np.empty(1, dtype=np.uint8)
    dist = 1
    while dist < n:
        b.sendrecv(token, (r + dist) % n, got, (r - dist) % n)
        dist <<= 1


# -- split ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SplitPlan:
    """This rank's subgroup after a split, as every rank computed it from the same table."""

    #: ranks of the parent (in their new order) that passed this rank's colour
    members: list[int]
    #: position of this rank's colour among the distinct colours, smallest first: a small
    #: non-negative colour for transports that need one (MPI's ``Comm.Split``)
    color_index: int
    #: this rank's rank in the subgroup (its index in ``members``)
    rank: int


def split_plan(b: PointToPoint, color: int, key: int) -> SplitPlan:
    """Exchange every rank's (colour, key) with ``b.all_gather`` and order the subgroup.

    Members sort by key, then by parent rank; a negative key sorts as the parent rank
    itself (the default ``key=-1`` keeps the parent's order). A colour or key outside the
    64-bit range raises ValueError on every rank (none is left waiting), naming the rank.
    """
    n, r = b.size(), b.rank()
    mine = np.zeros(3, dtype=np.int64)
    try:
        mine[1], mine[2] = color, key
    except OverflowError:
        mine[0] = 1  # every rank raises below
    table = np.empty(3 * n, dtype=np.int64)
    b.all_gather(mine, table)
    flags, colors, keys = table[0::3], table[1::3], table[2::3]
    if flags.any():
        bad = int(np.flatnonzero(flags)[0])
        raise ValueError(
            f"split: rank {bad} passed a colour or key outside the 64-bit range "
            f"(this rank {r} passed color={color}, key={key}); use smaller integers"
        )
    members = [q for q in range(n) if colors[q] == colors[r]]
    members.sort(key=lambda q: (int(keys[q]) if keys[q] >= 0 else q, q))
    palette = sorted(set(colors.tolist()))
    return SplitPlan(members, palette.index(int(colors[r])), members.index(r))


def split_members(b: PointToPoint, color: int, key: int) -> list[int]:
    """Ranks of ``b`` (in their new order) that passed the same ``color`` as this rank."""
    return split_plan(b, color, key).members
