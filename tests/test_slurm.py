"""meshcomm under a real Slurm: ``srun`` across three "nodes" (tests/slurm.py's cluster).

The cluster is munge + slurmctld + three slurmd in network namespaces with their own
hostnames (h1, h2, h3); clients run on the login host ``ctl``. Every job is checked for
real results computed on each rank, and failure cases for a named rank and a bounded end
(every client call has a timeout; MLX_TIMEOUT bounds the ranks' waits). After each test no
job process may be left on any node.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from slurm import CTL_NS, SlurmCluster, session_cluster, unavailable_reason

#: the machine has one Slurm test cluster: scripts/test.sh runs every test that uses it in one
#: pytest process of its own, beside the parallel ones
pytestmark = pytest.mark.slurm_cluster

TESTS = Path(__file__).resolve().parent
PY = sys.executable
RANK = str(TESTS / "programs" / "slurm_rank.py")
FAILURE = str(TESTS / "programs" / "failure_rank.py")


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> SlurmCluster:
    return session_cluster(request.config)


@pytest.fixture
def slurm(cluster: SlurmCluster):
    """The cluster, checked after the test for job processes left on the nodes."""
    yield cluster
    deadline = time.monotonic() + 30
    while (left := cluster.running()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"job processes left on the nodes: {cluster.describe(left)}"


def job_env(**extra: str) -> dict[str, str]:
    """The environment srun hands to the tasks: ours without any job variables of an outer
    starter, with the venv's Open MPI prefix (its help texts) and a bounded wait."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MLX_", "SLURM_", "OMPI_", "PMIX_", "PMI_", "PRTE_", "MESHCOMM_"))
        and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env.update(OPAL_PREFIX=sys.prefix, MLX_TIMEOUT="60", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra)
    return env


def infos(stdout: str, n: int) -> dict[int, dict]:
    out = {}
    # anywhere, not per line: MPICH's Hydra may join one rank's line with another's (print
    # writes the text and the newline separately)
    i = stdout.find("INFO {")
    while i >= 0:
        info, end = json.JSONDecoder().raw_decode(stdout, i + 5)
        out[info["rank"]] = info
        i = stdout.find("INFO {", end)
    assert sorted(out) == list(range(n)), stdout
    return out


def show(p) -> str:
    return f"exit {p.returncode}\n--- stdout\n{p.stdout[-6000:]}\n--- stderr\n{p.stderr[-6000:]}"


#: Open MPI 5.0's ob1 can be handed a peer's first message while it still waits in MPI_Init for
#: Slurm's PMIx fence, before MPI_COMM_WORLD is known to it, and crash there
#: (open-mpi/ompi#11438, #12495). It happens before meshcomm
#: runs a line, so a job that crashed exactly there is started once more, and said so.
OMPI_INIT_RACE = ("mca_pml_ob1_recv_frag_callback_match", "ompi_mpi_init")


def srun_mpi(slurm: SlurmCluster, args: list[str], env: dict[str, str], timeout: float):
    """``srun --mpi=pmix`` ARGS, started once more only if Open MPI crashed inside MPI_Init."""
    p = slurm.run(["srun", "--mpi=pmix", *args], env=env, timeout=timeout, check=False)
    if all(s in p.stderr for s in OMPI_INIT_RACE):
        print(f"Open MPI crashed inside MPI_Init (its ob1 start-up race); the job runs again:\n{p.stderr[-3000:]}")
        p = slurm.run(["srun", "--mpi=pmix", *args], env=env, timeout=timeout, check=False)
    return p


def check_job(p, n: int, backend: str, hosts: list[str]) -> None:
    assert p.returncode == 0, show(p)
    got = infos(p.stdout, n)
    for r, info in got.items():
        assert info["size"] == n and info["backend"] == backend, info
        assert info["sum_ok"] and info["gather_ok"] and info["bcast_ok"], info
        assert info["slurm_procid"] == str(r), info
    assert [got[r]["host"] for r in range(n)] == hosts, got


def test_cluster_has_three_hosts(slurm: SlurmCluster) -> None:
    p = slurm.run(["srun", "-N3", "-n3", "-l", "hostname"], timeout=60)
    assert sorted(line.split(": ")[1] for line in p.stdout.splitlines()) == ["h1", "h2", "h3"], p.stdout
    print(f"Slurm cluster set-up took {slurm.setup_seconds:.1f} s")


# -- mpi: srun --mpi=pmix -----------------------------------------------------------------------------


def test_mpi_under_srun_pmix(slurm: SlurmCluster) -> None:
    p = srun_mpi(slurm, ["-N3", "-n3", PY, RANK, "mpi"], env=job_env(), timeout=120)
    check_job(p, 3, "mpi", ["h1", "h2", "h3"])


