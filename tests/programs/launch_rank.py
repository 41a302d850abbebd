"""Rank side of the launcher tests: ``launch_rank.py MODE [ARGS...]`` under ``meshcomm launch``.

Every mode first writes this process's pid to ``$MC_TEST_PIDDIR/rank-R-PID.pid`` (when the
variable is set) so a test can check that nothing is left running after the launcher
returned. Modes:

* ``info``: start the job, run all_sum / all_gather / broadcast, and print one line
  ``INFO {json}`` with what this rank saw (environment, interpreter, cwd, network
  namespace, results). The results are computed here and checked by the test.
* ``whoami``: print the interpreter and MLX_RANK (imports nothing of meshcomm).
* ``spam LINES``: print LINES long self-checking lines to stdout and stderr from two
  threads at once (no meshcomm needed).
* ``fail RANK CODE``: everyone starts; RANK exits with CODE once all printed ``ready``,
  the others wait in a collective that can only finish with RANK.
* ``sigkill RANK``: like ``fail``, but RANK kills itself with SIGKILL.
* ``wait``: everyone starts, prints ``ready`` and blocks in recv until stopped.
  ``wait-stubborn``: the same, but SIGTERM is ignored (the launcher must SIGKILL) and a
  grandchild ``sleep`` is started (its pid is recorded too).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def env_rank() -> int:
    """This rank, from meshcomm's launcher or an MPI launcher's variables (no meshcomm import)."""
    for var in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    raise SystemExit("no rank variable set: run under meshcomm launch")


def record_pid(pid: int, what: str = "rank") -> None:
    d = os.environ.get("MC_TEST_PIDDIR")
    if d:
        with open(os.path.join(d, f"{what}-{env_rank()}-{pid}.pid"), "w") as f:
            f.write(str(pid))


def spam_line(rank: int, stream: str, i: int) -> str:
    """A line whose length and content depend on (rank, stream, i) and end with its digest."""
    body = f"{rank}:{stream}:{i}:" + (chr(ord("a") + (rank * 7 + i) % 26) * (500 + (i * 997 + rank * 131) % 7000))
    return body + ":" + hashlib.sha1(body.encode()).hexdigest()


def spam(lines: int) -> None:
    rank = env_rank()

    def run(stream: str) -> None:
        out = sys.stdout if stream == "out" else sys.stderr
        for i in range(lines):
            out.write(spam_line(rank, stream, i) + "\n")
            out.flush()

    threads = [threading.Thread(target=run, args=(s,)) for s in ("out", "err")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def net_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def info() -> None:
    import meshcomm as mc
    import numpy as np

    g = mc.init(strict=True)
    r, n = g.rank(), g.size()
    x = np.arange(4, dtype=np.int64) + 10 * r + 1
    s = mc.all_sum(x)
    gathered = mc.all_gather(np.array([r * r + 7], dtype=np.int64))
    b = mc.broadcast(np.array([1000 + r], dtype=np.int64), root=n - 1)
    env = {
        k: os.environ.get(k)
        for k in (
            "MLX_RANK",
            "MLX_WORLD_SIZE",
            "MLX_LOCAL_RANK",
            "MLX_LOCAL_SIZE",
            "MLX_BACKEND",
            "MLX_TIMEOUT",
            "MESHCOMM_JOB_ID",
            "MESHCOMM_JOB_SECRET",
            "SSH_CONNECTION",
            "MC_TEST_A",
            "MC_TEST_B",
            "MLX_HOSTFILE",
        )
    }
    print(
        "INFO "
        + json.dumps(
            {
                "rank": r,
                "size": n,
                "backend": g.backend,
                "pid": os.getpid(),
                "env": env,
                "executable": sys.executable,
                "cwd": os.getcwd(),
                "argv": sys.argv[1:],
                "netns": net_ns(),
                "hostname": socket.gethostname(),
                "all_sum": s.tolist(),
                "all_gather": gathered.tolist(),
                "broadcast": b.tolist(),
            }
        ),
        flush=True,
    )


def wait_forever(g) -> None:  # noqa: ANN001
    import meshcomm as mc
    import numpy as np

    n, r = g.size(), g.rank()
    if n == 1:
        time.sleep(3600)
    # nobody ever sends: every rank blocks in recv until the launcher stops it
    mc.recv((1,), np.float32, (r + 1) % n)
    print("recv returned?!", flush=True)
    sys.exit(9)


def main() -> None:
    record_pid(os.getpid())
    mode = sys.argv[1]
    if mode == "info":
        info()
        return
    if mode == "spam":
        spam(int(sys.argv[2]))
        return
    if mode == "whoami":  # no meshcomm: also runs under an interpreter without it
        print(f"WHOAMI rank={os.environ.get('MLX_RANK')} executable={sys.executable}", flush=True)
        return

    import meshcomm as mc
    import numpy as np

    g = mc.init(strict=True)
    r = g.rank()
    if mode == "wait-stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "600"])
        record_pid(child.pid, "child")
    g.barrier()
    print("ready", flush=True)
    if mode in ("wait", "wait-stubborn"):
        wait_forever(g)
    elif mode in ("fail", "sigkill"):
        bad = int(sys.argv[2])
        g.barrier()  # everyone printed ready
        if r == bad:
            time.sleep(0.3)  # let the others enter the collective first
            if mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            sys.exit(int(sys.argv[3]))
        print("waiting in all_sum", flush=True)
        mc.all_sum(np.ones(3))
        print("all_sum returned without the failed rank?!", flush=True)
        sys.exit(8)
    else:
        sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
