"""How long the processes of a job live: they die with their parent, and how they are stopped.

:func:`die_with_parent` (``prctl(PR_SET_PDEATHSIG)``) and :func:`stop` (SIGTERM, SIGCONT,
a grace period, SIGKILL) are each written once, here, for every process that needs them:
the launcher, the rank runner, the host agent on remote hosts and the MPI backend (through
:mod:`meshcomm.plugin`).

Only the standard library, and nothing of meshcomm: the rank runner also runs by path
(``python .../launch/rank.py``) with an interpreter that may lack meshcomm, and the ssh
starter ships this file next to the host agent, which imports it as ``lifetime``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["die_with_parent", "stop", "wait_until"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, *, check: Literal["exit", "kill"] | None = None) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent exits (even by SIGKILL),
    so that nothing the launcher (or mpiexec) started outlives it. True if it was set;
    off Linux nothing can be asked and this returns False.

    ``check`` is what to do about a parent that died before the request took effect (we
    were reparented, and the signal will never come):

    * ``None``: nothing (a ``preexec_fn``: the parent is the one starting us);
    * ``"exit"``: ``os._exit(128 + sig)`` when the parent pid changed, or was init already
      (the rank runner: whoever started a rank is not init);
    * ``"kill"``: send ourselves ``sig`` when the parent pid changed; nothing is asked off
      Linux or when the parent is init already (the MPI backend: an MPI launcher's rank may
      legitimately be init's child).
    """
    if check == "kill" and not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    if check == "kill" and parent <= 1:
        return False
    try:
        ok: bool = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False  # not Linux: nothing to ask for
    if check == "exit" and (parent == 1 or os.getppid() != parent):
        os._exit(128 + sig)
    if check == "kill" and ok and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return ok


def wait_until(done: Callable[[], bool], timeout: float) -> bool:
    """Poll ``done()`` every 0.05 s for up to ``timeout`` seconds; True as soon as it is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.05)
    return False


def stop(
    send: Callable[[Sequence[int]], None], wait: Callable[[float], bool], grace: float, *, kill_always: bool
) -> None:
    """Stop processes as a shell user would: SIGTERM, then SIGCONT (as ``kill`` does for a
    stopped job: a stopped process gets its SIGTERM now, not only SIGKILL at the end of
    the grace period), up to ``grace`` seconds for them to end, then SIGKILL.

    ``send(signals)`` sends those signals, in order, to the processes (it decides how:
    process groups, a session, a ``Popen``, one target after another or each signal to all);
    ``wait(seconds)`` waits up to that long for them to end and says whether they did.
    SIGKILL follows only if they did not, or with ``kill_always`` in any case (process
    groups whose leader exited may still hold what it started).
    """
    send((signal.SIGTERM, signal.SIGCONT))
    if not wait(grace) or kill_always:
        send((signal.SIGKILL,))
