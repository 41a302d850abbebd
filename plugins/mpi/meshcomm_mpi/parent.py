"""A rank must not outlive the mpiexec (or launcher proxy) that started it.

When mpiexec is killed with SIGKILL it cannot end its ranks, and ranks blocked in
communication would wait for ever. On Linux the kernel can send a signal to a process
when its parent exits (``prctl(PR_SET_PDEATHSIG)``); the backend asks for SIGKILL when the
process was started by an MPI launcher. If the parent died before the call (the parent
pid changed meanwhile), the rank ends at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent exits. True if it was set.

    Does nothing (False) off Linux or when the parent is already init (pid 1).
    """
    if not sys.platform.startswith("linux"):
        return False
    before = os.getppid()
    if before <= 1:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if ok and os.getppid() != before:  # the parent died between the two calls
        os.kill(os.getpid(), signal.SIGKILL)
    return ok
