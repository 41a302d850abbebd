"""Results of large all-reduces in memory the other local ranks can write (the push path).

On the direct path (cma.py) every local rank reduces one block of a large all-reduce and
the others then copy that block out of its result with ``process_vm_readv``: each block
crosses memory twice, and the kernel's copy from another process is slower than a plain
copy. When the result is an array meshcomm allocates (``all_sum(x)`` without ``out=``), it
can live in shared memory instead: each rank then writes its block straight into every
rank's result and nobody reads anybody's result (measured in docs/benchmarks.md).

* :class:`OwnResults`: this rank's result buffers, each a memfd mapped here, handed to the
  caller as a NumPy array; one is reused only once the caller has dropped every array on
  it (the mapping's reference count), so a result the caller keeps is never written again.
* :class:`PeerResults`: the other local ranks' result buffers, mapped here on first use
  through ``/proc/<pid>/fd/<fd>`` (which the kernel allows where reading a peer's memory
  is allowed) and checked against the size the peer announced.

Nothing here decides whether a call takes the push path: :class:`~meshcomm_sockets.shm.ShmGroup`
does, from what every local rank announced, so a rank whose buffers are private, or that
cannot open a peer's, only makes that call fall back to reading.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
from dataclasses import dataclass

import numpy as np

__all__ = ["OwnResults", "PeerResults", "Buffer", "SLOTS"]

#: result buffers a rank keeps (the caller may hold this many large results at once before
#: further ones are private arrays again); peers keep as many mappings of each rank's
SLOTS = 2
#: buffer sizes are rounded up to this (fewer new buffers for slowly growing sizes)
_ROUND = 2 << 20


@dataclass
class Buffer:
    """One shared result buffer: ``ident`` (per rank, increasing), its fd here, its mapping."""

    ident: int
    fd: int
    size: int
    map: mmap.mmap
    address: int
    #: references to ``map`` with no array on it (:func:`_refs` right after mapping)
    idle: int = 0


def _address(m: mmap.mmap) -> int:
    """Where mapping ``m`` starts in this process (the view used to ask is dropped at once)."""
    return int(np.frombuffer(m, np.uint8, 1).ctypes.data)


def _refs(buf: Buffer) -> int:
    """References to ``buf``'s mapping, counted the same way every time."""
    return sys.getrefcount(buf.map)


def _in_use(buf: Buffer) -> bool:
    """Whether an array on ``buf``'s mapping is still alive: each holds a reference to it,
    so it has more than it had when nothing did."""
    return _refs(buf) > buf.idle


class OwnResults:
    """This rank's shared result buffers (at most :data:`SLOTS`)."""

    def __init__(self) -> None:
        self._buffers: list[Buffer] = []
        self._next = 1

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """An uninitialised array of ``shape`` and ``dtype`` on a free shared buffer, or None
        when every buffer is still in the caller's hands or memfd is unavailable."""
        nbytes = math.prod(shape) * dtype.itemsize
        free = [b for b in self._buffers if not _in_use(b)]
        fits = [b for b in free if b.size >= nbytes]
        buf = min(fits, key=lambda b: b.size) if fits else None
        if buf is None:
            if len(self._buffers) >= SLOTS:
                if not free:
                    return None
                self._drop(min(free, key=lambda b: b.size))
            buf = self._new(-(-nbytes // _ROUND) * _ROUND)
            if buf is None:
                return None
        return np.frombuffer(buf.map, dtype, nbytes // dtype.itemsize).reshape(shape)

    def find(self, address: int, nbytes: int) -> Buffer | None:
        """The buffer ``nbytes`` at ``address`` lie in from its start, if they are one of ours."""
        for b in self._buffers:
            if b.address == address and nbytes <= b.size:
                return b
        return None

    def _new(self, size: int) -> Buffer | None:
        try:
            fd = os.memfd_create(f"meshcomm-result-{self._next}", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return None
        try:
            os.ftruncate(fd, size)
            buf = Buffer(self._next, fd, size, mmap.mmap(fd, size), 0)
        except OSError:
            os.close(fd)
            return None
        buf.address = _address(buf.map)
        buf.idle = _refs(buf)  # no other name for the mapping exists here
        self._next += 1
        self._buffers.append(buf)
        return buf

    def _drop(self, buf: Buffer) -> None:
        """Forget ``buf``; an array the caller still holds on it keeps the memory."""
        self._buffers.remove(buf)
        os.close(buf.fd)
        if not _in_use(buf):
            buf.map.close()

    def close(self) -> None:
        """Let every buffer go; arrays the caller still holds keep their memory."""
        for buf in list(self._buffers):
            self._drop(buf)


class PeerResults:
    """The other local ranks' result buffers, mapped here (:data:`SLOTS` per rank at most)."""

    def __init__(self) -> None:
        self._maps: dict[int, list[Buffer]] = {}

    def address(self, rank: int, pid: int, fd: int, ident: int, nbytes: int) -> int | None:
        """Where local rank ``rank``'s buffer ``ident`` (its ``fd`` in process ``pid``) is
        mapped here, mapping it first; None if it cannot be opened or is under ``nbytes``."""
        known = self._maps.setdefault(rank, [])
        for b in known:
            if b.ident == ident:
                return b.address if b.size >= nbytes else None
        try:
            mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            size = os.fstat(mine).st_size
            if size < nbytes:
                return None
            m = mmap.mmap(mine, size)
        except OSError:
            return None
        finally:
            os.close(mine)
        if len(known) >= SLOTS:
            old = min(known, key=lambda b: b.ident)
            known.remove(old)
            old.map.close()
        buf = Buffer(ident, -1, size, m, _address(m))
        known.append(buf)
        return buf.address

    def close(self) -> None:
        for known in self._maps.values():
            for b in known:
                b.map.close()
        self._maps.clear()
