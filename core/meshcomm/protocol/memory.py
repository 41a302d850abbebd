"""Keeping freed memory in the process, so fresh result arrays do not page-fault.

meshcomm returns a new array from every collective. With glibc's default policy a
large freed block goes back to the kernel (``munmap`` or heap trimming), so the next
result array is fresh memory and MPI's writes into it take one page fault per 4 KiB
page: measured on Open MPI 5.0.11, 160 faults per call at 512 KiB and 2500 at 16 MiB,
which made ``all_sum`` up to twice as slow as ``Allreduce`` into a reused buffer (gloo
and the sockets backend showed the same).
Setting ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` high makes glibc keep and reuse
those pages (Open MPI itself used to do this for registered memory). The cost: the
process does not give freed memory back to the kernel, so its resident size stays
at its peak. Applied by ``init()`` when a multi-process backend starts; turned off with
``MESHCOMM_KEEP_MEMORY=0``.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LIMIT = 1 << 30  # blocks up to 1 GiB come from the heap and are reused after free

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks up to 1 GiB for reuse; False where not glibc (no-op)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: leave them alone
            return False
        mallopt = libc.mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        ok = mallopt(_M_MMAP_THRESHOLD, _LIMIT) == 1 and mallopt(_M_TRIM_THRESHOLD, _LIMIT * 2 - 1) == 1
    except (OSError, AttributeError):
        return False
    _done = bool(ok)
    return _done
