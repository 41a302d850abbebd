"""Letting result arrays reuse freed pages instead of page-faulting on every call.

meshcomm returns a new array from every collective. glibc hands large blocks back
to the kernel when freed (``munmap``, heap trimming), so the next result array is
fresh memory and the first write to each 4 KiB page faults: measured here, a 64 MiB
``all_sum`` over gloo took about twice as long as torch's in-place ``all_reduce``,
mostly in page faults. Raising glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``
keeps freed blocks for reuse. Cost: the process keeps its peak heap resident.
Process-wide, so it is optional (``MESHCOMM_GLOO_KEEP_MEMORY=0`` turns it off).
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LIMIT = 1 << 30  # blocks up to 1 GiB come from the heap and are reused after free


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks up to 1 GiB; False (and no change) where that is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        fn = libc.mallopt
        fn.argtypes = [ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        return bool(fn(_M_MMAP_THRESHOLD, _LIMIT) == 1 and fn(_M_TRIM_THRESHOLD, 2 * _LIMIT - 1) == 1)
    except (OSError, AttributeError):
        return False
