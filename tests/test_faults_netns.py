"""Faults of a sockets job whose ranks run on several "hosts" (network namespaces, tests/netns.py).

Ranks are started directly with ``ip netns exec NS python ...`` (no launcher, which would
stop the survivors as soon as one rank dies) and a hostfile of the namespaces' addresses.
Each test injects one fault and measures how long after it every rank failed; the bound is
only "no hang": ``MLX_TIMEOUT`` plus a generous margin. The measured times are printed
(``pytest -s``) as ``FAULT-TIMING`` lines.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import ROOT, finish
from netns import NetnsHosts, NetnsUnavailable

PROG = str(ROOT / "tests" / "programs" / "netns_faults.py")
TIMEOUT = 5  # MLX_TIMEOUT of these jobs, seconds
MARGIN = 15  # "did not hang": every rank fails within TIMEOUT + MARGIN of the fault


def _lines(out: str) -> list[dict]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def _timing(what: str, seconds: dict[int, float]) -> None:
    shown = ", ".join(f"rank {r}: {s:.2f} s" for r, s in sorted(seconds.items()))
    print(f"\nFAULT-TIMING {what}: {shown}", flush=True)


def _make_hosts(k: int) -> NetnsHosts:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed (scripts/ci-system-deps.sh installs it)")
    try:
        return NetnsHosts(k)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hosts4() -> Iterator[NetnsHosts]:
    """Four hosts for the faults that leave the network as it was."""
    h = _make_hosts(4)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def fresh_hosts() -> Iterator[list[NetnsHosts]]:
    """Hosts of their own for a test that breaks links: ``fresh_hosts.append(_make_hosts(k))``."""
    made: list[NetnsHosts] = []
    try:
        yield made
    finally:
        for h in made:
            h.close()


class Job:
    """Ranks of one job placed in blocks on ``hosts`` (``per_host`` ranks each)."""

    def __init__(self, hosts: NetnsHosts, n: int, per_host: int, tmp: Path, *, ips: list[str] | None = None) -> None:
        self.hosts, self.n, self.per_host = hosts, n, per_host
        self.ips = ips or [hosts.ips[r // per_host] for r in range(n)]
        base = random.randrange(20000, 40000)  # the namespaces stay for the module: avoid TIME_WAIT ports
        self.ports = [base + r for r in range(n)]
        self.hostfile = tmp / "hostfile.json"
        self.hostfile.write_text(
            json.dumps([{"ip": ip, "port": p} for ip, p in zip(self.ips, self.ports, strict=True)])
        )
        self.procs: dict[int, subprocess.Popen[str]] = {}

    def ns(self, r: int) -> str:
        return self.hosts.names[r // self.per_host]

    def start(
        self,
        mode: str,
        ranks: list[int] | None = None,
        env: dict[str, str] | None = None,
        argv: list[str] | None = None,
    ) -> None:
        for r in range(self.n) if ranks is None else ranks:
            e = {
                **os.environ,
                "MLX_BACKEND": "sockets",
                "MLX_RANK": str(r),
                "MLX_HOSTFILE": str(self.hostfile),
                "MLX_TIMEOUT": str(TIMEOUT),
                "MESHCOMM_JOB_SECRET": "netns-test",
                "PYTHONUNBUFFERED": "1",
                # each namespace is a host of its own: it shares no memory with the others (the
                # launcher sets this for remote ranks; the namespaces share one /dev/shm here)
                "MESHCOMM_HOST_ID": self.ns(r),
                **(env or {}),
            }
            self.procs[r] = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(r), sys.executable, *(argv or [PROG, mode])],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )

    def wait_ready(self, timeout: float = 60, word: str = "") -> None:
        """Until every rank printed its first line (it is inside the collective loop), or the
        line ``word`` when given."""
        deadline = time.monotonic() + timeout
        for r, p in self.procs.items():
            assert p.stdout is not None
            while True:
                line = p.stdout.readline()
                if (line.strip() == word) if word else (line.startswith("{") and json.loads(line).get("ready") == r):
                    break
                if not line or time.monotonic() > deadline:
                    _, err = p.communicate(timeout=10)
                    raise AssertionError(f"rank {r} never got ready: {line!r} {err[-2000:]}")

    def finish(self, timeout: float = TIMEOUT + MARGIN + 30) -> dict[int, tuple[int, str, str]]:
        return finish(self.procs, timeout=timeout)


def _first_error(results: dict[int, tuple[int, str, str]], r: int) -> dict:
    rc, out, err = results[r]
    lines = [ln for ln in _lines(out) if "error" in ln]
    assert lines, f"rank {r} reported nothing (rc {rc}): {out[-2000:]} {err[-2000:]}"
    return lines[0]


# -- (a) a rank killed mid-collective ------------------------------------------------------------


@pytest.mark.parametrize("nhosts,per_host", [(4, 1), (2, 2)], ids=["4hosts", "2hosts-2each"])
def test_killed_rank_every_survivor_names_it(hosts4: NetnsHosts, tmp_path: Path, nhosts: int, per_host: int) -> None:
    n = 4
    job = Job(hosts4, n, per_host, tmp_path)
    job.start("loop")
    job.wait_ready()
    victim = 2
    time.sleep(0.3)
    t_fault = time.time()
    os.kill(job.procs[victim].pid, signal.SIGKILL)  # `ip netns exec` execs python: this is the rank
    results = job.finish()
    assert results[victim][0] == -signal.SIGKILL
    took = {}
    for r in range(n):
        if r == victim:
            continue
        first = _first_error(results, r)
        assert first["error"] == "PeerLostError", (r, first, results[r][2][-2000:])
        assert first["peer"] == victim, first
        assert f"rank {victim}" in first["message"], first
        took[r] = first["t"] - t_fault
        assert took[r] < TIMEOUT + MARGIN, first
    _timing(f"SIGKILL of rank {victim}, {n} ranks on {nhosts} hosts", took)


# -- (b) a link cut mid-collective ---------------------------------------------------------------


def test_cut_link_survivors_raise_naming_a_rank(fresh_hosts: list[NetnsHosts], tmp_path: Path) -> None:
    hosts = _make_hosts(3)
    fresh_hosts.append(hosts)
    n = 3
    job = Job(hosts, n, 1, tmp_path)
    job.start("loop")
    job.wait_ready()
    cut = 1
    time.sleep(0.3)
    t_fault = time.time()
    subprocess.run(["ip", "-n", hosts.names[cut], "link", "set", "eth0", "down"], check=True, timeout=30)
    results = job.finish()
    took = {}
    for r in range(n):
        first = _first_error(results, r)
        took[r] = first["t"] - t_fault
        assert took[r] < TIMEOUT + MARGIN, results
        if r == cut:
            continue  # the cut-off rank fails too, in whatever way its kernel reports
        assert first["error"] in ("CommTimeoutError", "PeerLostError"), (r, first)
        assert isinstance(first["peer"], int) and f"rank {first['peer']}" in first["message"], first
    _timing(f"eth0 down on the host of rank {cut} (3 hosts, MLX_TIMEOUT={TIMEOUT}; rank {cut} is the cut one)", took)
    for r in range(n):
        print(f"  rank {r}: {_first_error(results, r)['error']}: {_first_error(results, r)['message'][:160]}")


# -- (c) a slow link -----------------------------------------------------------------------------


def _tc(hosts: NetnsHosts, i: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", hosts.names[i], "tc", "qdisc", "add", "dev", "eth0", "root", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def _kernel_netem() -> str:
    """What the running kernel's config says about netem, when it tells."""
    try:
        config = gzip.decompress(Path("/proc/config.gz").read_bytes()).decode()
    except OSError:
        return ""
    line = next((ln for ln in config.splitlines() if "CONFIG_NET_SCH_NETEM" in ln), "")
    return f" (kernel config: {line.strip()})" if line else ""


