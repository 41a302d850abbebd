"""Attacks on ``meshcomm launch`` (issue 14, items 6 and 7), each kept as a real-process test.

* a hostfile ``envs`` key that is shell code (``$(touch MARKER)X=1``): rejected like a bad
  ``--env``, before any rank starts; the marker file is never created;
* a host entry whose ``ssh`` field (or ``--hosts`` name) starts with ``-``
  (``-oProxyCommand=...``): rejected before any ssh runs; ssh's argv puts ``--`` before
  the host;
* the remote job directory made first by another user (uid 65534), as a directory or a
  symlink: the rank refuses it with a clear error, writes nothing into it, and the
  launcher does not delete it;
* the job secret (and ``--env`` values) on a command line: no process of the job (mpiexec,
  its daemons, ranks, ssh) and no process of this machine has it in ``/proc/PID/cmdline``
  while the job runs, on sockets (local and over ssh), gloo, Open MPI and MPICH;
  ``--verbose`` never prints it.

The ssh cases use the private sshd on 127.0.0.2 of ``tests/sshd.py``. The other uid's
directory needs root (``chown``); the tests run as root here and skip otherwise.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sshd import LoopbackSshd, SshdUnavailable, find_sshd
from test_launch import TESTS, assert_no_leftovers, job_env, recorded_pids, show

REPO = TESTS.parent
MPICH_PY = REPO / ".venv-mpich" / "bin" / "python"
SSH_ADDR = "127.0.0.2"
STRANGER = 65534  # nobody


@pytest.fixture(scope="module")
def sshd() -> Iterator[LoopbackSshd]:
    if find_sshd() is None:
        pytest.skip("sshd is not installed (scripts/ci-system-deps.sh installs it)")
    try:
        server = LoopbackSshd(SSH_ADDR)
    except SshdUnavailable as exc:
        if os.geteuid() == 0:
            raise
        pytest.skip(f"cannot run a private sshd: {exc}")
    yield server
    server.stop()


#: the rank program of these tests (written to each test's tmp_path): records its pid like
#: tests/programs/launch_rank.py, then ``env NAME...`` prints ``ENV {json}`` of those
#: variables; ``wait [init]`` (after mc.init() and a barrier) prints ``ready`` and sleeps
PROG = """
import json, os, sys, time
d = os.environ.get("MC_TEST_PIDDIR")
if d:
    with open(os.path.join(d, f"rank-{os.environ.get('MLX_RANK', 'x')}-{os.getpid()}.pid"), "w") as f:
        f.write(str(os.getpid()))
if sys.argv[1] == "env":
    print("ENV " + json.dumps({k: os.environ.get(k) for k in sys.argv[2:]}), flush=True)
elif sys.argv[1] == "wait":
    if sys.argv[2:] == ["init"]:
        import meshcomm as mc
        mc.init(strict=True).barrier()
    print("ready", flush=True)
    time.sleep(600)