def test_mpi_under_srun_pmix_two_per_node(slurm: SlurmCluster) -> None:
    p = srun_mpi(slurm, ["-N2", "-n4", "--ntasks-per-node=2", PY, RANK, "mpi"], env=job_env(), timeout=120)
    check_job(p, 4, "mpi", ["h1", "h1", "h2", "h2"])


def test_mpi_under_srun_rank_raises(slurm: SlurmCluster) -> None:
    """Rank 1 (on h2) raises: the ranks on h1 and h3 name it, the job ends non-zero."""
    p = srun_mpi(slurm, ["-N3", "-n3", PY, FAILURE, "--kind", "raise"], env=job_env(MLX_BACKEND="mpi"), timeout=150)
    assert p.returncode != 0, show(p)
    assert p.stdout.count("READY") == 3, show(p)
    assert "RESULT" not in p.stdout, show(p)
    errors = [line for line in p.stdout.splitlines() if line.startswith("ERROR ")]
    assert errors, show(p)
    for line in errors:
        assert "peer=1" in line and "rank 1 failed" in line and "KeyError" in line, show(p)


def test_mpi_under_srun_rank_killed(slurm: SlurmCluster) -> None:
    """Rank 1 (on h2) is SIGKILLed: no result, the job ends non-zero and Slurm names task 1
    (the survivors may be ended by the MPI runtime before they can report)."""
    p = srun_mpi(slurm, ["-N3", "-n3", PY, FAILURE, "--kind", "sigkill"], env=job_env(MLX_BACKEND="mpi"), timeout=150)
    assert p.returncode != 0, show(p)
    assert p.stdout.count("READY") == 3, show(p)
    assert "RESULT" not in p.stdout, show(p)
    errors = [line for line in p.stdout.splitlines() if line.startswith("ERROR ")]
    assert all("peer=1" in line for line in errors), show(p)
    assert "h2: task 1: Killed" in p.stderr, show(p)


# -- sockets and gloo: plain srun, the coordinator derived from the Slurm step ------------------------


SECRET = "5ec2e7" * 6


def test_sockets_under_plain_srun_without_any_setting(slurm: SlurmCluster) -> None:
    """``srun -n 3 python prog.py`` with no meshcomm variable at all: ``any`` finds Slurm's rank
    variables and the sockets backend starts from the coordinator derived from the step."""
    env = job_env()
    del env["MLX_TIMEOUT"]
    p = slurm.run(["srun", "-N3", "-n3", PY, RANK], env=env, timeout=120, check=False)
    check_job(p, 3, "sockets", ["h1", "h2", "h3"])


def test_sockets_under_srun_two_per_node(slurm: SlurmCluster) -> None:
    p = slurm.run(
        ["srun", "-N2", "-n4", "--ntasks-per-node=2", PY, RANK, "sockets"],
        env=job_env(MESHCOMM_JOB_SECRET=SECRET),
        timeout=120,
        check=False,
    )
    check_job(p, 4, "sockets", ["h1", "h1", "h2", "h2"])


def gloo_available() -> None:
    pytest.importorskip("torch", reason="the gloo backend needs torch")
    pytest.importorskip("meshcomm_gloo", reason="the gloo plugin is not installed")


def test_gloo_under_plain_srun(slurm: SlurmCluster) -> None:
    gloo_available()
    p = slurm.run(
        ["srun", "-N3", "-n3", PY, RANK, "gloo"], env=job_env(MESHCOMM_JOB_SECRET=SECRET), timeout=150, check=False
    )
    check_job(p, 3, "gloo", ["h1", "h2", "h3"])


@pytest.mark.parametrize("backend", ["sockets", "gloo"])
@pytest.mark.parametrize("kind", ["raise", "sigkill"])
def test_failure_on_another_node_is_named(slurm: SlurmCluster, backend: str, kind: str) -> None:
    """Rank 1 (on h2) raises or is SIGKILLed: the ranks on h1 and h3 name rank 1 and the job
    ends non-zero, with no result."""
    if backend == "gloo":
        gloo_available()
    p = slurm.run(
        ["srun", "-N3", "-n3", PY, FAILURE, "--kind", kind],
        env=job_env(MLX_BACKEND=backend, MESHCOMM_JOB_SECRET=SECRET),
        timeout=150,
        check=False,
    )
    assert p.returncode != 0, show(p)
    assert p.stdout.count("READY") == 3, show(p)
    assert "RESULT" not in p.stdout, show(p)
    errors = [line for line in p.stdout.splitlines() if line.startswith("ERROR ")]
    # both survivors, as a rule; srun may end the step once it saw task 1 die, so at least one
    assert 1 <= len(errors) <= 2, show(p)
    assert all("peer=1" in line and "rank 1" in line for line in errors), show(p)


