"""``meshcomm launch`` on this machine, with real jobs on the sockets backend.

Every job runs ``tests/programs/launch_rank.py`` (or ``show_env.sh``) through the real
command line (``.venv/bin/meshcomm`` or ``python -m meshcomm``) and the tests check what the
ranks printed: prefixes, environment, interpreter, collective results computed on the
ranks. The rank programs record their pids so the failure and signal tests can check that
nothing is left running once the launcher has returned.

The helpers at the top (``run_launch``, ``parse_infos``, ``assert_no_leftovers``, ...) are
shared with ``test_launch_multihost.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
PROGRAMS = TESTS / "programs"
RANK_PROG = PROGRAMS / "launch_rank.py"
SHOW_ENV = PROGRAMS / "show_env.sh"
MESHCOMM_SCRIPT = Path(sys.executable).parent / "meshcomm"

_spec = importlib.util.spec_from_file_location("launch_rank", RANK_PROG)
assert _spec is not None and _spec.loader is not None
launch_rank = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch_rank)

PREFIX = re.compile(rb"^\[rank (\d+)\] (.*)$")


# -- helpers (also used by test_launch_multihost.py) -------------------------------------------


def launch_cmd(*args: str, module: bool = False) -> list[str]:
    """The command line of ``meshcomm launch ARGS`` (console script, or ``python -m meshcomm``)."""
    if module or not MESHCOMM_SCRIPT.exists():
        return [sys.executable, "-m", "meshcomm", "launch", *args]
    return [str(MESHCOMM_SCRIPT), "launch", *args]


def script_python() -> str:
    """The interpreter the ``meshcomm`` console script runs with (from its shebang)."""
    if not MESHCOMM_SCRIPT.exists():
        return sys.executable
    first = MESHCOMM_SCRIPT.read_text().splitlines()[0]
    return first[2:].strip().split()[0]


def job_env(piddir: Path | None = None, **extra: str) -> dict[str, str]:
    """Our environment without any meshcomm settings (they would leak into the ranks)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "MESHCOMM_", "MC_TEST_"))}
    if piddir is not None:
        env["MC_TEST_PIDDIR"] = str(piddir)
    env.update(extra)
    return env


