"""A real Slurm cluster on this machine for the tests: munge, slurmctld and three slurmd "nodes".

Every daemon runs in a network namespace of its own with its own hostname (a UTS namespace)
and its own ``/etc/hosts`` (a private mount namespace with a bind mount), so Slurm, Open MPI
and meshcomm see three hosts ``h1``, ``h2``, ``h3`` (10.55.0.2-4) and a controller/login host
``ctl`` (10.55.0.1, which also holds the bridge). Nothing is added to the namespace the tests
run in: the bridge lives in ``ctl``'s namespace, and clients (``srun``, ``salloc``, ``sbatch``,
``mpirun``) are started inside ``ctl`` with :meth:`SlurmCluster.command`. Each node also runs
an sshd on port 22 (root, a throwaway key) for ``mpirun`` over ssh.

Everything the cluster owns is found again from fixed names, so tear-down needs no memory of
the run that made it: the directory :data:`BASE`, the namespaces ``mcslurm-*``, and the
processes inside them. :func:`teardown` kills every process in those namespaces (and the pids
recorded in ``BASE/pids``), deletes the namespaces (their veths and the bridge go with them)
and removes ``BASE``; it is idempotent and runs before every set-up too. A reaper process
started at set-up (``python tests/slurm.py reap``) waits for the end of a pipe from the test
process and tears down when it reads EOF, so a killed test run leaves nothing behind either.
At most one cluster exists per machine: a lock (an abstract unix socket, nothing on disk) is
held by the test process and the reaper.

Command line (also ``scripts/slurm-cluster.sh``)::

    python tests/slurm.py up      # bring the cluster up, print the SLURM_CONF line, and exit
    python tests/slurm.py down    # tear everything down (idempotent)
    python tests/slurm.py run CMD # run CMD on the login host (e.g. srun -N3 -n3 hostname)
    python tests/slurm.py hold    # up until stdin ends (a killed holder is torn down by its reaper)
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["SlurmCluster", "SlurmUnavailable", "teardown", "BASE", "NODES", "CTL_ADDR", "unavailable_reason"]

#: the cluster's name: its namespaces, directory and lock derive from it (a test of the
#: tear-down runs a second cluster under another name, MESHCOMM_TEST_SLURM_NAME)
NAME = os.environ.get("MESHCOMM_TEST_SLURM_NAME", "mcslurm")
BASE = Path(f"/tmp/meshcomm-slurm-{NAME}")
NS_PREFIX = f"{NAME}-"
CTL_NS = NS_PREFIX + "ctl"
SUBNET = "10.55.0"
CTL_ADDR = f"{SUBNET}.1"
#: node name -> address
NODES: dict[str, str] = {"h1": f"{SUBNET}.2", "h2": f"{SUBNET}.3", "h3": f"{SUBNET}.4"}
CPUS_PER_NODE = 4
LOCK_NAME = b"\0meshcomm-test-slurm-" + NAME.encode()
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be brought up on this machine (the exact reason in the message)."""


