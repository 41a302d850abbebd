"""``meshcomm launch`` across "hosts": a real sshd on a loopback address, and network namespaces.

* ssh: ``tests/sshd.py`` starts a private sshd on 127.0.0.2 (127.0.0.1 and localhost count as
  this machine and would not go through ssh); ranks are started with ``--ssh`` pointing at it
  and must see ``SSH_CONNECTION``.
* namespaces: ``tests/netns.py`` makes one network namespace per host, bridged together,
  and ``tests/programs/netns_exec.sh`` is the ``--ssh`` that starts a rank inside the
  namespace of its host address; ranks talk over the veth/bridge network with the sockets
  backend. Each rank reports its network namespace, which must be its host's.

Remote ranks only get the launcher's variables and ``--env``, so the pid directory of the
leftover checks is passed with ``--env MC_TEST_PIDDIR=...``.

One ssh session per host (issue 15): ``127.0.0.2`` and ``root@127.0.0.2`` are two hosts of
the job (two ssh destinations) on the same sshd; an ``ssh`` wrapper logs every call, and
the launcher's ssh children are counted while the ranks run. Starting, output, stopping
and killing must all go through that one session per host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import NetnsHosts, NetnsUnavailable
from sshd import LoopbackSshd, SshdUnavailable, find_sshd
from test_launch import (
    PREFIX,
    RANK_PROG,
    TESTS,
    Launcher,
    assert_no_leftovers,
    check_results,
    launch_rank,
    parse_infos,
    prefixed_lines,
    recorded_pids,
    run_launch,
    show,
)

CONNECT_PROG = TESTS / "programs" / "connect_rank.py"

SSH_ADDR = "127.0.0.2"


# -- ssh to a loopback address -------------------------------------------------------------------


@pytest.fixture(scope="module")
def sshd() -> Iterator[LoopbackSshd]:
    if find_sshd() is None and os.geteuid() == 0:
        subprocess.run([str(TESTS.parent / "scripts" / "ci-system-deps.sh")], check=False)
    if find_sshd() is None:
        pytest.skip("sshd is not installed and cannot be installed (run scripts/ci-system-deps.sh as root)")
    try:
        server = LoopbackSshd(SSH_ADDR)
    except SshdUnavailable as exc:
        if os.geteuid() == 0:
            raise  # it must work for root here: fail, do not hide it
        pytest.skip(f"cannot run a private sshd: {exc}")
    yield server
    server.stop()


def ssh_args(server: LoopbackSshd, piddir: Path) -> list[str]:
    return ["--ssh", server.ssh_command, "--env", f"MC_TEST_PIDDIR={piddir}"]


def logging_ssh(folder: Path, real: str, name: str = "ssh") -> tuple[Path, Path]:
    """An ``ssh`` (named so: the launcher adds ``--`` for ssh) that appends its arguments to
    a log and execs ``real`` (the process stays an ``ssh``); (wrapper, log)."""
    bindir = folder / "bin"
    bindir.mkdir(exist_ok=True)
    log = folder / "ssh-calls.log"
    wrapper = bindir / name
    wrapper.write_text(f'#!/bin/bash\nprintf \'%s\\n\' "$*" >> {log}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def ssh_children(pid: int) -> list[int]:
    """The ssh processes ``pid`` started (its children whose program is ssh)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and comm == "ssh":
            found.append(int(d.name))
    return found


TWO_HOSTS = f"{SSH_ADDR}:3,root@{SSH_ADDR}:2"  # two ssh destinations, 3 + 2 ranks


def assert_through_ssh(info: dict, server: LoopbackSshd) -> None:
    conn = info["env"]["SSH_CONNECTION"]
    assert conn is not None, f"rank {info['rank']} was not started over ssh"
    assert conn.split()[2:] == [SSH_ADDR, str(server.port)], f"rank {info['rank']}: SSH_CONNECTION={conn}"


def test_ssh_ranks(sshd: LoopbackSshd, tmp_path: Path) -> None:
    p = run_launch(
        "-n",
        "2",
        "--hosts",
        SSH_ADDR,
        *ssh_args(sshd, tmp_path),
        "--env",
        "MC_TEST_A=x y",
        "--timeout",
        "30",
        str(RANK_PROG),
        "info",
        "a b",
        timeout=90,
    )
    assert p.returncode == 0, show(p)
    infos = parse_infos(p.stdout, 2)
    check_results(infos, 2)
    for info in infos.values():
        assert_through_ssh(info, sshd)
        assert info["env"]["MC_TEST_A"] == "x y" and info["env"]["MLX_TIMEOUT"] == "30"
        assert info["argv"] == ["info", "a b"]
    hostfile = infos[0]["env"]["MLX_HOSTFILE"]
    assert not os.path.exists(hostfile), "the job's files were not removed"
    assert_no_leftovers(tmp_path, 2)


