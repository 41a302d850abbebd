"""Running real jobs from tests (import as ``from jobs import launch``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "programs"
#: the secret of the jobs these helpers start by hand (meshcomm launch makes a fresh one)
JOB_SECRET = "meshcomm-tests-job-secret"
#: Open MPI's own start-up failing before any rank ran (seen in CI: mpiexec exit 213);
#: nothing of meshcomm ran, so a test starts such a job once more
MPI_RUNTIME_NOT_STARTED = "The PMIx server's listener thread failed to start"
#: a gloo rank's start-up outlasting a test's short MLX_TIMEOUT on a loaded machine: rank 0
#: still importing torch when the others give up reaching its store (seen in CI, 5 s, the
#: suite's other jobs running beside it); no rank got as far as the operation under test
GLOO_STORE_NOT_REACHED = "connecting to rank 0's store"
#: variables of MPI launchers and of meshcomm, which a job a test starts by hand must not inherit
LAUNCH_VARS = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "MLX_", "MESHCOMM_", "HYDRA_", "MPI4PY_")
#: the suite's own settings among them (conftest.py), kept: jobs skip Open MPI's fabric probe,
#: and mpiexec's session directory stays in the session's directory, even when a test kills it
SUITE_VARS = ("OMPI_MCA_btl", "PRTE_MCA_prte_tmpdir_base")


def without_launch_vars(**extra: str) -> dict[str, str]:
    """This process's environment without :data:`LAUNCH_VARS` (but the suite's own settings),
    plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k in SUITE_VARS or not k.startswith(LAUNCH_VARS)}
    env.update(extra)
    return env


def launch(
    n: int,
    *args: str,
    backend: str = "sockets",
    timeout: float = 240,
    env: dict[str, str] | None = None,
    launch_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``meshcomm launch -n n --backend backend [launch_args] -- args`` and capture its output."""
    cmd = [sys.executable, "-m", "meshcomm", "launch", "-n", str(n), "--backend", backend, *launch_args, "--", *args]
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (for tests that need fixed ports),
    below the range connections take their own ends from, as the launcher picks them
    (``unclaimed_port``): a rank binds its port seconds later."""
    from meshcomm.runtime.ports import unclaimed_port

    ports: list[int] = []
    while len(ports) < n:
        p = unclaimed_port(host)
        if p not in ports:
            ports.append(p)
    return ports


def connect_when_listening(port: int, host: str = "127.0.0.1", timeout: float = 60.0) -> socket.socket:
    """A connection to ``port`` once something listens there: a rank started a moment ago
    may need seconds to import and bind on a loaded machine (a fixed sleep is not enough)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on loopback (the sockets engine names peers by their TCP address)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        b = socket.create_connection(srv.getsockname()[:2])
        a, _ = srv.accept()
    return a, b


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p such that p and p + 1 were both free a moment ago (a torchrun MASTER_PORT:
    meshcomm's coordinator takes the next port)."""
    import socket

    for _ in range(100):
        p = free_ports(1, host)[0]
        with socket.socket() as b:
            try:
                b.bind((host, p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no two consecutive free ports found")


def write_hostfile(path: Path, ports: list[int], host: str = "127.0.0.1") -> Path:
    import json

    path.write_text(json.dumps([{"ip": host, "port": p} for p in ports]))
    return path


def start_ranks(
    n: int,
    args: list[str],
    hostfile: Path,
    *,
    ranks: list[int] | None = None,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    prefix: list[str] | None = None,
) -> dict[int, subprocess.Popen[str]]:
    """Start ranks of a sockets job directly (no launcher, so a dying rank does not stop the
    others); ``prefix``: a command that runs the rank's python (e.g. in a namespace)."""
    procs = {}
    for r in range(n) if ranks is None else ranks:
        # a job's secret, as meshcomm launch would give (tests of jobs without one pass "")
        e = {
            **os.environ,
            "MLX_BACKEND": "sockets",
            "MLX_RANK": str(r),
            "MLX_HOSTFILE": str(hostfile),
            "PYTHONUNBUFFERED": "1",
            "MESHCOMM_JOB_SECRET": JOB_SECRET,
            **(env or {}),
            **((rank_env or {}).get(r, {})),
        }
        procs[r] = subprocess.Popen(
            [*(prefix or []), sys.executable, *args],
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
    return procs


def finish(procs: dict[int, subprocess.Popen[str]], timeout: float = 120) -> dict[int, tuple[int, str, str]]:
    """Wait for every rank; (returncode, stdout, stderr) per rank. Kills what outlives ``timeout``."""
    out = {}
    for r, p in procs.items():
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            e += "\n[test] killed after timeout"
        out[r] = (p.returncode, o, e)
    return out
