"""The job's reaper: removes a job's directories once its launcher is gone, however it ended.

``meshcomm launch`` starts it (``python reaper.py JOB_ID PATH...``, in a session of its own)
with a pipe as standard input and keeps the pipe's other end. The launcher removes the
directories itself when it ends normally; when it is killed (SIGKILL), the pipe closes and
the reaper waits until no process of the job is left (mpiexec and its ranks stop on their
own once the launcher is gone), then removes them: the job directory, and the shared-memory
directory where the MPI library keeps its segments (16 MiB per rank in ``/dev/shm``).

Standard library only, run by path: it must not pay ``import meshcomm``.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import sys
import time

#: seconds to wait for the job's processes to end before removing their files anyway
WAIT = 10.0


def job_processes(job_id: str) -> list[int]:
    """Pids of this user's processes started for job ``job_id`` (its id in their environment)."""
    mark = f"MESHCOMM_JOB_ID={job_id}".encode()
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if mark in open(f"/proc/{entry}/environ", "rb").read().split(b"\0"):  # noqa: SIM115
                found.append(int(entry))
        except OSError:
            continue
    return found


def remove(path: str) -> None:
    """Remove ``path`` if it is a directory of this user (never through a link)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    job_id, paths = sys.argv[1], sys.argv[2:]
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)  # the launcher's Ctrl-C is not the reaper's end
    try:
        while sys.stdin.buffer.read(4096):
            pass  # nothing is ever written: EOF is the launcher's end
    except OSError:
        pass
    if not any(os.path.lexists(p) for p in paths):
        return  # the launcher ended normally and removed them
    deadline = time.monotonic() + WAIT
    while job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in paths:
        remove(p)


if __name__ == "__main__":
    main()
