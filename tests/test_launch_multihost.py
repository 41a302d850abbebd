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
"""

from __future__ import annotations

import json
import os
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
    RANK_PROG,
    TESTS,
    Launcher,
    assert_no_leftovers,
    check_results,
    parse_infos,
    recorded_pids,
    run_launch,
    show,
)

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


def assert_through_ssh(info: dict, server: LoopbackSshd) -> None:
    conn = info["env"]["SSH_CONNECTION"]
    assert conn is not None, f"rank {info['rank']} was not started over ssh"
    assert conn.split()[2:] == [SSH_ADDR, str(server.port)], f"rank {info['rank']}: SSH_CONNECTION={conn}"


def test_ssh_ranks(sshd: LoopbackSshd, tmp_path: Path) -> None:
    p = run_launch("-n", "2", "--hosts", SSH_ADDR, *ssh_args(sshd, tmp_path), "--env", "MC_TEST_A=x y",
                   "--timeout", "30", str(RANK_PROG), "info", "a b", timeout=90)
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
    p = run_launch("-n", "3", "--hostfile", str(hf), *ssh_args(sshd, tmp_path), str(RANK_PROG), "info",
                   timeout=90)
    assert p.returncode == 0, show(p)
    infos = parse_infos(p.stdout, 3)
    check_results(infos, 3)
    assert infos[0]["env"]["SSH_CONNECTION"] is None, "rank 0 (localhost) went through ssh"
    assert_through_ssh(infos[1], sshd)
    assert_through_ssh(infos[2], sshd)
    assert_no_leftovers(tmp_path, 3)


def test_ssh_failing_remote_rank_stops_the_job(sshd: LoopbackSshd, tmp_path: Path) -> None:
    p = run_launch("-n", "3", "--hosts", SSH_ADDR, *ssh_args(sshd, tmp_path), "--timeout", "120",
                   str(RANK_PROG), "fail", "1", "3", timeout=90)
    assert p.returncode == 3, show(p)
    last = p.stderr.decode().strip().splitlines()[-1]
    assert last.startswith(f"meshcomm launch: rank 1 on {SSH_ADDR} exited with code 3"), show(p)
    assert_no_leftovers(tmp_path, 3)


def test_ssh_stopped_rank_takes_its_children(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """A remote rank that ignores SIGTERM is killed with everything it started."""
    job = Launcher("-n", "1", "--hosts", SSH_ADDR, *ssh_args(sshd, tmp_path), str(RANK_PROG), "wait-stubborn",
                   piddir=tmp_path, nready=1)
    job.wait_ready()
    assert len(recorded_pids(tmp_path)) == 2
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(timeout=30) == 143, job.text()
    assert_no_leftovers(tmp_path, 2)


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


def netns_launch(hosts: NetnsHosts, n: int, piddir: Path, *prog: str) -> subprocess.CompletedProcess[bytes]:
    return run_launch("-n", str(n), "--hosts", ",".join(hosts.ips), "--ssh", hosts.ssh_command,
                      "--env", f"MC_TEST_PIDDIR={piddir}", "--timeout", "60", str(RANK_PROG), *prog,
                      env=hosts.env, timeout=120)


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
