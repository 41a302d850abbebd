"""Reading a local peer's array in place (cross-memory attach, ``process_vm_readv``).

The shared-memory path copies every piece twice (into a shared slot, out of it) and
waits for every local rank once per piece. With cross-memory attach a rank reads the
part of a peer's array it needs straight into its own buffer: one copy, and a few waits
per call instead of one per piece, so a descheduled peer does not hold every piece up.

The kernel allows it between processes of the same user unless the Yama LSM restricts
ptrace (``/proc/sys/kernel/yama/ptrace_scope``): at scope 1 a process may only read its
descendants, or processes that named it (or an ancestor of it) with
``prctl(PR_SET_PTRACER)``; :func:`allow_siblings` names this rank's parent, so the ranks
a launcher started side by side may read each other and no other process gains anything.
Scope 2 and 3, a seccomp filter, or different PID namespaces make the probe fail and the
job keeps the two-copy path.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import numpy as np

__all__ = ["supported", "allow_siblings", "read", "CmaError"]

_PR_SET_PTRACER = 0x59616D61
_YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        fn = lib.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return lib


_LIB = _libc()


class CmaError(OSError):
    """A direct read from a peer failed (``errno``: ESRCH when the peer is gone)."""


def supported() -> bool:
    """The C library has ``process_vm_readv`` (Linux with glibc or musl)."""
    return _LIB is not None


def allow_siblings() -> None:
    """Under Yama ptrace scope 1, let the processes started by this rank's parent (the
    job's other local ranks) read this rank; nothing to do at scope 0."""
    if _LIB is None:
        return
    try:
        scope = int(_YAMA.read_text().strip())
    except (OSError, ValueError):
        return
    if scope == 1:
        _LIB.prctl(_PR_SET_PTRACER, ctypes.c_ulong(os.getppid()), 0, 0, 0)


def read(pid: int, address: int, into: np.ndarray) -> None:
    """Fill ``into`` (C-contiguous) with the ``into.nbytes`` bytes at ``address`` in the
    memory of process ``pid``; CmaError if the kernel refuses or the process is gone."""
    if _LIB is None:  # pragma: no cover - callers check supported() first
        raise CmaError(errno.ENOSYS, "process_vm_readv is not available")
    base, left = into.ctypes.data, into.nbytes
    while left > 0:
        local = _Iovec(base, left)
        remote = _Iovec(address, left)
        got = _LIB.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise CmaError(err, f"process_vm_readv from pid {pid} at {address:#x}: {os.strerror(err)}")
        base, address, left = base + got, address + got, left - got
