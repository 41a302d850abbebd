"""The gloo backend started by other engines (issue 15): a coordinator plus a scheduler's rank
variables, torchrun (the agent's store) and mpirun as a plain launcher.

Every job runs in its own session and its whole process group is killed on the way out,
so no rank, agent or daemon outlives a test, also when it fails. Rank programs are the
``_w_*`` functions below (``python this_file.py NAME``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
BIN = Path(sys.executable).parent
OURS = (
    "MLX_",
    "MESHCOMM_",
    "GLOO_",
    "MASTER_",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_",
    "SLURM_",
    "OMPI_",
    "PMI",
    "TORCHELASTIC_",
    "GROUP_",
    "ROLE_",
)
SECRET = "engines-test-secret"


def _free_port() -> int:
    from jobs import free_ports

    return free_ports(1)[0]


def _base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(OURS)}
    env.update(MLX_BACKEND="gloo", MLX_TIMEOUT="60", PYTHONUNBUFFERED="1", MESHCOMM_JOB_SECRET=SECRET)
    env.update(extra or {})
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float = 240) -> tuple[int, str, str]:
    """Run a launcher in its own session; its process group is killed whatever happens."""
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", "[test] killed: the job outlived its timeout"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if p.returncode is None:
            p.communicate()
    return p.returncode, out, err


def _sums(out: str, n: int) -> dict[int, str]:
    """rank -> "size sum" from every rank's SUM line (a launcher may interleave the lines' pieces)."""
    return {
        int(r): f"{size} {total}" for r, size, total in re.findall(r"SUM (\d+) (\d+) (\d+\.\d+)", out) if size == str(n)
    }


def _check(out: str, err: str, n: int) -> None:
    got = _sums(out, n)
    want = f"{n} {float(n * (n + 1) // 2)}"
    assert sorted(got) == list(range(n)) and all(v == want for v in got.values()), (out, err[-4000:])


def _sum_workers(envs: list[dict[str, str]]) -> list[tuple[int, str, str]]:
    """Start one "_w_sum" rank per environment, wait for all; (returncode, stdout, stderr) each.
    Ranks still running when this ends (a failure, the timeout) are killed."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for env in envs:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE), "_w_sum"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )
            )
        res = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, res, strict=True)]


# -- coordinator + a scheduler's variables (started by hand, as a scheduler would) -------------
SCHEDULERS = {
    "Slurm": lambda r, n: {"SLURM_PROCID": str(r), "SLURM_NTASKS": str(n), "SLURM_STEP_ID": "0"},
    "Open MPI": lambda r, n: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(n)},
    "MPICH": lambda r, n: {"PMI_RANK": str(r), "PMI_SIZE": str(n)},
}


@pytest.mark.parametrize("family", sorted(SCHEDULERS))
def test_coordinator_and_scheduler_rank_variables_start_gloo(family: str) -> None:
    n, port = 3, _free_port()
    res = _sum_workers(
        [_base_env({"MLX_COORDINATOR": f"127.0.0.1:{port}", **SCHEDULERS[family](r, n)}) for r in range(n)]
    )
    for r, (rc, out, err) in enumerate(res):
        assert rc == 0 and out.split()[:3] == ["SUM", str(r), str(n)], (r, out, err[-3000:])
        assert out.split()[3] == "6.0", out


def test_master_addr_without_agent_store_hosts_at_the_port_above() -> None:
    """MASTER_ADDR/MASTER_PORT set by hand (no torchrun agent): rank 0 hosts at MASTER_PORT+1, so a
    program's own torch store at MASTER_PORT is left alone."""
    n, port = 2, _free_port()
    res = _sum_workers(
        [
            _base_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1), "RANK": str(r), "WORLD_SIZE": str(n)})
            for r in range(n)
        ]
    )
    _check("".join(o for _, o, _ in res), "".join(e for _, _, e in res), n)


# -- torchrun ---------------------------------------------------------------------------------
@pytest.mark.skipif(not (BIN / "torchrun").exists(), reason="torchrun is not installed next to this Python")
def test_torchrun_three_ranks_use_the_agent_store(tmp_path: Path) -> None:
    n = 3
    # TMPDIR: torchrun makes a log directory there (torchelastic_*) and leaves it
    rc, out, err = _run(
        [str(BIN / "torchrun"), "--nproc-per-node", str(n), str(HERE), "_w_torchrun"],
        _base_env({"TMPDIR": str(tmp_path)}),
    )
    assert rc == 0, (out, err[-4000:])
    _check(out, err, n)
    assert out.count("AGENT STORE HOLDS MESHCOMM KEYS") == n, out


# -- mpirun as a plain launcher ---------------------------------------------------------------------
def _mpirun() -> str | None:
    found = BIN / "mpirun"
    if found.exists():
        return str(found)
    return shutil.which("mpirun")