def _run_check(hosts: NetnsHosts, tmp_path: Path, n: int) -> dict[int, dict]:
    job = Job(hosts, n, 1, tmp_path)
    job.start("check", env={"MLX_TIMEOUT": "60"})
    results = job.finish(timeout=180)
    out = {}
    for r in range(n):
        lines = _lines(results[r][1])
        assert lines and lines[-1].get("ok") is True, (r, results[r][1][-2000:], results[r][2][-2000:])
        out[r] = lines[-1]
    return out


def test_slow_lossy_link_netem(fresh_hosts: list[NetnsHosts], tmp_path: Path) -> None:
    if shutil.which("tc") is None:
        pytest.skip("tc (iproute2) is not installed")
    hosts = _make_hosts(3)
    fresh_hosts.append(hosts)
    fast = _run_check(hosts, tmp_path, 3)
    p = _tc(hosts, 1, "netem", "delay", "20ms", "loss", "1%")
    if p.returncode != 0:
        pytest.skip(
            f"the kernel refuses netem: `tc qdisc add dev eth0 root netem delay 20ms loss 1%` -> "
            f"{p.stderr.strip()}{_kernel_netem()}"
        )
    slow = _run_check(hosts, tmp_path, 3)
    _timing("check on 3 hosts, no netem", {r: v["seconds"] for r, v in fast.items()})
    _timing("check on 3 hosts, rank 1's link netem delay 20ms loss 1%", {r: v["seconds"] for r, v in slow.items()})
    assert max(v["seconds"] for v in slow.values()) > max(v["seconds"] for v in fast.values())