def _which(name: str) -> str | None:
    for cand in (shutil.which(name), f"/usr/sbin/{name}", f"/sbin/{name}", f"/usr/bin/{name}"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


TOOLS = (
    "slurmctld",
    "slurmd",
    "srun",
    "sinfo",
    "scontrol",
    "munged",
    "mungekey",
    "ip",
    "nsenter",
    "unshare",
    "sshd",
    "ssh",
    "ssh-keygen",
)


def unavailable_reason() -> str | None:
    """Why a cluster cannot be made here, or None."""
    if sys.platform != "linux":
        return f"the Slurm test cluster needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, slurmd as root)"
    missing = [t for t in TOOLS if _which(t) is None]
    if missing:
        return (
            f"not installed: {', '.join(missing)} (scripts/ci-system-deps.sh installs slurmctld, slurmd, "
            "slurm-client, munge, libpmix-dev, openssh-server, iproute2)"
        )
    return None


def _run(cmd: Sequence[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(cmd), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


# -- tear-down: from names alone -------------------------------------------------------------------------


def _our_namespaces() -> list[str]:
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.startswith(NS_PREFIX)]


def _ns_pids(ns: str) -> list[int]:
    p = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _recorded_pids() -> list[int]:
    pids = []
    d = BASE / "pids"
    if d.is_dir():
        for f in d.iterdir():
            try:
                pid, _, start = f.read_text().partition(" ")
                if _start_time(int(pid)) == start.strip():  # not a recycled pid
                    pids.append(int(pid))
            except (OSError, ValueError):
                pass
    return pids


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def teardown() -> None:
    """Stop every process the cluster started, delete its namespaces, remove its files.

    Idempotent; safe when nothing (or only part of a cluster) exists."""
    for _ in range(20):  # processes in our namespaces may still be forking (slurmstepd, ssh sessions)
        pids = _recorded_pids()
        for ns in _our_namespaces():
            pids += _ns_pids(ns)
        if not pids:
            break
        _kill_all(pids)
        time.sleep(0.1)
    for ns in _our_namespaces():
        _run(["ip", "netns", "del", ns], check=False)
    # a mount namespace kept a bind mount of BASE/hosts over /etc/hosts: gone with its processes
    shutil.rmtree(BASE, ignore_errors=True)


#: processes the daemons run by themselves (slurmd forks per request, slurmctld runs slurmscriptd,
#: sshd forks per connection)
DAEMON_HELPERS = {"slurmd", "slurmctld", "slurmscriptd", "munged", "sshd", None}


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


class _Lock:
    """An abstract unix socket bound under a fixed name: held while open, gone with the process."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock.bind(LOCK_NAME)
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.5)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()


# -- set-up -----------------------------------------------------------------------------------------------


SLURM_CONF = """\
ClusterName=meshcommci
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={base}/munge/munge.sock
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/slurmd-%n
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd-%n.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd-%n.log
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=2
MessageTimeout=20
TmpFS={base}/tmp/%n
SlurmctldHost=ctl({ctl})
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


class SlurmCluster:
    """Bring the cluster up (tearing down any leftover first); :meth:`close` tears it down."""

    def __init__(self, *, lock_timeout: float = 300, reaper: bool = True) -> None:
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        self.base = BASE
        self.conf = BASE / "slurm.conf"
        self.nodes = dict(NODES)
        self.ctl_addr = CTL_ADDR
        self._lock = _Lock()
        if not self._lock.acquire(lock_timeout):
            raise SlurmUnavailable(f"another test cluster held the lock for {lock_timeout:.0f} s")
        self._reaper: subprocess.Popen[bytes] | None = None
        t0 = time.monotonic()
        try:
            teardown()
            if reaper:
                self._start_reaper()
            self._up()
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - t0

    # the environment every client needs
    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _start_reaper(self) -> None:
        r, w = os.pipe()
        self._reaper = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "reap", str(self._lock.fileno())],
            stdin=r,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(self._lock.fileno(),),
            start_new_session=True,
        )
        os.close(r)
        self._reaper_pipe = w

    def _record(self, name: str, pid: int) -> None:
        (self.base / "pids" / name).write_text(f"{pid} {_start_time(pid)}")

    def _up(self) -> None:
        b = self.base
        for d in ("munge", "state", "run", "log", "pids", "ssh", "spool", "tmp"):
            (b / d).mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            (b / "spool" / f"slurmd-{n}").mkdir()
            (b / "tmp" / n).mkdir()
        b.chmod(0o755)
        (b / "tmp").chmod(0o1777)
        (b / "hosts").write_text(
            "127.0.0.1 localhost\n" + f"{self.ctl_addr} ctl\n" + "".join(f"{a} {n}\n" for n, a in self.nodes.items())
        )
        self._network()
        self._munge()
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={n} NodeAddr={a} CPUs={CPUS_PER_NODE}" for n, a in self.nodes.items()
        )
        self.conf.write_text(
            SLURM_CONF.format(base=b, ctl=self.ctl_addr, nodes=nodes, ctld_port=6817, slurmd_port=6818)
        )
        self._daemon("slurmctld", CTL_NS, "ctl", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            self._daemon(f"slurmd-{n}", NS_PREFIX + n, n, [_which("slurmd") or "slurmd", "-D", "-f", str(self.conf)])
        self._sshd()
        self._wait_idle()

    def _network(self) -> None:
        _run(["ip", "netns", "add", CTL_NS])
        _run(["ip", "-n", CTL_NS, "link", "set", "lo", "up"])
        _run(["ip", "-n", CTL_NS, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", CTL_NS, "addr", "add", f"{self.ctl_addr}/24", "dev", "br0"])
        _run(["ip", "-n", CTL_NS, "link", "set", "br0", "up"])
        for i, (n, addr) in enumerate(self.nodes.items()):
            ns = NS_PREFIX + n
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", CTL_NS, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", CTL_NS, "link", "set", f"v{i}", "master", "br0"])
            _run(["ip", "-n", CTL_NS, "link", "set", f"v{i}", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    def wrap(self, host: str, argv: Sequence[str]) -> list[str]:
        """argv run on ``host`` ("ctl" or a node): its network namespace, hostname and /etc/hosts.

        ``ip netns exec`` is not used: it remounts /sys, and slurmd then fails on /sys/fs/cgroup."""
        ns = CTL_NS if host == "ctl" else NS_PREFIX + host
        script = (
            f"hostname {shlex.quote(host)} && mount --bind {shlex.quote(str(self.base / 'hosts'))} /etc/hosts "
            f"&& exec {shlex.join(argv)}"
        )
        return [
            _which("nsenter") or "nsenter",
            f"--net=/run/netns/{ns}",
            _which("unshare") or "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
        ]

    def _daemon(self, name: str, ns: str, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        log = open(self.base / "log" / f"{name}.out", "wb")
        e = dict(os.environ)
        e.update(env or {})
        p = subprocess.Popen(
            self.wrap(host, argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=e,
        )
        log.close()
        self._record(name, p.pid)
        setattr(self, f"_proc_{name.replace('-', '_')}", p)

    def _munge(self) -> None:
        m = self.base / "munge"
        m.chmod(0o755)  # munged refuses a socket directory others cannot traverse
        _run([_which("mungekey") or "mungekey", "-c", "-k", str(m / "munge.key")])
        (m / "munge.key").chmod(0o600)
        self._daemon(
            "munged",
            CTL_NS,
            "ctl",
            [
                _which("munged") or "munged",
                "--foreground",
                f"--socket={m / 'munge.sock'}",
                f"--key-file={m / 'munge.key'}",
                f"--log-file={m / 'munged.log'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--seed-file={m / 'munged.seed'}",
                "--force",
            ],
        )
        deadline = time.monotonic() + 20
        while not (m / "munge.sock").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not make its socket: {self._logs('munged')}")
            time.sleep(0.05)

    def _sshd(self) -> None:
        s = self.base / "ssh"
        self.ssh_key = s / "client_key"
        for k in (s / "host_key", self.ssh_key):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)])
        (s / "authorized_keys").write_text(Path(str(self.ssh_key) + ".pub").read_text())
        (s / "authorized_keys").chmod(0o600)
        # MPICH's Hydra takes a program, not a command line, as its ssh (-launcher-exec)
        self.ssh_wrapper = s / "ssh-wrapper"
        self.ssh_wrapper.write_text(f'#!/bin/sh\nexec {self.ssh_command} "$@"\n')
        self.ssh_wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        for n, addr in self.nodes.items():
            conf = s / f"sshd_config-{n}"
            conf.write_text(
                "\n".join(
                    [
                        f"ListenAddress {addr}:22",
                        f"HostKey {s / 'host_key'}",
                        f"AuthorizedKeysFile {s / 'authorized_keys'}",
                        f"PidFile {self.base / 'run' / f'sshd-{n}.pid'}",
                        "PermitRootLogin prohibit-password",
                        "PubkeyAuthentication yes",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "StrictModes no",
                        "UsePAM no",
                        "X11Forwarding no",
                        "PrintMotd no",
                        "LogLevel ERROR",
                        "MaxStartups 100",
                        "MaxSessions 100",
                        "AcceptEnv MC_* MLX_* MESHCOMM_*",
                        "",
                    ]
                )
            )
            self._daemon(f"sshd-{n}", NS_PREFIX + n, n, [_which("sshd") or "sshd", "-D", "-e", "-f", str(conf)])

    @property
    def ssh_command(self) -> str:
        """An ``ssh`` that reaches every node's sshd as root (for mpirun's plm_ssh_agent)."""
        return shlex.join(
            [
                "ssh",
                "-i",
                str(self.ssh_key),
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "BatchMode=yes",
                "-o",
                "LogLevel=ERROR",
                "-o",
                "IdentitiesOnly=yes",
                "-F",
                "/dev/null",
            ]
        )

    def _logs(self, *names: str) -> str:
        out = []
        for f in sorted((self.base / "log").glob("*")):
            if not names or any(f.name.startswith(n) for n in names):
                try:
                    out.append(f"--- {f.name}\n{f.read_text()[-3000:]}")
                except OSError:
                    pass
        return "\n".join(out)

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            p = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15, check=False)
            states = dict(line.split() for line in p.stdout.splitlines() if len(line.split()) == 2)
            if p.returncode == 0 and set(states) == set(self.nodes) and all(s == "idle" for s in states.values()):
                ssh_ok = all(self.ssh(n, "true", timeout=10).returncode == 0 for n in self.nodes)
                if ssh_ok:
                    return
                last = "sshd not answering yet"
            else:
                last = p.stdout + p.stderr
            time.sleep(0.3)
        raise RuntimeError(
            f"the Slurm nodes did not become idle in {timeout:.0f} s (sinfo: {last.strip()})\n{self._logs()}"
        )

    # -- clients -------------------------------------------------------------------------------------

    def command(self, argv: Sequence[str], host: str = "ctl") -> list[str]:
        """argv as run on the login host ``ctl`` (or a node) with this cluster's SLURM_CONF."""
        return self.wrap(host, ["env", f"SLURM_CONF={self.conf}", *argv])

    def run(
        self,
        argv: Sequence[str],
        *,
        host: str = "ctl",
        timeout: float = 120,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (``srun``, ``sbatch`` ...) on ``host`` and wait (always with a timeout:
        an srun asking for more than the nodes have would wait forever)."""
        e = dict(os.environ)
        e.update(env or {})
        p = subprocess.run(
            self.command(argv, host),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=e,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and p.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p

    def ssh(self, node: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return self.run([*shlex.split(self.ssh_command), self.nodes[node], command], timeout=timeout, check=False)

    def running(self) -> dict[str, list[int]]:
        """Processes in the cluster's namespaces other than the daemons (recorded pids) and the
        processes they fork by themselves (:data:`DAEMON_HELPERS`): what jobs left running."""
        daemons = set(_recorded_pids())
        out = {}
        for ns in _our_namespaces():
            extra = [pid for pid in _ns_pids(ns) if pid not in daemons and _comm(pid) not in DAEMON_HELPERS]
            if extra:
                out[ns] = extra
        return out

    @staticmethod
    def describe(procs: Mapping[str, Sequence[int]]) -> str:
        """``running()``'s answer with each process's command line."""
        out = []
        for ns, pids in procs.items():
            for pid in pids:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    cmd = "(gone)"
                out.append(f"{ns} pid {pid} ({_comm(pid)}): {cmd[:200]}")
        return "; ".join(out)

    def close(self) -> None:
        teardown()
        if self._reaper is not None:
            os.close(self._reaper_pipe)
            try:
                self._reaper.wait(60)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
                self._reaper.wait()
            self._reaper = None
        self._lock.close()


def _reap(lock_fd: int) -> None:
    """Wait for EOF on stdin (the test process closed the pipe or died), then tear down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        while os.read(0, 4096):
            pass
    finally:
        teardown()
        os.close(lock_fd)


_session: SlurmCluster | BaseException | None = None


def session_cluster(config: object) -> SlurmCluster:
    """The one cluster of a pytest session (several test modules share it), torn down when
    pytest ends (``config.add_cleanup``), or by the reaper if pytest is killed. Skips with the
    exact reason when Slurm cannot run here; a failure to bring it up as root with every tool
    installed is an error, not a skip."""
    import pytest

    global _session
    if _session is None:
        try:
            c = SlurmCluster()
        except SlurmUnavailable as exc:
            _session = exc
        except BaseException as exc:
            _session = exc
            raise
        else:
            _session = c

            def _close() -> None:
                global _session
                c.close()
                _session = None

            config.add_cleanup(_close)  # type: ignore[attr-defined]
    if isinstance(_session, SlurmUnavailable):
        pytest.skip(f"no Slurm test cluster: {_session}")
    if isinstance(_session, BaseException):
        raise RuntimeError(f"the Slurm test cluster failed to start: {_session}")
    return _session


def main(argv: Sequence[str]) -> int:
    what = argv[0] if argv else ""
    if what == "reap":
        _reap(int(argv[1]))
        return 0
    if what == "down":
        lock = _Lock()
        if not lock.acquire(30):
            print("slurm.py down: a test cluster is in use (its owner tears it down)", file=sys.stderr)
            return 1
        teardown()
        lock.close()
        return 0
    if what == "hold":  # up with a reaper, print UP, tear down at the end of stdin
        try:
            c = SlurmCluster()
        except SlurmUnavailable as exc:
            print(f"slurm.py hold: {exc}", file=sys.stderr)
            return 2
        print(f"UP {c.setup_seconds:.1f}", flush=True)
        while sys.stdin.buffer.read(4096):
            pass
        c.close()
        return 0
    if what == "up":
        try:
            c = SlurmCluster(reaper=False)
        except SlurmUnavailable as exc:
            print(f"slurm.py up: {exc}", file=sys.stderr)
            return 2
        print(f"up in {c.setup_seconds:.1f} s; clients: python tests/slurm.py run srun -N3 -n3 hostname")
        print(f"SLURM_CONF={c.conf}")
        return 0
    if what == "run":
        if not (BASE / "slurm.conf").exists():
            print("slurm.py run: no cluster (python tests/slurm.py up)", file=sys.stderr)
            return 1
        c = SlurmCluster.__new__(SlurmCluster)
        c.base, c.conf, c.nodes = BASE, BASE / "slurm.conf", dict(NODES)
        return subprocess.call(c.command(argv[1:]))
    print(__doc__.split("Command line")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