@pytest.mark.skipif(_mpirun() is None, reason="no mpirun")
def test_mpirun_launches_gloo_ranks_with_a_coordinator() -> None:
    n, port = 3, _free_port()
    env = _base_env(
        {"MLX_COORDINATOR": f"127.0.0.1:{port}", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    )
    cmd = [
        str(_mpirun()),
        "-n",
        str(n),
        "--oversubscribe",
        "-x",
        "MLX_BACKEND",
        "-x",
        "MLX_COORDINATOR",
        "-x",
        "MESHCOMM_JOB_SECRET",
        "-x",
        "MLX_TIMEOUT",
        sys.executable,
        str(HERE),
        "_w_sum",
    ]
    rc, out, err = _run(cmd, env)
    assert rc == 0, (out, err[-4000:])
    _check(out, err, n)


# -- where the rendezvous comes from (no processes) ------------------------------------------------
def _resolve(env: dict[str, str]):  # type: ignore[no-untyped-def]
    from meshcomm.runtime.config import Config, load_settings
    from meshcomm_gloo.placing import resolve
    from meshcomm_gloo.settings import GlooSettings

    return resolve(Config.load(env), load_settings(GlooSettings, environ=env), env)


def test_resolve_prefers_explicit_settings_then_file_then_coordinator(tmp_path: Path) -> None:
    r = _resolve(
        {"MLX_RANK": "1", "MLX_WORLD_SIZE": "2", "MESHCOMM_GLOO_PORT": "1234", "MLX_COORDINATOR": "10.0.0.1:99"}
    )
    assert (r.kind, r.addr, r.port) == ("client", "127.0.0.1", 1234)
    r = _resolve(
        {
            "MLX_RANK": "0",
            "MLX_WORLD_SIZE": "2",
            "MESHCOMM_GLOO_FILE": str(tmp_path / "f"),
            "MLX_COORDINATOR": "10.0.0.1:99",
        }
    )
    assert r.kind == "file" and r.file == tmp_path / "f"
    r = _resolve({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "3", "MLX_COORDINATOR": "node1:2000"})
    assert (r.rank, r.size, r.kind, r.addr, r.port) == (0, 4, "host", "node1", 2000)
    assert "Slurm" in r.describe() and "MLX_COORDINATOR" in r.describe()


def test_resolve_under_torchrun_is_a_client_of_the_agent_store() -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "run1",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    a, b = _resolve(env), _resolve(env)
    assert (a.rank, a.size, a.kind, a.addr, a.port, a.agent) == (0, 3, "client", "h", 29500, True)
    assert a.namespace.startswith("meshcomm-torchrun/run1/restart2/") and a.namespace != b.namespace
    assert a.job == "run1"
    own = _resolve({k: v for k, v in env.items() if k != "TORCHELASTIC_USE_AGENT_STORE"})
    assert (own.kind, own.port, own.agent, own.namespace) == ("host", 29501, False, "")


def test_missing_names_every_way_to_start() -> None:
    from meshcomm.runtime.config import Config, load_settings
    from meshcomm_gloo.placing import missing
    from meshcomm_gloo.settings import GlooSettings

    lacking = " ".join(missing(Config.load({}), load_settings(GlooSettings, environ={})))
    for var in (
        "MLX_RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "MLX_WORLD_SIZE",
        "MLX_COORDINATOR",
        "MASTER_ADDR",
        "MESHCOMM_GLOO_PORT",
        "MESHCOMM_GLOO_FILE",
    ):
        assert var in lacking, lacking
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MLX_COORDINATOR": "h:1"}
    assert missing(Config.load(env), load_settings(GlooSettings, environ={})) == []


# -- rank programs ------------------------------------------------------------------------------
def _w_sum() -> None:
    import meshcomm as mc

    g = mc.init(strict=True)
    total = mc.all_sum(np.array([g.rank() + 1.0]), group=g)
    sys.stdout.write(f"SUM {g.rank()} {g.size()} {float(total[0])}\n")  # one write: lines stay whole
    sys.stdout.flush()


def _w_torchrun() -> None:
    import datetime

    import torch.distributed as dist

    _w_sum()
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        1,
        False,
        timeout=datetime.timedelta(seconds=30),
        wait_for_workers=False,
    )
    run = os.environ["TORCHELASTIC_RUN_ID"]
    if agent.check([f"meshcomm-torchrun/{run}/restart0/start1/meshcomm/proc/{os.environ['RANK']}"]):
        sys.stdout.write("AGENT STORE HOLDS MESHCOMM KEYS\n")
        sys.stdout.flush()


if __name__ == "__main__":
    globals()[sys.argv[1]]()