def run_launch(
    *args: str,
    piddir: Path | None = None,
    cwd: Path | str | None = None,
    module: bool = False,
    timeout: float = 60,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``meshcomm launch ARGS`` to completion; bytes output (so we see exactly what it wrote)."""
    return subprocess.run(
        launch_cmd(*args, module=module),
        capture_output=True,
        timeout=timeout,
        env={**job_env(piddir), **(env or {})},
        cwd=cwd or TESTS.parent,
        stdin=subprocess.DEVNULL,
    )


def show(proc: subprocess.CompletedProcess[bytes] | Any) -> str:
    out = proc.stdout.decode(errors="replace") if isinstance(proc.stdout, bytes) else str(proc.stdout)
    err = proc.stderr.decode(errors="replace") if isinstance(proc.stderr, bytes) else str(proc.stderr)
    return f"exit status {proc.returncode}\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"


def prefixed_lines(data: bytes) -> list[tuple[int, bytes]]:
    """Every line must be ``[rank R] ...``; returns (R, rest)."""
    lines = []
    for line in data.splitlines():
        m = PREFIX.match(line)
        assert m, f"output line without a rank prefix: {line[:200]!r}"
        lines.append((int(m.group(1)), m.group(2)))
    return lines


def parse_infos(stdout: bytes, n: int, prefix: bool = True) -> dict[int, dict[str, Any]]:
    """The ``INFO {json}`` line of each of ranks 0..n-1 (checking the prefix matches the rank)."""
    import json

    infos: dict[int, dict[str, Any]] = {}
    for line in stdout.splitlines():
        rank_tag = None
        if prefix:
            m = PREFIX.match(line)
            assert m, f"output line without a rank prefix: {line[:200]!r}"
            rank_tag, line = int(m.group(1)), m.group(2)
        if not line.startswith(b"INFO "):
            continue
        info = json.loads(line[5:])
        if rank_tag is not None:
            assert info["rank"] == rank_tag, f"rank {info['rank']}'s line is prefixed [rank {rank_tag}]"
        assert info["rank"] not in infos, f"rank {info['rank']} printed INFO twice"
        infos[info["rank"]] = info
    assert sorted(infos) == list(range(n)), f"INFO from ranks {sorted(infos)}, expected 0..{n - 1}"
    return infos


def check_results(infos: dict[int, dict[str, Any]], n: int) -> None:
    """The collective results each rank printed are what its inputs give."""
    want_sum = [sum(i + 10 * r + 1 for r in range(n)) for i in range(4)]
    want_gather = [r * r + 7 for r in range(n)]
    for r, info in infos.items():
        assert info["size"] == n and info["backend"] == "sockets", info
        assert info["all_sum"] == want_sum, f"rank {r}: all_sum {info['all_sum']} != {want_sum}"
        assert info["all_gather"] == want_gather, f"rank {r}: all_gather {info['all_gather']}"
        assert info["broadcast"] == [1000 + n - 1], f"rank {r}: broadcast {info['broadcast']}"
        assert info["env"]["MLX_RANK"] == str(r) and info["env"]["MLX_WORLD_SIZE"] == str(n)
        assert info["env"]["MLX_BACKEND"] == "sockets"
    assert len({i["env"]["MESHCOMM_JOB_ID"] for i in infos.values()}) == 1
    assert len({i["env"]["MESHCOMM_JOB_SECRET"] for i in infos.values()}) == 1
    assert len({i["pid"] for i in infos.values()}) == n


def recorded_pids(piddir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(piddir.glob("*.pid"))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie nobody reaped yet (e.g. reparented to a PID 1 that does not reap) is dead
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def assert_no_leftovers(piddir: Path, expect: int, grace: float = 1.0) -> None:
    """All ``expect`` recorded processes are gone (``grace`` allows for the kernel's teardown)."""
    pids = recorded_pids(piddir)
    assert len(pids) >= expect, f"only {len(pids)} pids recorded, expected {expect}: {sorted(piddir.iterdir())}"
    deadline = time.monotonic() + grace
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in alive:  # do not leave them behind for the next test
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not alive, f"processes still running after the launcher returned: {alive}"


class Launcher:
    """A launcher running in the background; its output is collected line by line."""

    def __init__(self, *args: str, piddir: Path, nready: int, env: dict[str, str] | None = None) -> None:
        self.nready = nready
        self.lines: list[bytes] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            launch_cmd(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env={**job_env(piddir), **(env or {})},
            cwd=TESTS.parent,
        )
        self.err = b""
        self._t_out = threading.Thread(target=self._read_out, daemon=True)
        self._t_err = threading.Thread(target=self._read_err, daemon=True)
        self._t_out.start()
        self._t_err.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if sum(line.rstrip().endswith(b"] ready") for line in self.lines) >= self.nready:
                self.ready.set()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.err = self.proc.stderr.read()

    def wait_ready(self, timeout: float = 30) -> None:
        if not self.ready.wait(timeout):
            self.kill()
            raise AssertionError(f"ranks never all printed 'ready':\n{self.text()}")

    def finish(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"launcher still running {timeout}s after the signal:\n{self.text()}") from None
        self._t_out.join(5)
        self._t_err.join(5)
        return rc

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def text(self) -> str:
        return (
            b"".join(self.lines).decode(errors="replace")[-3000:]
            + "\n--- stderr ---\n"
            + self.err.decode(errors="replace")[-3000:]
        )


# -- successful jobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_job_runs_with_prefix_env_and_results(n: int, tmp_path: Path) -> None:
    module = n == 3  # python -m meshcomm launch
    args = ["-n", str(n), "--env", "MC_TEST_A=a b=c", "--env", "MC_TEST_B="]
    if n != 1:
        args += ["--timeout", f"{20 + n}.5"]
    rank_cwd = tmp_path / "rank cwd"
    rank_cwd.mkdir()
    if n == 4:
        args += ["--cwd", str(rank_cwd)]
    p = run_launch(*args, "--", str(RANK_PROG), "info", "x y", piddir=tmp_path, module=module, cwd=tmp_path)
    assert p.returncode == 0, show(p)
    assert p.stderr == b"", show(p)
    infos = parse_infos(p.stdout, n)
    check_results(infos, n)
    python = sys.executable if module else script_python()
    for r, info in infos.items():
        env = info["env"]
        assert env["MC_TEST_A"] == "a b=c" and env["MC_TEST_B"] == "", f"rank {r}: --env lost: {env}"
        assert env["MLX_TIMEOUT"] == (None if n == 1 else f"{20 + n}.5"), f"rank {r}: MLX_TIMEOUT {env}"
        assert info["executable"] == python, f"rank {r} ran with {info['executable']}, not {python}"
        assert info["argv"] == ["info", "x y"]
        assert info["cwd"] == str(rank_cwd if n == 4 else tmp_path)
    assert len(recorded_pids(tmp_path)) == n


def test_no_prefix(tmp_path: Path) -> None:
    p = run_launch("-n", "2", "--no-prefix", str(RANK_PROG), "info")
    assert p.returncode == 0, show(p)
    assert not any(line.startswith(b"[rank") for line in p.stdout.splitlines()), show(p)
    check_results(parse_infos(p.stdout, 2, prefix=False), 2)


@pytest.mark.parametrize("n,prefix", [(4, True), (2, False)])
def test_lines_never_interleave(n: int, prefix: bool) -> None:
    """Ranks write long lines to stdout and stderr at once: every line arrives whole, in order."""
    lines = 150
    args = ["-n", str(n)] + ([] if prefix else ["--no-prefix"])
    p = run_launch(*args, str(RANK_PROG), "spam", str(lines))
    assert p.returncode == 0, show(p)
    for data, stream in ((p.stdout, "out"), (p.stderr, "err")):
        seen: dict[int, list[int]] = {r: [] for r in range(n)}
        for line in data.splitlines():
            if prefix:
                m = PREFIX.match(line)
                assert m, f"std{stream} line without a prefix (mixed lines?): {line[:120]!r}"
                tag, line = int(m.group(1)), m.group(2)
            text = line.decode()
            rank, st, i = text.split(":", 3)[:3]
            assert st == stream, f"a std{st} line arrived on std{stream}"
            assert text == launch_rank.spam_line(int(rank), stream, int(i)), f"damaged line: {text[:120]!r}..."
            if prefix:
                assert tag == int(rank), f"rank {rank}'s line is prefixed [rank {tag}]"
            seen[int(rank)].append(int(i))
        for r in range(n):
            assert seen[r] == list(range(lines)), f"rank {r} std{stream}: lines missing or out of order"


def test_reader_closing_early_drops_stdout_not_the_job(tmp_path: Path) -> None:
    """``meshcomm launch ... | head -1``: once the launcher's stdout has no reader, the rest of
    the ranks' stdout is dropped without a traceback, and the job goes on to its end: no rank
    blocks on a full pipe or is stopped (stderr and --log-dir still get every line), and the
    launcher exits with the job's status."""
    lines, n = 300, 2  # about 1 MiB per rank and stream: far more than a pipe holds
    logs, err_path = tmp_path / "logs", tmp_path / "launcher.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            launch_cmd("-n", str(n), "--log-dir", str(logs), str(RANK_PROG), "spam", str(lines)),
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=job_env(tmp_path),
            cwd=TESTS.parent,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # the reader goes away, as head -1 does
        try:
            rc: int | None = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    errout = err_path.read_bytes()
    own = b"\n".join(line for line in errout.splitlines() if not PREFIX.match(line))  # not the ranks' lines
    text = f"exit status {rc}, first line {first[:80]!r}\n--- the launcher's own stderr ---\n{own[-4000:].decode()}"
    assert rc is not None, f"the launcher did not end after its reader left:\n{text}"
    assert PREFIX.match(first.rstrip(b"\n")), text
    for bad in (b"Traceback", b"BrokenPipeError", b"Exception ignored"):
        assert bad not in errout, text
    assert rc == 0, text
    got = sorted((r, rest.split(b":", 3)[2]) for r, rest in prefixed_lines(errout))
    assert got == sorted((r, str(i).encode()) for r in range(n) for i in range(lines)), "stderr lost lines"
    for r in range(n):
        logged = (logs / f"rank-{r}.log").read_text().splitlines()
        for stream in ("out", "err"):
            assert [x for x in logged if x.startswith(f"{r}:{stream}:")] == [
                launch_rank.spam_line(r, stream, i) for i in range(lines)
            ], f"rank {r}'s log lost std{stream} lines"
    assert_no_leftovers(tmp_path, n)


def test_reader_of_both_streams_closing_early_keeps_the_jobs_exit_status(tmp_path: Path) -> None:
    """``meshcomm launch ... 2>&1 | head -1`` where a rank fails: the launcher's own last
    message has no reader either, and the exit status is still the rank's code."""
    prog = "import sys\nfor i in range(20000): print('o', i); print('e', i, file=sys.stderr)\nsys.exit(3)"
    proc = subprocess.Popen(
        launch_cmd("-n", "2", "--", sys.executable, "-c", prog),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=job_env(tmp_path),
        cwd=TESTS.parent,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    try:
        rc = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("the launcher did not end after its reader left") from None
    assert PREFIX.match(first.rstrip(b"\n")), first
    assert rc == 3, f"exit status {rc}, not the ranks' 3"


def test_non_py_program_runs_as_given() -> None:
    p = run_launch("-n", "2", str(SHOW_ENV), "a b", "", "c")
    assert p.returncode == 0, show(p)
    by_rank: dict[int, list[bytes]] = {0: [], 1: []}
    for r, rest in prefixed_lines(p.stdout):
        by_rank[r].append(rest)
    for r in (0, 1):
        assert by_rank[r] == [
            f"SHELL_RANK rank={r} size=2 bash=yes nargs=3".encode(),
            b"ARG <a b>",
            b"ARG <>",
            b"ARG <c>",
        ], show(p)


def test_python_option_and_plain_command(tmp_path: Path) -> None:
    other = "/usr/bin/python3"
    if not os.path.exists(other):
        pytest.skip(f"{other} does not exist")
    p = run_launch("-n", "2", "--python", other, str(RANK_PROG), "whoami")
    assert p.returncode == 0, show(p)
    got = sorted(rest for _, rest in prefixed_lines(p.stdout))
    assert got == [f"WHOAMI rank={r} executable={other}".encode() for r in (0, 1)], show(p)
    # a program that is not a .py file is run as given: here an interpreter with its own args
    p = run_launch("-n", "2", "--", other, str(RANK_PROG), "whoami")
    assert p.returncode == 0, show(p)
    got = sorted(rest for _, rest in prefixed_lines(p.stdout))
    assert got == [f"WHOAMI rank={r} executable={other}".encode() for r in (0, 1)], show(p)


def test_verbose_prints_each_rank_command() -> None:
    p = run_launch("-n", "2", "--verbose", str(RANK_PROG), "whoami")
    assert p.returncode == 0, show(p)
    err = p.stderr.decode()
    python = script_python()
    for r in (0, 1):
        # Python programs run through the rank runner (exit handling, stacks, parent death)
        assert f"meshcomm launch: rank {r}: {python} -m meshcomm.launch.rank {RANK_PROG} whoami" in err, show(p)


BAD_ARGS = {
    "zero ranks": (["-n", "0", "prog.py"], None, ["-n 0", "at least 1"]),
    "hostfile not JSON": (["-n", "1", "--hostfile", "{hf}", "prog.py"], '[{"ssh": "a",', ["not valid JSON", "{hf}"]),
    "hostfile entry without ssh": (
        ["-n", "1", "--hostfile", "{hf}", "prog.py"],
        '[{"ips": ["10.1.2.3"]}]',
        ["host entry 0", "'ssh'", "10.1.2.3"],
    ),
    "hostfile missing": (
        ["-n", "1", "--hostfile", "{hf}.nothere", "prog.py"],
        None,
        ["{hf}.nothere", "cannot be read"],
    ),
    "unknown backend": (["-n", "1", "--backend", "nosuchbackend", "prog.py"], None, ["nosuchbackend", "sockets"]),
    "no program": (["-n", "2"], None, ["no program"]),
    # what the ranks would reject, refused before any starts
    "negative --timeout": (["-n", "2", "--timeout", "-5", str(RANK_PROG), "whoami"], None, ["--timeout -5", "> 0"]),
    "program file missing": (["-n", "2", "{hf}.nothere.py"], None, ["{hf}.nothere.py", "does not exist"]),
    "program file missing after python": (
        ["-n", "2", "--", "python3", "{hf}.nothere.py"],
        None,
        ["{hf}.nothere.py", "does not exist"],
    ),
    "command not found": (["-n", "2", "--", "no-such-command-4711", "x"], None, ["no-such-command-4711", "not found"]),
}

#: the same, from the launcher's environment: (environment, extra arguments, words of the error)
BAD_ENV = {
    "MLX_BACKEND typo": ({"MLX_BACKEND": "sokets"}, [], ["MLX_BACKEND=sokets", "unknown backend 'sokets'", "sockets"]),
    "MLX_BACKEND against the hostfile": (
        {"MLX_BACKEND": "mpi"},
        ["--hostfile", "{hf}"],
        ["MLX_BACKEND=mpi", "hostfile's backend 'gloo'", "--backend"],
    ),
    "--env MLX_BACKEND against --backend": (
        {},
        ["--backend", "sockets", "--env", "MLX_BACKEND=gloo"],
        ["--backend sockets", "MLX_BACKEND=gloo", "disagree"],
    ),
    "MLX_TIMEOUT not a number": ({"MLX_TIMEOUT": "abc"}, [], ["MLX_TIMEOUT='abc' is invalid", "seconds"]),
    "MLX_DEBUG not a boolean": ({"MLX_DEBUG": "maybe"}, [], ["MLX_DEBUG='maybe'", "true/false"]),
    "--env MESHCOMM_STALL_AFTER negative": ({}, ["--env", "MESHCOMM_STALL_AFTER=-1"], ["MESHCOMM_STALL_AFTER='-1'"]),
    "backend setting": ({"MESHCOMM_SOCKETS_CHUNK_KIB": "lots"}, [], ["MESHCOMM_SOCKETS_CHUNK_KIB='lots'"]),
}


def _one_line_error(p: subprocess.CompletedProcess[bytes], words: list[str], piddir: Path) -> None:
    """Exit 2, one ``meshcomm launch: error:`` line holding ``words``, and no rank started."""
    assert p.returncode == 2, show(p)
    err = p.stderr.decode().strip().splitlines()
    assert len(err) == 1, f"expected a one-line error:\n{show(p)}"
    assert err[0].startswith("meshcomm launch: error: "), show(p)
    for w in words:
        assert w in err[0], f"{w!r} not in {err[0]!r}"
    assert p.stdout == b"" and not recorded_pids(piddir), "a rank was started"


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_arguments_exit_2_with_one_line(case: str, tmp_path: Path) -> None:
    args, hostfile, words = BAD_ARGS[case]
    hf = tmp_path / "hosts.json"
    if hostfile is not None:
        hf.write_text(hostfile)
    p = run_launch(*(a.replace("{hf}", str(hf)) for a in args), piddir=tmp_path)
    _one_line_error(p, [w.replace("{hf}", str(hf)) for w in words], tmp_path)


@pytest.mark.parametrize("case", list(BAD_ENV))
def test_bad_settings_in_the_environment_exit_2_before_any_rank(case: str, tmp_path: Path) -> None:
    env, args, words = BAD_ENV[case]
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"backend": "gloo", "hosts": [{"ssh": "localhost", "slots": 2}]}))
    argv = [a.replace("{hf}", str(hf)) for a in args]
    if "--hostfile" not in argv:
        argv = ["-n", "2", *argv]
    p = run_launch(*argv, str(RANK_PROG), "whoami", piddir=tmp_path, env=env)
    _one_line_error(p, words, tmp_path)