def test_ssh_mixed_with_local_rank(sshd: LoopbackSshd, tmp_path: Path) -> None:
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"ssh": "localhost", "slots": 1}, {"ssh": f"root@{SSH_ADDR}", "slots": 2}]))
    p = run_launch("-n", "3", "--hostfile", str(hf), *ssh_args(sshd, tmp_path), str(RANK_PROG), "info", timeout=90)
    assert p.returncode == 0, show(p)
    infos = parse_infos(p.stdout, 3)
    check_results(infos, 3)
    assert infos[0]["env"]["SSH_CONNECTION"] is None, "rank 0 (localhost) went through ssh"
    assert_through_ssh(infos[1], sshd)
    assert_through_ssh(infos[2], sshd)
    assert_no_leftovers(tmp_path, 3)


def test_ssh_failing_remote_rank_stops_the_job(sshd: LoopbackSshd, tmp_path: Path) -> None:
    p = run_launch(
        "-n",
        "3",
        "--hosts",
        SSH_ADDR,
        *ssh_args(sshd, tmp_path),
        "--timeout",
        "120",
        str(RANK_PROG),
        "fail",
        "1",
        "3",
        timeout=90,
    )
    assert p.returncode == 3, show(p)
    last = p.stderr.decode().strip().splitlines()[-1]
    assert last.startswith(f"meshcomm launch: rank 1 on {SSH_ADDR} exited with code 3"), show(p)
    assert_no_leftovers(tmp_path, 3)