"""


def rank_prog(folder: Path) -> str:
    path = folder / "rank_prog.py"
    path.write_text(PROG)
    return str(path)


def launch(
    *args: str, python: str = sys.executable, env: dict[str, str] | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [python, "-m", "meshcomm", "launch", *args],
        capture_output=True,
        timeout=timeout,
        env={**job_env(), **(env or {})},
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )


def error_line(p: subprocess.CompletedProcess[bytes]) -> str:
    lines = p.stderr.decode(errors="replace").strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshcomm launch: error: "), show(p)
    return lines[0]


def ssh_wrapper(folder: Path, body: str = "") -> Path:
    """An ``ssh`` (named so: the launcher adds ``--`` for ssh) that logs each call, runs
    ``body`` (bash) and then the real ssh."""
    real = "/usr/bin/ssh" if os.path.exists("/usr/bin/ssh") else "ssh"
    bindir = folder / "bin"
    bindir.mkdir(exist_ok=True)
    path = bindir / "ssh"
    path.write_text(f'#!/bin/bash\nprintf \'%s\\n\' "$*" >> {folder / "ssh-calls.log"}\n{body}\nexec {real} "$@"\n')
    path.chmod(0o755)
    return path


# -- item 6: hostfile envs keys -------------------------------------------------------------------

BAD_KEYS = ["$(touch {m})X", "A;touch {m};B", "`touch {m}`", "A B", "1A", "A-B", "Ä"]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_hostfile_env_key_is_not_shell_code(key: str, sshd: LoopbackSshd, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"hosts": [{"ssh": SSH_ADDR}], "envs": [key.format(m=marker) + "=1"]}))
    p = launch(
        "-n",
        "1",
        "--hostfile",
        str(hf),
        "--ssh",
        sshd.ssh_command,
        "--env",
        f"MC_TEST_PIDDIR={tmp_path}",
        rank_prog(tmp_path),
        "env",
        "X",
    )
    assert not marker.exists(), "the hostfile's envs key ran as shell code on the remote host\n" + show(p)
    assert p.returncode == 2, show(p)
    err = error_line(p)
    assert "envs" in err and "shell" in err and "identifier" in err, err
    assert not recorded_pids(tmp_path) and p.stdout == b"", "a rank was started"


@pytest.mark.parametrize("where", ["--env", "hostfile"])
def test_bad_env_key_rejected_for_local_jobs_too(where: str, tmp_path: Path) -> None:
    args = ["--env", "1A=x"]
    if where == "hostfile":
        hf = tmp_path / "hosts.json"
        hf.write_text(json.dumps({"hosts": [{"ssh": "localhost"}], "envs": ["1A=x"]}))
        args = ["--hostfile", str(hf)]
    p = launch("-n", "1", *args, rank_prog(tmp_path), "env")
    assert p.returncode == 2, show(p)
    err = error_line(p)
    assert "'1A'" in err and "identifier" in err, err


def test_env_values_are_passed_literally(sshd: LoopbackSshd, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    value = f"$(touch {marker})'\"; touch {marker} `touch {marker}`\nsecond line"
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"hosts": [{"ssh": SSH_ADDR}], "envs": ["MC_TEST_A=" + value]}))
    p = launch(
        "-n",
        "1",
        "--hostfile",
        str(hf),
        "--ssh",
        sshd.ssh_command,
        "--env",
        f"MC_TEST_B={value}",
        "--env",
        f"MC_TEST_PIDDIR={tmp_path}",
        rank_prog(tmp_path),
        "env",
        "MC_TEST_A",
        "MC_TEST_B",
        "SSH_CONNECTION",
    )
    assert p.returncode == 0, show(p)
    assert not marker.exists(), "an envs value ran as shell code"
    env = json.loads(p.stdout.split(b"ENV ", 1)[1].splitlines()[0])
    assert env["MC_TEST_A"] == value and env["MC_TEST_B"] == value, env
    assert env["SSH_CONNECTION"], "the rank did not run over ssh"
    assert_no_leftovers(tmp_path, 1)


# -- item 6: ssh options in host fields -------------------------------------------------------------

BAD_HOSTS = {
    "ssh field": lambda m: ["--hostfile", json.dumps([{"ssh": f"-oProxyCommand=touch${{IFS}}{m}"}])],
    "ssh field after user@": lambda m: ["--hostfile", json.dumps([{"ssh": f"root@-oProxyCommand=touch${{IFS}}{m}"}])],
    "plain list": lambda m: ["--hostfile", json.dumps([f"-oProxyCommand=touch${{IFS}}{m}"])],
    "--hosts": lambda m: [f"--hosts=-oProxyCommand=touch${{IFS}}{m}"],
    "ips": lambda m: ["--hostfile", json.dumps([{"ssh": SSH_ADDR, "ips": [f"-oProxyCommand=touch${{IFS}}{m}"]}])],
    "shell characters": lambda m: ["--hostfile", json.dumps([{"ssh": f"h;touch${{IFS}}{m}"}])],
}


@pytest.mark.parametrize("case", list(BAD_HOSTS))
def test_ssh_option_in_host_is_rejected_before_ssh_runs(case: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    args = BAD_HOSTS[case](marker)
    if args[0] == "--hostfile":
        hf = tmp_path / "hosts.json"
        hf.write_text(args[1])
        args = ["--hostfile", str(hf)]
    wrapper = ssh_wrapper(tmp_path)
    p = launch("-n", "2", *args, "--ssh", f"{wrapper} -o BatchMode=yes -o ConnectTimeout=5", rank_prog(tmp_path), "env")
    assert not marker.exists(), "ssh ran the host field's ProxyCommand\n" + show(p)
    calls = tmp_path / "ssh-calls.log"
    assert not calls.exists(), f"ssh was run: {calls.read_text()}\n{show(p)}"
    assert p.returncode == 2, show(p)
    err = error_line(p)
    assert "-oProxyCommand" in err or "h;touch" in err, err
    assert "ssh option" in err or "not a host name" in err, err


def test_ssh_gets_double_dash_before_the_host(sshd: LoopbackSshd, tmp_path: Path) -> None:
    wrapper = ssh_wrapper(tmp_path)
    ssh = sshd.ssh_command.replace("ssh", str(wrapper), 1)
    p = launch(
        "-n",
        "1",
        "--hosts",
        SSH_ADDR,
        "--ssh",
        ssh,
        "--verbose",
        "--env",
        f"MC_TEST_PIDDIR={tmp_path}",
        rank_prog(tmp_path),
        "env",
    )
    assert p.returncode == 0, show(p)
    calls = (tmp_path / "ssh-calls.log").read_text().splitlines()
    assert calls and calls[0].endswith(f"-- {SSH_ADDR} bash -s"), calls
    assert all(f" -- {SSH_ADDR} " in c for c in calls), calls  # signals and clean-up too


# -- item 6: the remote job directory -------------------------------------------------------------

#: the "other user" on the remote host (here: the same machine, as root): it finds the job's
#: directory by its launcher's pid, moves ours aside and puts its own in its place, before
#: the ssh session that would create it runs
SQUAT = r"""
if [ "${@: -1}" = "bash -s" ]; then
  for f in "$TMPDIR"/meshcomm-*/.launcher-pid; do
    d=${f%/.launcher-pid}
    case "${d##*/}" in *.*) continue ;; esac  # our own renamed directories
    [ "$(cat "$f")" = "$PPID" ] && [ ! -e "$d.ours" ] || continue
    mkdir "$d.lock" 2>/dev/null || continue  # one squat, whichever rank's ssh comes first
    mv "$d" "$d.ours"
    case "$SQUAT_KIND" in
      dir) mkdir -m 0777 "$d"; chown SQUATTER:SQUATTER "$d" ;;
      dir700) mkdir -m 0700 "$d"; chown SQUATTER:SQUATTER "$d" ;;
      symlink) mkdir -m 0777 "$d.target"; chown SQUATTER:SQUATTER "$d.target"
               ln -s "$d.target" "$d"; chown -h SQUATTER:SQUATTER "$d" ;;
    esac
    echo "$d" > "$SQUAT_LOG"
  done