# -- failures and signals --------------------------------------------------------------------------


def test_failing_rank_stops_the_job(tmp_path: Path) -> None:
    """Rank 1 exits 3 while ranks 0 and 2 wait in all_sum: exit 3, rank 1 named, nothing left."""
    t0 = time.monotonic()
    p = run_launch("-n", "3", "--timeout", "120", str(RANK_PROG), "fail", "1", "3", piddir=tmp_path, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 3, show(p)
    err = p.stderr.decode().strip().splitlines()
    assert err and err[-1].startswith("meshcomm launch: rank 1 exited with code 3"), show(p)
    out = p.stdout.decode()
    assert "[rank 0] waiting in all_sum" in out and "[rank 2] waiting in all_sum" in out, show(p)
    assert "returned" not in out, show(p)
    assert took < 20, f"the job took {took:.1f}s to stop (ranks wait up to 120 s)"
    assert_no_leftovers(tmp_path, 3)


def test_rank_killed_by_sigkill(tmp_path: Path) -> None:
    p = run_launch("-n", "3", "--timeout", "120", str(RANK_PROG), "sigkill", "2", piddir=tmp_path, timeout=60)
    assert p.returncode == 137, show(p)
    err = p.stderr.decode().strip().splitlines()
    assert err and err[-1].startswith("meshcomm launch: rank 2 was killed by SIGKILL"), show(p)
    assert_no_leftovers(tmp_path, 3)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_launcher_stops_every_rank(sig: signal.Signals, tmp_path: Path) -> None:
    job = Launcher("-n", "3", "--timeout", "120", str(RANK_PROG), "wait", piddir=tmp_path, nready=3)
    job.wait_ready()
    assert len(recorded_pids(tmp_path)) == 3
    t0 = time.monotonic()
    job.proc.send_signal(sig)
    rc = job.finish(timeout=15)
    took = time.monotonic() - t0
    assert rc == 128 + sig, job.text()
    assert f"interrupted by {sig.name}".encode() in job.err, job.text()
    assert took < 5, f"ranks took {took:.1f}s to stop"
    assert_no_leftovers(tmp_path, 3)


def test_ranks_ignoring_sigterm_are_killed_with_their_children(tmp_path: Path) -> None:
    """Ranks that ignore SIGTERM get SIGKILL after the grace period; their children go too."""
    job = Launcher("-n", "2", "--timeout", "120", str(RANK_PROG), "wait-stubborn", piddir=tmp_path, nready=2)
    job.wait_ready()
    assert len(recorded_pids(tmp_path)) == 4  # two ranks, one `sleep` child each
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    rc = job.finish(timeout=20)
    took = time.monotonic() - t0
    assert rc == 143, job.text()
    assert 2 < took < 12, f"stopping took {took:.1f}s (grace period, then SIGKILL)"
    assert_no_leftovers(tmp_path, 4)