def test_ssh_stopped_rank_takes_its_children(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """A remote rank that ignores SIGTERM is killed with everything it started."""
    job = Launcher(
        "-n",
        "1",
        "--hosts",
        SSH_ADDR,
        *ssh_args(sshd, tmp_path),
        str(RANK_PROG),
        "wait-stubborn",
        piddir=tmp_path,
        nready=1,
    )
    job.wait_ready()
    assert len(recorded_pids(tmp_path)) == 2
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(timeout=30) == 143, job.text()
    assert_no_leftovers(tmp_path, 2)


def test_one_ssh_session_per_host_starts_and_stops_every_rank(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """5 ranks on 2 hosts: exactly 2 ssh processes while they run and 2 ssh calls in all
    (SIGTERM to the launcher stops every rank through those sessions, no further ssh)."""
    wrapper, log = logging_ssh(tmp_path, "/usr/bin/ssh" if os.path.exists("/usr/bin/ssh") else "ssh")
    ssh = sshd.ssh_command.replace("ssh", str(wrapper), 1)
    job = Launcher(
        "--hosts",
        TWO_HOSTS,
        "--ssh",
        ssh,
        "--env",
        f"MC_TEST_PIDDIR={tmp_path}",
        "--timeout",
        "120",
        str(RANK_PROG),
        "wait",
        piddir=tmp_path,
        nready=5,
    )
    job.wait_ready(timeout=90)
    assert len(recorded_pids(tmp_path)) == 5
    children = ssh_children(job.proc.pid)
    calls = log.read_text().splitlines()
    assert len(children) == 2, f"ssh processes of the launcher: {children}\n{calls}"
    assert len(calls) == 2 and all(c.endswith(" bash -s") for c in calls), calls
    assert sorted(c.split(" -- ")[1].split()[0] for c in calls) == [SSH_ADDR, f"root@{SSH_ADDR}"], calls
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(timeout=60) == 143, job.text()
    assert_no_leftovers(tmp_path, 5, grace=5)
    assert len(log.read_text().splitlines()) == 2, "stopping the ranks opened more ssh sessions"


def test_ssh_hosts_with_rank_counts_and_log_dir(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """--hosts a:3,b:2 without -n: 5 ranks, local rank variables per host, a log per rank."""
    logs = tmp_path / "logs"
    p = run_launch(
        "--hosts",
        TWO_HOSTS,
        *ssh_args(sshd, tmp_path),
        "--log-dir",
        str(logs),
        "--timeout",
        "60",
        str(RANK_PROG),
        "info",
        timeout=120,
    )
    assert p.returncode == 0, show(p)
    infos = parse_infos(p.stdout, 5)
    check_results(infos, 5)
    for r, info in infos.items():
        assert_through_ssh(info, sshd)
        local, size = (r, 3) if r < 3 else (r - 3, 2)
        assert (info["env"]["MLX_LOCAL_RANK"], info["env"]["MLX_LOCAL_SIZE"]) == (str(local), str(size)), info
        lines = (logs / f"rank-{r}.log").read_bytes().splitlines()
        assert [json.loads(x[5:])["rank"] for x in lines if x.startswith(b"INFO ")] == [r], lines
    assert sorted(f.name for f in logs.iterdir()) == [f"rank-{r}.log" for r in range(5)]
    assert_no_leftovers(tmp_path, 5)


def test_ssh_lines_never_interleave(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """Two ranks share one ssh session: their long lines still arrive whole, in order, each
    prefixed with its own rank."""
    lines = 100
    p = run_launch(
        "-n", "2", "--hosts", SSH_ADDR, *ssh_args(sshd, tmp_path), str(RANK_PROG), "spam", str(lines), timeout=120
    )
    assert p.returncode == 0, show(p)
    for data, stream in ((p.stdout, "out"), (p.stderr, "err")):
        seen: dict[int, list[int]] = {0: [], 1: []}
        for line in data.splitlines():
            m = PREFIX.match(line)
            assert m, f"std{stream} line without a prefix: {line[:120]!r}"
            text = m.group(2).decode()
            rank, st, i = text.split(":", 3)[:3]
            assert int(rank) == int(m.group(1)) and st == stream, text[:80]
            assert text == launch_rank.spam_line(int(rank), stream, int(i)), f"damaged line: {text[:120]!r}..."
            seen[int(rank)].append(int(i))
        assert seen == {0: list(range(lines)), 1: list(range(lines))}, f"std{stream}: lines missing or out of order"


JOBS_PROG = TESTS / "programs" / "launch_jobs.py"


def test_ssh_raising_rank_is_blamed_from_remote_records(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """Rank 2 (the second host) raises while the others wait: the agents send the failure
    records back, and the summary names rank 2 and its exception, not a PeerLostError."""
    p = run_launch(
        "--hosts",
        f"{SSH_ADDR}:2,root@{SSH_ADDR}:1",
        *ssh_args(sshd, tmp_path),
        "--timeout",
        "60",
        str(JOBS_PROG),
        "raise",
        "2",
        timeout=120,
    )
    assert p.returncode == 1, show(p)
    last = p.stderr.decode().strip().splitlines()[-1]
    assert last.startswith(f"meshcomm launch: rank 2 on root@{SSH_ADDR} exited with code 1 (KeyError"), show(p)
    assert_no_leftovers(tmp_path, 3)


def test_ssh_timeout_prints_every_ranks_stack(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """Rank 0 sleeps while 1 and 2 time out in all_sum: SIGUSR1 reaches every remote rank
    through its host's session, and each prints its Python stack. (Rank 0 leads its host
    in the sockets backend's two-level collectives, so both others name it.)"""
    p = run_launch(
        "--hosts",
        f"{SSH_ADDR}:2,root@{SSH_ADDR}:1",
        *ssh_args(sshd, tmp_path),
        "--timeout",
        "4",
        str(JOBS_PROG),
        "stuck",
        "0",
        timeout=120,
    )
    assert p.returncode == 1, show(p)
    assert b"every rank's Python stack follows" in p.stderr, show(p)
    frame = re.compile(rb'File "[^"]*launch_jobs\.py", line \d+,? in (\w+)')
    for r in range(3):
        text = b"\n".join(
            rest
            for tag, rest in (
                (int(m.group(1)), m.group(2)) for m in map(PREFIX.match, (p.stdout + p.stderr).splitlines()) if m
            )
            if tag == r
        )
        assert frame.findall(text), f"no Python stack of rank {r}:\n{show(p)}"
        if r == 0:
            assert b"stuck_here" in frame.findall(text), show(p)
    assert f"rank 0 on {SSH_ADDR} did not answer in time" in p.stderr.decode(), show(p)
    assert_no_leftovers(tmp_path, 3, grace=5)


def test_killed_launcher_stops_remote_ranks(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """SIGKILL to the launcher: its ssh sessions die with it, and each host's agent stops
    its ranks when its session ends."""
    job = Launcher(
        "--hosts",
        TWO_HOSTS,
        *ssh_args(sshd, tmp_path),
        "--timeout",
        "120",
        str(RANK_PROG),
        "wait",
        piddir=tmp_path,
        nready=5,
    )
    job.wait_ready(timeout=90)
    job.proc.kill()
    job.finish(timeout=30)
    assert_no_leftovers(tmp_path, 5, grace=20)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_other_backends_over_ssh(backend: str, sshd: LoopbackSshd, tmp_path: Path) -> None:
    """gloo: ranks started by the host agent; mpi: mpiexec's daemons started through the test
    sshd. Both: the rank variables and the [rank R] prefix as on sockets."""
    from meshcomm.runtime.registry import get_registry

    spec = get_registry().specs.get(backend)
    reason = f"backend {backend} is not installed" if spec is None else spec.unavailable_reason()
    if reason:
        pytest.skip(reason)
    env = None
    if backend == "mpi":
        from test_security_launch import _mpiexec_over_ssh

        env = {"MESHCOMM_MPIEXEC_ARGS": _mpiexec_over_ssh("mpi-ssh", sshd, tmp_path)}
    p = run_launch(
        "-n",
        "2",
        "--backend",
        backend,
        "--hosts",
        f"{SSH_ADDR}:2",
        *ssh_args(sshd, tmp_path),
        "--timeout",
        "60",
        str(RANK_PROG),
        "info",
        env=env,
        timeout=150,
    )
    assert p.returncode == 0, show(p)
    infos = parse_infos(p.stdout, 2)  # every line prefixed [rank R], no mpiexec tags
    for r, info in infos.items():
        assert info["backend"] == backend and info["size"] == 2, info
        assert info["env"]["MLX_RANK"] == str(r) and info["env"]["MLX_WORLD_SIZE"] == "2", info
        assert info["env"]["MLX_LOCAL_SIZE"] == "2", info
        assert info["env"]["SSH_CONNECTION"], f"rank {r} did not run over ssh"
    assert sorted(i["env"]["MLX_LOCAL_RANK"] for i in infos.values()) == ["0", "1"], infos
    assert_no_leftovers(tmp_path, 2, grace=5)


# -- network namespaces as hosts -----------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts() -> Iterator[NetnsHosts]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed (scripts/ci-system-deps.sh installs it)")
    try:
        h = NetnsHosts(3)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield h
    finally:
        h.close()


def netns_launch(
    hosts: NetnsHosts, n: int | None, piddir: Path, *prog: str, host_list: str | None = None, ssh: str | None = None
) -> subprocess.CompletedProcess[bytes]:
    count = [] if n is None else ["-n", str(n)]
    return run_launch(
        *count,
        "--hosts",
        host_list or ",".join(hosts.ips),
        "--ssh",
        ssh or hosts.ssh_command,
        "--env",
        f"MC_TEST_PIDDIR={piddir}",
        "--timeout",
        "60",
        str(RANK_PROG),
        *prog,
        env=hosts.env,
        timeout=120,
    )


@pytest.mark.parametrize("per_host", [1, 2])
def test_netns_hosts(hosts: NetnsHosts, per_host: int, tmp_path: Path) -> None:
    n = per_host * len(hosts.ips)
    p = netns_launch(hosts, n, tmp_path, "info")
    assert p.returncode == 0, show(p)
    infos = parse_infos(p.stdout, n)
    check_results(infos, n)
    for r, info in infos.items():
        h = r // per_host  # ranks are placed in blocks, host 0 first
        assert info["netns"] == f"net:[{hosts.ns_inode(h)}]", f"rank {r} ran outside {hosts.names[h]}"
        assert not os.path.exists(info["env"]["MLX_HOSTFILE"]), "the job's files were not removed"
    assert not hosts.running(), f"processes left in the namespaces: {hosts.running()}"
    assert_no_leftovers(tmp_path, n)


def test_netns_failing_rank(hosts: NetnsHosts, tmp_path: Path) -> None:
    t0 = time.monotonic()
    p = netns_launch(hosts, 3, tmp_path, "fail", "2", "5")
    assert p.returncode == 5, show(p)
    last = p.stderr.decode().strip().splitlines()[-1]
    assert last.startswith(f"meshcomm launch: rank 2 on {hosts.ips[2]} exited with code 5"), show(p)
    assert time.monotonic() - t0 < 30
    assert not hosts.running(), f"processes left in the namespaces: {hosts.running()}"
    assert_no_leftovers(tmp_path, 3)


def test_netns_rank_counts_one_session_per_host(hosts: NetnsHosts, tmp_path: Path) -> None:
    """--hosts ip0:1,ip1:2,ip2:1: ranks land on their hosts, and the "ssh" of the namespaces
    runs once per host."""
    counts = [1, 2, 1]
    wrapper, log = logging_ssh(tmp_path, hosts.ssh_command, name="netns-ssh")
    p = netns_launch(
        hosts,
        None,
        tmp_path,
        "info",
        ssh=str(wrapper),
        host_list=",".join(f"{ip}:{k}" for ip, k in zip(hosts.ips, counts, strict=True)),
    )
    assert p.returncode == 0, show(p)
    infos = parse_infos(p.stdout, 4)
    check_results(infos, 4)
    owner = [h for h, k in enumerate(counts) for _ in range(k)]
    for r, info in infos.items():
        assert info["netns"] == f"net:[{hosts.ns_inode(owner[r])}]", f"rank {r} ran outside {hosts.names[owner[r]]}"
        assert info["env"]["MLX_LOCAL_SIZE"] == str(counts[owner[r]]), info
    calls = log.read_text().splitlines()
    assert sorted(c.split()[0] for c in calls) == sorted(hosts.ips), calls
    assert not hosts.running(), f"processes left in the namespaces: {hosts.running()}"
    assert_no_leftovers(tmp_path, 4)


def test_netns_lost_rank_is_restarted_on_its_host_and_joins(hosts: NetnsHosts, tmp_path: Path) -> None:
    """--restart-lost over ssh: 4 ranks on 2 hosts, rank 3 (on the second host) is killed;
    the survivors shrink and go on, that host's agent starts a replacement (MESHCOMM_JOIN=1),
    and the survivors' grow() makes the world of 4 whole again across the hosts."""
    program = str(TESTS / "programs" / "survivors.py")
    p = run_launch(
        "-n",
        "4",
        "--hosts",
        f"{hosts.ips[0]}:2,{hosts.ips[1]}:2",
        "--ssh",
        hosts.ssh_command,
        "--restart-lost",
        "1",
        "--timeout",
        "20",
        program,
        "--kind",
        "sigkill",
        "--lose",
        "3",
        "--grow",
        env=hosts.env,
        timeout=120,
    )
    out = p.stdout.decode()
    assert p.returncode == 0, show(p)
    assert "[rank 3] JOINED as rank 3 of 4" in out, show(p)
    for r in range(4):
        assert f"[rank {r}] GROWN ok size=4 rank={r} agree=True" in out, show(p)
    for r in range(3):
        assert f"[rank {r}] RESULT ok size=3 rank={r} sum=6.0" in out, show(p)
    assert not hosts.running(), f"processes left in the namespaces: {hosts.running()}"


def test_netns_hosts_connecting_as_needed(hosts: NetnsHosts) -> None:
    """6 ranks over 3 namespace hosts, connecting only when needed: an all-sum, an all-gather
    and barriers need only the start-up peers; an all-to-all's first contacts then cross the
    bridge (authenticated: the links leave the host) until every rank holds every peer."""
    p = run_launch(
        "-n",
        "6",
        "--hosts",
        ",".join(hosts.ips),
        "--ssh",
        hosts.ssh_command,
        "--env",
        "MESHCOMM_SOCKETS_CONNECT=needed",
        "--timeout",
        "30",
        "--",
        str(CONNECT_PROG),
        "count",
        env=hosts.env,
        timeout=120,
    )
    from meshcomm_sockets.dialing import overlay  # only where the sockets plugin is (not in .venv-mpich)

    assert p.returncode == 0, show(p)
    said: dict[int, list[dict]] = {r: [] for r in range(6)}
    for r, line in prefixed_lines(p.stdout):
        said[r].append(json.loads(line))
    for r, lines in said.items():
        assert lines[-1] == {"error": None}, (r, show(p))
        held = {line["stage"]: line["sockets"] for line in lines if "stage" in line}
        # the start-up peers and the listener; after the all-to-all every peer (ranks 0 and 3,
        # 1 and 4 met first there)
        assert held == {
            "init": len(overlay(r, 6)) + 1,
            "all_sum, all_gather, barrier": len(overlay(r, 6)) + 1,
            "all_to_all": 6,
        }, (r, show(p))
    assert not hosts.running(), f"processes left in the namespaces: {hosts.running()}"