fi
""".replace("SQUATTER", str(STRANGER))


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root (chown)")
@pytest.mark.parametrize("kind", ["dir", "dir700", "symlink"])
def test_remote_job_dir_made_by_another_user_is_refused(kind: str, sshd: LoopbackSshd, tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(mode=0o700)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    log = tmp_path / "squatted"
    wrapper = ssh_wrapper(tmp_path, SQUAT)
    ssh = sshd.ssh_command.replace("ssh", str(wrapper), 1)
    p = launch(
        "-n",
        "2",
        "--hosts",
        SSH_ADDR,
        "--ssh",
        ssh,
        "--env",
        f"MC_TEST_PIDDIR={piddir}",
        rank_prog(tmp_path),
        "env",
        "MLX_RANK",
        env={"TMPDIR": str(tmpdir), "SQUAT_KIND": kind, "SQUAT_LOG": str(log)},
    )
    assert log.exists(), "the squatter never ran\n" + show(p)
    squatted = Path(log.read_text().strip())
    try:
        assert not recorded_pids(piddir), "a rank ran in the other user's directory\n" + show(p)
        assert p.returncode != 0, show(p)
        err = p.stderr.decode(errors="replace")
        assert f"job directory {squatted}" in err and f"uid {STRANGER}" in err and "refus" in err, show(p)
        target = Path(str(squatted) + ".target") if kind == "symlink" else squatted
        assert target.is_dir(), "the other user's directory was removed"
        assert os.lstat(squatted).st_uid == STRANGER
        assert list(target.iterdir()) == [], f"files were written into it: {list(target.iterdir())}"
    finally:
        for d in tmpdir.iterdir():
            if d.is_symlink():
                d.unlink()
            else:
                subprocess.run(["rm", "-rf", str(d)], check=False)


def test_remote_job_dir_is_private_and_removed(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """The normal case on the same machine: the directory (made by the local launcher) is
    accepted, is 0700 and ours while the job runs, and is gone after the job."""
    p = launch(
        "-n",
        "2",
        "--hosts",
        SSH_ADDR,
        "--ssh",
        sshd.ssh_command,
        "--env",
        f"MC_TEST_PIDDIR={tmp_path}",
        "--",
        sys.executable,
        "-c",
        "import os, stat; d = os.environ['MESHCOMM_JOB_DIR']; st = os.lstat(d); "
        "print('DIR', d, oct(stat.S_IMODE(st.st_mode)), st.st_uid, os.environ.get('SSH_CONNECTION') is not None)",
    )
    assert p.returncode == 0, show(p)
    dirs = {line.split(b"DIR ", 1)[1] for line in p.stdout.splitlines() if b"DIR " in line}
    assert len(dirs) == 1, show(p)
    path, mode, uid, over_ssh = dirs.pop().decode().split()
    assert (mode, uid, over_ssh) == ("0o700", str(os.geteuid()), "True"), show(p)
    assert not os.path.exists(path), "the job's directory was not removed"


# -- issue 33 item 3: --log-dir and --trace in another user's directory ----------------------------

#: what the other user (uid 65534) prepared: a directory of theirs, writable by all, with the
#: names the job writes planted as links to a file of root's; or our own directory left
#: writable by others; or a link to a directory
PLANTED = ("rank-0.log", "rank-1.log", "rank-0.json", "rank-1.json", "trace.json")


def _plant(folder: Path, kind: str, victim: Path) -> Path:
    if kind == "link-to-dir":
        real = folder.with_name(folder.name + ".real")
        real.mkdir(mode=0o700)
        folder.symlink_to(real)
        return folder
    folder.mkdir()
    folder.chmod(0o777)
    if kind == "theirs":
        os.chown(folder, STRANGER, STRANGER)
    for name in PLANTED:
        (folder / name).symlink_to(victim)
        os.lchown(folder / name, STRANGER, STRANGER)
    return folder


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root (chown)")
@pytest.mark.parametrize(
    "kind,words",
    [
        ("theirs", f"belongs to uid {STRANGER}"),
        ("mine-world-writable", "writable by other users"),
        ("link-to-dir", "is a symbolic link"),
    ],
)
@pytest.mark.parametrize("option", ["--log-dir", "--trace"])
def test_log_and_trace_dirs_another_user_can_change_are_refused(
    option: str, kind: str, words: str, tmp_path: Path
) -> None:
    """A root job pointed at such a directory refuses it before any rank starts, in one line
    naming the reason; root's mode-600 file behind the planted links is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("root's own")
    victim.chmod(0o600)
    folder = _plant(tmp_path / "out", kind, victim)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    p = launch("-n", "2", option, str(folder), "--env", f"MC_TEST_PIDDIR={piddir}", rank_prog(tmp_path), "wait", "init")
    line = error_line(p)
    assert option in line and words in line, line
    assert p.returncode == 2 and not recorded_pids(piddir), show(p)
    assert victim.read_text() == "root's own" and stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_log_and_trace_files_are_the_users_only(tmp_path: Path) -> None:
    """New directories are made 0700, log and trace files 0600; the temporary names of the
    trace files are not the predictable .rank-R.json.<pid>.tmp."""
    logs, trace = tmp_path / "a" / "logs", tmp_path / "b" / "trace"
    p = launch(
        "-n",
        "2",
        "--log-dir",
        str(logs),
        "--trace",
        str(trace),
        "--",
        "-c",
        "import meshcomm as mc; mc.all_sum(1.0); print('done')",
    )
    assert p.returncode == 0, show(p)
    for d in (logs, trace):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    files = [*logs.iterdir(), *trace.iterdir()]
    assert {f.name for f in files} >= {"rank-0.log", "rank-1.log", "trace.json"}, files
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    from meshcomm.runtime import private_files

    made = []
    real = private_files.os.open

    def spy(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(str(path))
        return real(path, flags, *args, **kwargs)

    private_files.os.open = spy
    try:
        private_files.write_atomic(trace, "x.json", b"{}")
    finally:
        private_files.os.open = real
    tmp = [m for m in made if m.endswith(".tmp")]
    assert tmp and all(str(os.getpid()) not in m and len(m) > len(".x.json..tmp") + 8 for m in tmp), made


# -- item 7: no secret on any command line, none in --verbose -----------------------------------


def _mpi_reason(name: str) -> str | None:
    if name == "mpich":
        if not MPICH_PY.exists():
            return f"{MPICH_PY} does not exist (scripts/setup-mpich.sh builds it)"
        if Path(sys.prefix).resolve() == MPICH_PY.parent.parent.resolve():
            return "this is the MPICH environment already (see the mpi case)"
        return None
    from meshcomm.runtime.registry import get_registry

    spec = get_registry().specs.get(name)
    return f"backend {name} is not installed" if spec is None else spec.unavailable_reason()


def _param(name: str, backend: str) -> object:
    reason = _mpi_reason(backend)
    return pytest.param(name, marks=pytest.mark.skipif(bool(reason), reason=str(reason)))


def _children(root: int) -> list[int]:
    """``root`` and every process below it."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [root], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


def _cmdlines() -> dict[int, bytes]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = (d / "cmdline").read_bytes()
            except OSError:
                continue
    return out


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.partition(b"=")[::2] for item in data.split(b"\0") if item)


def _mpiexec_over_ssh(kind: str, server: LoopbackSshd, folder: Path) -> str:
    """MESHCOMM_MPIEXEC_ARGS that make mpiexec start its daemons (Open MPI's prted, Hydra's
    proxies) through the test sshd."""
    # "mpi" is Open MPI in the main venv, MPICH when this suite runs in .venv-mpich
    running_mpich = Path(sys.prefix).resolve() == MPICH_PY.parent.parent.resolve()
    if kind == "mpi-ssh" and not running_mpich:
        return f"--prtemca plm_ssh_agent {shlex.quote(server.ssh_command)} --prefix {shlex.quote(sys.prefix)}"
    wrapper = folder / "hydra-ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {server.ssh_command} "$@"\n')
    wrapper.chmod(0o755)
    return f"-launcher ssh -launcher-exec {wrapper}"


@pytest.mark.parametrize(
    "kind",
    [
        _param("sockets", "sockets"),
        _param("sockets-ssh", "sockets"),
        _param("gloo", "gloo"),
        _param("mpi", "mpi"),
        _param("mpi-ssh", "mpi"),
        _param("mpich", "mpich"),
        _param("mpich-ssh", "mpich"),
    ],
)
def test_no_secret_on_any_command_line(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """While a 2-rank job runs (every rank past mc.init()), no process of this machine has the
    job secret or a hostfile variable's value on its command line. The "-ssh" kinds start the
    ranks on 127.0.0.2 through the test sshd (mpiexec's daemons too)."""
    backend = kind.removesuffix("-ssh").replace("mpich", "mpi")
    python = str(MPICH_PY) if kind.startswith("mpich") else sys.executable
    token = secrets.token_hex(12)  # a user's secret from the hostfile: not on a command line either
    hf = tmp_path / "hosts.json"
    over_ssh = kind.endswith("-ssh")
    hf.write_text(
        json.dumps({"hosts": [{"ssh": SSH_ADDR if over_ssh else "localhost"}], "envs": [f"MC_TEST_TOKEN={token}"]})
    )
    args = [
        "-n",
        "2",
        "--backend",
        backend,
        "--verbose",
        "--timeout",
        "120",
        "--hostfile",
        str(hf),
        "--env",
        f"MC_TEST_PIDDIR={tmp_path}",
    ]
    env = job_env()
    if over_ssh:
        server = request.getfixturevalue("sshd")
        args += ["--ssh", server.ssh_command]
        if backend == "mpi":
            env["MESHCOMM_MPIEXEC_ARGS"] = _mpiexec_over_ssh(kind, server, tmp_path)
    proc = subprocess.Popen(
        [python, "-m", "meshcomm", "launch", *args, rank_prog(tmp_path), "wait", "init"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=REPO,
    )
    err: list[bytes] = []
    t = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    t.start()
    out = b""
    try:
        assert proc.stdout is not None
        while out.count(b" ready") < 2:  # Hydra may glue the ranks' lines: "[0] ready[1] ready"
            line = proc.stdout.readline()
            if not line:
                proc.wait(30)
                t.join(10)
                raise AssertionError(f"the job ended before its ranks were ready: {out!r} {b''.join(err)!r}")
            out += line
        ranks = recorded_pids(tmp_path)
        assert len(ranks) == 2, ranks
        secret = _environ(ranks[0]).get(b"MESHCOMM_JOB_SECRET", b"")
        assert re.fullmatch(rb"[0-9a-f]{32}", secret), f"rank has no job secret: {secret!r}"
        assert _environ(ranks[0]).get(b"MC_TEST_TOKEN") == token.encode()
        job = _children(proc.pid)
        lines = _cmdlines()
        assert all(r in job for r in ranks) or over_ssh, (ranks, job)
        if over_ssh:
            assert all(_environ(r).get(b"SSH_CONNECTION") for r in ranks), "a rank did not run over ssh"
        names = [lines.get(pid, b"").split(b"\0")[0].rsplit(b"/", 1)[-1] for pid in job]
        if backend == "mpi":
            assert any(b"mpiexec" in n or b"prterun" in n for n in names), names
        leaks = {
            pid: line.replace(b"\0", b" ")[:300]
            for pid, line in lines.items()
            if secret in line or token.encode() in line
        }
        assert not leaks, f"secret on command lines: {leaks}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        t.join(10)
    text = b"".join(err)
    assert b"meshcomm launch: " in text and b"rank" in text, text[-2000:]  # --verbose printed something
    assert secret not in text and secret not in out, "--verbose printed the job secret"
    assert token.encode() not in text, "--verbose printed the value of a hostfile envs variable"
    if backend == "mpi":
        assert b"MESHCOMM_JOB_SECRET" in text, f"the job's environment is not shown: {text[-2000:]!r}"
    assert_no_leftovers(tmp_path, 2, grace=5)


def test_verbose_masks_secret_looking_env_values(sshd: LoopbackSshd, tmp_path: Path) -> None:
    """--verbose shows the start script of a remote rank, without the job secret and without
    the values of --env names like *TOKEN / *SECRET / *PASSWORD; other values are shown."""
    token = secrets.token_hex(8)
    p = launch(
        "-n",
        "1",
        "--verbose",
        "--hosts",
        SSH_ADDR,
        "--ssh",
        sshd.ssh_command,
        "--env",
        f"MY_API_TOKEN={token}",
        "--env",
        "MC_TEST_A=plainvalue",
        rank_prog(tmp_path),
        "env",
    )
    assert p.returncode == 0, show(p)
    err = p.stderr.decode()
    assert "export MC_TEST_A=plainvalue" in err, show(p)
    assert "export MY_API_TOKEN=" in err and token not in err, show(p)
    assert re.search(r"export MESHCOMM_JOB_SECRET=\S+", err) and not re.search(
        r"export MESHCOMM_JOB_SECRET='?[0-9a-f]{32}", err
    ), show(p)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_local_job_dir_is_private(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(mode=0o700)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshcomm",
            "launch",
            "-n",
            "1",
            "--env",
            f"MC_TEST_PIDDIR={tmp_path}",
            rank_prog(tmp_path),
            "wait",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**job_env(), "TMPDIR": str(tmpdir)},
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 30
        dirs: list[Path] = []
        while time.monotonic() < deadline and not dirs:
            dirs = [d for d in tmpdir.iterdir() if d.name.startswith("meshcomm-")]
            time.sleep(0.05)
        assert len(dirs) == 1, list(tmpdir.iterdir())
        assert _mode(dirs[0]) == 0o700 and os.lstat(dirs[0]).st_uid == os.geteuid()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert list(tmpdir.iterdir()) == []


@pytest.mark.skipif(bool(_mpi_reason("mpi")), reason=str(_mpi_reason("mpi")))
def test_mpiexec_command_takes_secrets_by_name_only() -> None:
    """mpiexec_command refuses a secret's value (it would be on the command line) and passes
    ``forward`` names without values (Open MPI ``-x NAME``; Hydra passes its environment)."""
    from meshcomm_mpi.launcher import mpiexec_command, resolve_mpiexec

    for name in ("MESHCOMM_JOB_SECRET", "WANDB_API_KEY", "HF_TOKEN"):
        with pytest.raises(ValueError, match=f"{name}.*forward="):
            mpiexec_command(2, ["prog"], {name: "s3cr3tvalue"})
    with pytest.raises(Exception, match="shell identifier"):
        mpiexec_command(2, ["prog"], forward=["$(id)X"])
    cmd = mpiexec_command(2, ["prog"], {"MLX_BACKEND": "mpi"}, forward=["MESHCOMM_JOB_SECRET"])
    if resolve_mpiexec()[1] == "openmpi":
        assert cmd[cmd.index("MESHCOMM_JOB_SECRET") - 1] == "-x", cmd
    else:
        assert "MESHCOMM_JOB_SECRET" not in cmd, cmd