# -- meshcomm launch inside an allocation: the slurm starter ----------------------------------------


def launch(*args: str) -> list[str]:
    return [PY, "-m", "meshcomm", "launch", "--timeout", "60", *args]


def launched_infos(stdout: str, n: int) -> dict[int, dict]:
    return infos("\n".join(line.split("] ", 1)[1] for line in stdout.splitlines() if line.startswith("[rank ")), n)


def check_launched(p, n: int, backend: str, hosts: list[str]) -> None:
    assert p.returncode == 0, show(p)
    got = launched_infos(p.stdout, n)
    for info in got.values():
        assert info["size"] == n and info["backend"] == backend, info
        assert info["sum_ok"] and info["gather_ok"] and info["bcast_ok"], info
        # the agent's one-task step variables do not reach the ranks
        assert info["slurm_procid"] is None, info
    assert [got[r]["host"] for r in range(n)] == hosts, got


def test_launch_in_salloc_starts_ranks_with_srun(slurm: SlurmCluster) -> None:
    """``salloc -N3 meshcomm launch -n 3``: --launcher auto is the slurm starter; one rank on
    each node of the allocation, sockets backend."""
    p = slurm.run(["salloc", "-N3", *launch("-n", "3", RANK)], env=job_env(), timeout=150, check=False)
    check_launched(p, 3, "sockets", ["h1", "h2", "h3"])


def test_launch_in_salloc_takes_tasks_per_node(slurm: SlurmCluster) -> None:
    """Without -n the allocation's tasks per node decide (2 on each of 2 nodes)."""
    p = slurm.run(
        ["salloc", "-N2", "--ntasks-per-node=2", *launch("--launcher", "slurm", RANK)],
        env=job_env(),
        timeout=150,
        check=False,
    )
    check_launched(p, 4, "sockets", ["h1", "h1", "h2", "h2"])


def test_launch_in_salloc_gloo(slurm: SlurmCluster) -> None:
    gloo_available()
    p = slurm.run(
        ["salloc", "-N3", *launch("-n", "3", "--backend", "gloo", RANK)], env=job_env(), timeout=150, check=False
    )
    check_launched(p, 3, "gloo", ["h1", "h2", "h3"])


def test_launch_in_sbatch(slurm: SlurmCluster, tmp_path: Path) -> None:
    """An sbatch script (run on h1) whose launcher starts ranks on the 2 nodes through srun."""
    out = tmp_path / "job.out"
    script = f"#!/bin/bash\nexec {' '.join(launch('-n', '2', RANK))}\n"
    p = slurm.run(
        ["sbatch", "--wait", "-N2", f"--output={out}", "--wrap", script.split("exec ", 1)[1].strip()],
        env=job_env(),
        timeout=150,
        check=False,
    )
    text = out.read_text() if out.exists() else ""
    assert p.returncode == 0, show(p) + text
    got = launched_infos(text, 2)
    assert [got[r]["host"] for r in range(2)] == ["h1", "h2"], text
    assert all(i["sum_ok"] and i["gather_ok"] and i["bcast_ok"] for i in got.values()), text


def test_launch_in_salloc_names_the_failed_rank(slurm: SlurmCluster) -> None:
    p = slurm.run(
        ["salloc", "-N3", *launch("-n", "3", FAILURE, "--kind", "raise")], env=job_env(), timeout=150, check=False
    )
    assert p.returncode == 1, show(p)
    last = [line for line in p.stderr.splitlines() if line.startswith("meshcomm launch:")]
    assert last and last[-1].startswith("meshcomm launch: rank 1 on h2 exited with code 1"), show(p)
    assert "RESULT" not in p.stdout, show(p)