def test_slow_link_rate_limited(fresh_hosts: list[NetnsHosts], tmp_path: Path) -> None:
    """The same with a token-bucket rate limit (tbf), which kernels without netem have."""
    if shutil.which("tc") is None:
        pytest.skip("tc (iproute2) is not installed")
    hosts = _make_hosts(3)
    fresh_hosts.append(hosts)
    fast = _run_check(hosts, tmp_path, 3)
    p = _tc(hosts, 1, "tbf", "rate", "100mbit", "burst", "32kb", "latency", "50ms")
    if p.returncode != 0:
        pytest.skip(f"the kernel refuses tbf: {p.stderr.strip()}")
    slow = _run_check(hosts, tmp_path, 3)
    _timing("check on 3 hosts, unlimited", {r: v["seconds"] for r, v in fast.items()})
    _timing("check on 3 hosts, rank 1's eth0 limited to 100 Mbit/s (tbf)", {r: v["seconds"] for r, v in slow.items()})
    stats = subprocess.run(
        ["ip", "netns", "exec", hosts.names[1], "tc", "-s", "qdisc", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    # that the limit held is read from the limiter, not from comparing two runs' times (a
    # loaded host can make the unlimited run the slower): it delayed packets of the job
    # (overlimits), and no run through it can beat its rate, start-up's bytes aside
    found = re.search(r"Sent (\d+) bytes .*overlimits (\d+)", " ".join(stats.split()))
    assert found, stats
    sent, overlimits = int(found[1]), int(found[2])
    assert sent > 4 << 20 and overlimits > 0, stats
    rate = 100e6 / 8
    assert max(v["seconds"] for v in slow.values()) >= (sent - (1 << 20)) / rate, (stats, slow)


# -- (d) a rank that never starts ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["no-process", "no-host"])
def test_rank_that_never_starts(hosts4: NetnsHosts, tmp_path: Path, where: str) -> None:
    """Rank 1's host is up but nothing listens there, or its address belongs to no host at all."""
    ips = list(hosts4.ips[:3])
    if where == "no-host":
        ips[1] = hosts4.ips[0].rsplit(".", 1)[0] + ".250"  # same subnet, nobody answers ARP
    job = Job(hosts4, 3, 1, tmp_path, ips=ips)
    missing = f"{ips[1]}:{job.ports[1]}"
    t0 = time.time()
    job.start("ok", ranks=[0, 2])
    results = job.finish()
    took = {}
    for r in (0, 2):
        first = _first_error(results, r)
        assert first["phase"] == "init" and first["error"] == "CommTimeoutError", (r, first)
        assert first["peer"] == 1 and missing in first["message"], first
        took[r] = first["t"] - t0
        assert took[r] < TIMEOUT + MARGIN
    _timing(f"rank 1 never started ({where}, MLX_TIMEOUT={TIMEOUT}); time from start", took)
    print(
        f"  rank 0: {_first_error(results, 0)['message'][:200]}\n  rank 2: {_first_error(results, 2)['message'][:200]}"
    )


# -- (e) a port already in use -------------------------------------------------------------------


def test_port_in_use_on_a_host(hosts4: NetnsHosts, tmp_path: Path) -> None:
    job = Job(hosts4, 3, 1, tmp_path)
    blocker = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            hosts4.names[0],
            sys.executable,
            "-c",
            "import socket, sys, time\n"
            f"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('0.0.0.0', {job.ports[0]})); s.listen(); print('up', flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert blocker.stdout is not None and blocker.stdout.readline().strip() == "up"
        t0 = time.time()
        job.start("ok")
        results = job.finish()
    finally:
        blocker.kill()
        blocker.wait()
    r0 = _first_error(results, 0)
    assert r0["phase"] == "init" and "already in use" in r0["message"], r0
    assert f"{hosts4.ips[0]}:{job.ports[0]}" in r0["message"], r0
    took = {0: r0["t"] - t0}
    for r in (1, 2):  # the others cannot reach a real rank 0: they fail at start-up naming it
        first = _first_error(results, r)
        assert first["phase"] == "init" and first["peer"] == 0, first
        took[r] = first["t"] - t0
        assert took[r] < TIMEOUT + MARGIN
    _timing(f"port of rank 0 in use on its host (MLX_TIMEOUT={TIMEOUT}); time from start", took)
    for r in range(3):
        print(f"  rank {r}: {_first_error(results, r)['message'][:220]}")


# -- (e) survivors go on after a host is lost ----------------------------------------------------


@pytest.mark.parametrize("nhosts", [2, 3])
def test_survivors_shrink_when_a_host_is_lost(fresh_hosts: list[NetnsHosts], tmp_path: Path, nhosts: int) -> None:
    """2 ranks on each of 2 or 3 hosts sum in a loop; the last host is lost the way a machine
    that loses power is: its link goes down first (no reset or FIN ever reaches the others),
    then its ranks die. The survivors time out on them, shrink (the agreement waits
    MLX_TIMEOUT for the silent ranks), and their next all_sum gives the survivors' sum."""
    hosts = _make_hosts(nhosts)
    fresh_hosts.append(hosts)
    n = 2 * nhosts
    lost, alive = [n - 2, n - 1], list(range(n - 2))
    job = Job(hosts, n, 2, tmp_path)
    argv = [str(ROOT / "tests" / "programs" / "survivors.py"), "--kind", "external", "--lose", f"{n - 2},{n - 1}"]
    job.start("", env={"MLX_TIMEOUT": "3"}, argv=argv)
    job.wait_ready(word="READY")
    time.sleep(0.3)
    subprocess.run(["ip", "-n", hosts.names[-1], "link", "set", "eth0", "down"], check=True, timeout=30)
    for r in lost:
        os.kill(job.procs[r].pid, signal.SIGKILL)
    t_fault = time.time()
    results = job.finish()
    want = float(sum(r + 1 for r in alive))
    for new, r in enumerate(alive):
        rc, out, err = results[r]
        assert rc == 0, (r, out[-3000:], err[-3000:])
        assert f"RESULT ok size={len(alive)} rank={new} sum={want}" in out, (r, out[-3000:])
        assert "AGREE True False 5" in out, (r, out[-3000:])
    firsts = {
        r: float(line.rsplit(" ", 1)[1]) - t_fault
        for r in alive
        for line in results[r][1].splitlines()
        if line.startswith("FIRST-COLLECTIVE")
    }
    _timing(f"the last of {nhosts} hosts lost (link down, then its 2 ranks killed), MLX_TIMEOUT=3", firsts)
