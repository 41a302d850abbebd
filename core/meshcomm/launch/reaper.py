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


def in_job(pid: int, job_id: str) -> bool:
    """Whether process ``pid`` was started for job ``job_id`` (its id is in the process's
    environment), so a pid recycled by another program is never taken for a rank."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"MESHCOMM_JOB_ID={job_id}".encode() in env.split(b"\0")


def job_processes(job_id: str) -> list[int]:
    """Pids of this user's processes started for job ``job_id``."""
    me = os.getpid()
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != me and in_job(int(e), job_id)]


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