def test_launcher_slurm_outside_an_allocation(tmp_path: Path) -> None:
    import subprocess

    env = job_env()
    p = subprocess.run(
        launch("--launcher", "slurm", "-n", "2", RANK),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    assert p.returncode != 0, show(p)
    assert "not inside a Slurm allocation" in p.stderr, show(p)


def test_killed_launcher_in_salloc_leaves_no_rank(slurm: SlurmCluster) -> None:
    """SIGKILL the launcher while its ranks wait: srun dies with it, each node's agent sees the
    end of its stdin and stops the node's ranks, salloc ends; nothing is left on the nodes
    (the ``slurm`` fixture checks)."""
    import subprocess

    from slurm import _ns_pids

    prog = str(TESTS / "programs" / "launch_rank.py")
    proc = subprocess.Popen(
        slurm.command(["salloc", "-N3", *launch("-n", "3", prog, "wait")]),
        env=job_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = 0
        lines = []
        for line in proc.stdout:
            lines.append(line)
            ready += line.rstrip().endswith("] ready")
            if ready == 3:
                break
        assert ready == 3, "".join(lines)
        launchers = [
            pid
            for pid in _ns_pids(CTL_NS)
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"{PY}\0-m\0meshcomm\0launch\0".encode())
        ]
        assert len(launchers) == 1, launchers
        os.kill(launchers[0], 9)
        rest = proc.communicate(timeout=60)[0]
        assert "Relinquishing job allocation" in rest, "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the test cluster itself -------------------------------------------------------------------------


def test_killed_cluster_owner_leaves_nothing() -> None:
    """A second cluster under another name whose owner is SIGKILLed: its reaper tears it down
    (no namespace, no daemon, no directory left). The session's cluster is not touched."""
    import signal
    import subprocess

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no Slurm test cluster: {reason}")
    name = "mcslurmkill"
    env = {**os.environ, "MESHCOMM_TEST_SLURM_NAME": name}
    base = Path(f"/tmp/meshcomm-slurm-{name}")

    def left() -> tuple[list[str], list[int], bool]:
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
        ours = [line.split()[0] for line in ns if line.startswith(name + "-")]
        procs = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if str(base).encode() in (d / "cmdline").read_bytes():
                        procs.append(int(d.name))
                except OSError:
                    pass
        return ours, procs, base.exists()

    owner = subprocess.Popen(
        [PY, str(TESTS / "slurm.py"), "hold"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        first = owner.stdout.readline()
        assert first.startswith("UP "), first + (owner.stderr.read() if owner.poll() is not None else "")
        ours, procs, exists = left()
        assert len(ours) == 4 and procs and exists, (ours, procs, exists)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 60
        while any(left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(left()), f"left behind by a killed owner: {left()}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        subprocess.run([PY, str(TESTS / "slurm.py"), "down"], env=env, capture_output=True, timeout=60)


# -- the slurm starter's pure parts (no cluster needed) --------------------------------------------


def test_starter_hosts_from_the_allocation() -> None:
    from meshcomm.launch.starters.slurm import allocation_hosts
    from meshcomm.protocol.errors import ConfigError

    env = {"SLURM_JOB_NODELIST": "n[01-03],gpu7", "SLURM_TASKS_PER_NODE": "2(x3),1"}
    hosts = allocation_hosts(None, env)
    assert [(h.ssh, h.slots, h.ips) for h in hosts] == [
        ("n01", 2, ["n01"]),
        ("n02", 2, ["n02"]),
        ("n03", 2, ["n03"]),
        ("gpu7", 1, ["gpu7"]),
    ]
    # with -n given the ranks are spread evenly: no slots
    assert [h.slots for h in allocation_hosts(8, env)] == [None] * 4
    # a task count that does not match the node list is ignored
    assert [h.slots for h in allocation_hosts(None, {**env, "SLURM_TASKS_PER_NODE": "2(x2)"})] == [None] * 4
    with pytest.raises(ConfigError, match="inside an allocation"):
        allocation_hosts(None, {})


def test_starter_srun_command_drops_the_step_variables() -> None:
    from meshcomm.launch.starters.slurm import STEP_VARIABLES, srun_argv

    argv = srun_argv("/usr/bin/srun", "n02")
    assert argv[:4] == ["/usr/bin/srun", "--nodes=1", "--ntasks=1", "--nodelist=n02"]
    assert "--overlap" in argv and argv[-2:] == ["bash", "-s"]
    unset = {argv[i + 1] for i, a in enumerate(argv) if a == "-u"}
    assert {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "PMIX_RANK", "PMI_RANK"} <= unset == set(STEP_VARIABLES)


def test_launch_in_salloc_restarts_a_lost_rank_that_joins(slurm: SlurmCluster) -> None:
    """``salloc -N2 meshcomm launch -n 4 --restart-lost 1``: rank 3 (on h2) is killed, the
    survivors shrink and go on, h2's agent (inside the allocation's step) starts a
    replacement, and grow() makes the world of 4 whole again."""
    program = str(Path(FAILURE).parent / "survivors.py")
    p = slurm.run(
        [
            "salloc",
            "-N2",
            *launch("-n", "4", "--restart-lost", "1", program, "--kind", "sigkill", "--lose", "3", "--grow"),
        ],
        env=job_env(),
        timeout=150,
        check=False,
    )
    assert p.returncode == 0, show(p)
    assert "[rank 3] JOINED as rank 3 of 4" in p.stdout, show(p)
    for r in range(4):
        assert f"[rank {r}] GROWN ok size=4 rank={r} agree=True" in p.stdout, show(p)
