"""How jobs end under ``meshcomm launch`` on every bundled backend (real processes, real mpiexec).

* a rank that raises, or exits with a code, while the others wait: the summary names that
  rank (not one that raised PeerLostError because of it) and the job exits with its code;
* a launcher killed with SIGKILL (or, for MPI, a killed mpiexec) leaves no rank behind;
* a rank's CommTimeoutError makes every rank print its Python stack before the job ends;
* MPI output arrives as whole lines prefixed ``[rank R] ``, on Open MPI and on MPICH;
* the rank runner (``python -m meshcomm.launch.rank``) runs programs exactly as ``python``
  does, and :mod:`meshcomm.runtime.exits` writes failure records after the traceback.

The ``mpich`` cases run the launcher of ``.venv-mpich`` (``scripts/setup-mpich.sh``), and
are skipped when that environment does not exist. Timing bounds are the contract's
(MLX_TIMEOUT + 5 s) plus start-up and stop allowances, never tight.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from test_launch import Launcher, assert_no_leftovers, job_env, recorded_pids, show

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PROG = TESTS / "programs" / "launch_jobs.py"
MPICH_PY = REPO / ".venv-mpich" / "bin" / "python"
PREFIX = re.compile(rb"^\[rank (\d+)\] (.*)$")

#: the MLX_TIMEOUT of the failure jobs: survivors must give up well within it
TIMEOUT = 30
#: start-up of 3 ranks on a busy 2-core machine, the launcher's settle and stop periods
ALLOWANCE = 25

sys.path.insert(0, str(PROG.parent))
import launch_jobs  # noqa: E402


def _unavailable(backend: str) -> str | None:
    if backend == "mpich":
        if not MPICH_PY.exists():
            return f"{MPICH_PY} does not exist (scripts/setup-mpich.sh builds it)"
        if Path(sys.prefix).resolve() == MPICH_PY.parent.parent.resolve():
            return "this is the MPICH environment already (see the mpi case)"
        return None
    from meshcomm.runtime.registry import get_registry

    spec = get_registry().specs.get(backend)
    if spec is None:
        return f"backend {backend} is not installed here"
    return spec.unavailable_reason()


def backend_param(*names: str) -> list[Any]:
    return [
        pytest.param(n, marks=pytest.mark.skipif(bool(_unavailable(n)), reason=str(_unavailable(n)))) for n in names
    ]


def launch_argv(backend: str, *args: str) -> list[str]:
    """``meshcomm launch --backend B ARGS`` with the interpreter of B's environment."""
    python = str(MPICH_PY) if backend == "mpich" else sys.executable
    name = "mpi" if backend == "mpich" else backend
    return [python, "-m", "meshcomm", "launch", "--backend", name, *args]


def run_job(
    backend: str, *args: str, piddir: Path | None = None, timeout: float = 120
) -> tuple[subprocess.CompletedProcess[bytes], float]:
    t0 = time.monotonic()
    p = subprocess.run(
        launch_argv(backend, *args),
        capture_output=True,
        timeout=timeout,
        env=job_env(piddir),
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )
    return p, time.monotonic() - t0


def summary(p: subprocess.CompletedProcess[bytes]) -> str:
    """The launcher's last word (its last stderr line that starts with ``meshcomm launch:``)."""
    lines = [ln.strip() for ln in p.stderr.decode(errors="replace").splitlines()]
    ours = [ln[ln.index("meshcomm launch:") :] for ln in lines if "meshcomm launch:" in ln]
    return ours[-1] if ours else ""


def rank_text(p: subprocess.CompletedProcess[bytes], rank: int) -> str:
    """Everything rank ``rank`` printed (stdout and stderr), without the prefix."""
    out = []
    for line in (p.stdout + b"\n" + p.stderr).splitlines():
        m = PREFIX.match(line)
        if m and int(m.group(1)) == rank:
            out.append(m.group(2).decode(errors="replace"))
    return "\n".join(out)


# -- a failing rank is blamed and its code is the job's --------------------------------------------


@pytest.mark.parametrize("backend", backend_param("sockets", "mpi", "gloo", "mpich"))
def test_raising_rank_is_named_and_its_code_is_the_jobs(backend: str, tmp_path: Path) -> None:
    p, took = run_job(backend, "-n", "3", "--timeout", str(TIMEOUT), str(PROG), "raise", "1", piddir=tmp_path)
    assert p.returncode == 1, show(p)
    assert summary(p).startswith("meshcomm launch: rank 1 exited with code 1 (KeyError: 'launch-jobs')"), show(p)
    assert "KeyError: 'launch-jobs'" in rank_text(p, 1), "rank 1's traceback is missing:\n" + show(p)
    assert b"returned without the failed rank" not in p.stdout, show(p)
    # the output is meshcomm's: every line prefixed, the MPI launcher's banners condensed, no
    # library traceback chained above meshcomm's error
    for line in (p.stdout + p.stderr).decode(errors="replace").splitlines():
        assert line.startswith(("[rank ", "[mpiexec] ", "meshcomm launch: ")), f"unprefixed line {line!r}\n{show(p)}"
    mpiexec = [ln for ln in p.stderr.decode(errors="replace").splitlines() if ln.startswith("[mpiexec] ")]
    assert len(mpiexec) <= 3 and not any("Epoll" in ln or "-----" in ln for ln in mpiexec), show(p)
    assert "direct cause of the following exception" not in rank_text(p, 0) + rank_text(p, 2), show(p)
    assert took < TIMEOUT + 5 + ALLOWANCE, f"the job took {took:.1f}s to end\n{show(p)}"
    assert_no_leftovers(tmp_path, 3, grace=5)


@pytest.mark.parametrize("form", ["prog.py", "-- python prog.py, busy machine"])
@pytest.mark.parametrize("backend", backend_param("sockets", "mpi", "gloo", "mpich"))
def test_exit_code_of_the_failing_rank_is_the_jobs(backend: str, form: str, tmp_path: Path) -> None:
    """``sys.exit(3)`` on rank 1 makes the job exit 3, naming rank 1, however the program was
    given; the ``-- python`` form runs beside a spinning process (the survivors' abort used to
    win the race against rank 1's own exit there, and the job exited 1)."""
    python = str(MPICH_PY) if backend == "mpich" else sys.executable
    program = [str(PROG)] if form == "prog.py" else ["--", python, str(PROG)]
    spinner = None if form == "prog.py" else subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        p, took = run_job(backend, "-n", "3", "--timeout", str(TIMEOUT), *program, "exit", "1", "3", piddir=tmp_path)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    assert p.returncode == 3, show(p)
    assert summary(p).startswith("meshcomm launch: rank 1 exited with code 3"), show(p)
    assert took < TIMEOUT + 5 + ALLOWANCE, f"the job took {took:.1f}s to end\n{show(p)}"
    assert_no_leftovers(tmp_path, 3, grace=5)


# -- a timeout shows every rank's stack ----------------------------------------------------------


@pytest.mark.parametrize("form", ["prog.py", "-- python prog.py"])
@pytest.mark.parametrize("backend", backend_param("sockets", "mpi", "gloo", "mpich"))
def test_timeout_prints_every_ranks_stack(backend: str, form: str, tmp_path: Path) -> None:
    """Rank 1 sleeps in ``stuck_here`` while 0 and 2 wait in all_sum until MLX_TIMEOUT; the
    stacks come however the ranks were started (through the rank runner, or as a command
    ``-- python prog.py``, where ``meshcomm.init`` installs the handler)."""
    timeout = 4
    python = str(MPICH_PY) if backend == "mpich" else sys.executable
    program = [str(PROG)] if form == "prog.py" else ["--", python, str(PROG)]
    p, took = run_job(backend, "-n", "3", "--timeout", str(timeout), *program, "stuck", "1", piddir=tmp_path)
    assert p.returncode == 1, show(p)
    assert b"every rank's Python stack follows" in p.stderr, show(p)
    frame = re.compile(r'File "[^"]*launch_jobs\.py", line \d+,? in (\w+)')
    for r in range(3):
        functions = set(frame.findall(rank_text(p, r)))
        assert functions, f"no Python stack of rank {r} in the output:\n{show(p)}"
    assert "stuck_here" in frame.findall(rank_text(p, 1)), f"rank 1's stack does not show where it was:\n{show(p)}"
    assert summary(p).startswith("meshcomm launch: rank 1 did not answer in time"), show(p)
    assert took < timeout + 5 + ALLOWANCE, f"the job took {took:.1f}s to end\n{show(p)}"
    assert_no_leftovers(tmp_path, 3, grace=5)


# -- a killed launcher leaves no rank ------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


@pytest.mark.exclusive  # compares the temporary directory and /dev/shm before and after
@pytest.mark.parametrize(
    "backend,victim",
    [
        *[
            pytest.param(b, "launcher", marks=m.marks, id=f"{b}-launcher")
            for b, m in zip(("sockets", "mpi"), backend_param("sockets", "mpi"), strict=True)
        ],
        *[pytest.param("mpi", "mpiexec", marks=m.marks, id="mpi-mpiexec") for m in backend_param("mpi")],
    ],
)
def test_killed_launcher_leaves_no_rank(backend: str, victim: str, tmp_path: Path) -> None:
    """SIGKILL the launcher (nothing of it runs any more: no clean-up code) -> every rank is
    gone within a few seconds (parent-death signal). For MPI, killing mpiexec itself checks
    the ranks' own parent-death signal (set by the rank runner)."""
    shm_before, tmp_before = set(os.listdir("/dev/shm")), set(os.listdir(tempfile.gettempdir()))
    job = Launcher("-n", "3", "--backend", backend, "--timeout", "120", str(PROG), "wait", piddir=tmp_path, nready=3)
    try:
        job.wait_ready(60)
        assert len(recorded_pids(tmp_path)) == 3
        helpers = _children(job.proc.pid)
        mpiexec = [c for c in helpers if b"reaper.py" not in Path(f"/proc/{c}/cmdline").read_bytes()]
        target = job.proc.pid if victim == "launcher" else mpiexec[0]
        os.kill(target, signal.SIGKILL)
        t0 = time.monotonic()
        assert_no_leftovers(tmp_path, 3, grace=5)
        took = time.monotonic() - t0
        for pid in helpers:  # mpiexec, or the ranks themselves for sockets
            deadline = time.monotonic() + 5
            while not _gone(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _gone(pid), f"process {pid} the launcher started is still running"
        print(f"{backend}: ranks gone {took:.2f}s after SIGKILL of the {victim}")
    finally:
        job.kill()
    # nothing is left in the temporary directory or /dev/shm: the killed launcher's reaper
    # removes the job's directories, where Open MPI keeps its segments and session directory
    # (MPICH names its own files in /dev/shm, with no setting to put them elsewhere: a killed
    # MPICH job leaves them, and this suite's session fixture removes them; not checked here)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        new_shm = {n for n in set(os.listdir("/dev/shm")) - shm_before if not n.startswith("mpich_shm_")}
        new_tmp = {
            d
            for d in set(os.listdir(tempfile.gettempdir())) - tmp_before
            if d.startswith(("meshcomm-", "ompi.", "prte.", "pmix"))
        }
        if not new_shm and not new_tmp:
            break
        time.sleep(0.2)
    assert not new_shm and not new_tmp, (
        f"left behind: /dev/shm {sorted(new_shm)}, temporary directory {sorted(new_tmp)}"
    )


def test_rank_runner_dies_with_its_parent(tmp_path: Path) -> None:
    """An intermediate parent that is SIGKILLed takes the rank runner's program with it."""
    pidfile = tmp_path / "child.pid"
    parent_code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-m', 'meshcomm.launch.rank', '-c', "
        "'import os, sys, time; open(sys.argv[1], \"w\").write(str(os.getpid())); time.sleep(600)', "
        f"{str(pidfile)!r}])\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=job_env())
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert not _gone(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the rank runner's program outlived its parent")
    finally:
        parent.kill()
        parent.wait()


# -- MPI output: whole lines, prefixed like the other backends -------------------------------------


@pytest.mark.parametrize("backend", backend_param("mpi", "mpich", "sockets"))
def test_output_lines_whole_and_prefixed(backend: str) -> None:
    """Ranks write long lines to stdout and stderr from two threads: each arrives whole,
    prefixed ``[rank R] `` with its own rank, in order (Hydra used to split them per write)."""
    n, lines = 3, 120
    p, _ = run_job(backend, "-n", str(n), str(PROG), "spam", str(lines))
    assert p.returncode == 0, show(p)
    for data, stream in ((p.stdout, "out"), (p.stderr, "err")):
        seen: dict[int, list[int]] = {r: [] for r in range(n)}
        for line in data.splitlines():
            m = PREFIX.match(line)
            assert m, f"std{stream} line without a [rank R] prefix: {line[:160]!r}\n{show(p)[:3000]}"
            text = m.group(2).decode()
            rank, st, i = text.split(":", 3)[:3]
            assert int(m.group(1)) == int(rank), f"rank {rank}'s line is prefixed [rank {m.group(1)}]"
            assert st == stream, f"a std{st} line arrived on std{stream}"
            assert text == launch_jobs.spam_line(int(rank), stream, int(i)), f"damaged line: {text[:120]!r}..."
            seen[int(rank)].append(int(i))
        for r in range(n):
            assert seen[r] == list(range(lines)), f"rank {r} std{stream}: lines missing or out of order"


# -- the rank runner is python ---------------------------------------------------------------------


SCRIPT = """\
import os, sys
main = sys.modules["__main__"]
spec = main.__dict__.get("__spec__")
print(repr((sys.argv, sys.path[0], __name__, __file__, spec and (spec.name, spec.origin), __package__)))
mode = sys.argv[1]
if mode == "raise":
    def inner():
        raise ValueError("from the program")
    inner()
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "message":
    sys.exit("a message instead of a code")
"""


@pytest.mark.parametrize("how", ["script", "module", "code"])
@pytest.mark.parametrize("mode", [["ok", "x y"], ["raise"], ["exit", "3"], ["message"]], ids=lambda m: m[0])
def test_rank_runner_runs_programs_like_python(how: str, mode: list[str], tmp_path: Path) -> None:
    (tmp_path / "prog_under_test.py").write_text(SCRIPT)
    (tmp_path / "elsewhere").mkdir()
    if how == "script":
        argv, cwd = [str(tmp_path / "prog_under_test.py"), *mode], tmp_path / "elsewhere"
    elif how == "module":
        argv, cwd = ["-m", "prog_under_test", *mode], tmp_path
    else:
        argv, cwd = ["-c", SCRIPT, *mode], tmp_path
    env = job_env()
    plain = subprocess.run([sys.executable, *argv], capture_output=True, cwd=cwd, env=env, timeout=60)
    runner = subprocess.run(
        [sys.executable, "-m", "meshcomm.launch.rank", *argv], capture_output=True, cwd=cwd, env=env, timeout=60
    )
    assert runner.returncode == plain.returncode, (show(plain), show(runner))
    assert runner.stdout == plain.stdout, (show(plain), show(runner))

    # python -m shows runpy's own frames on top of a traceback: the runner's differ
    def program_lines(err: bytes) -> list[bytes]:
        return [ln for ln in err.splitlines() if not ln.startswith(b'  File "<frozen runpy>"')]

    assert program_lines(runner.stderr) == program_lines(plain.stderr), (show(plain), show(runner))


# -- meshcomm.runtime.exits: records after the traceback ---------------------------------------------------


@pytest.mark.parametrize(
    "error,consequence,peer",
    [
        ("ValueError('own bug')", False, None),
        ("mc.PeerLostError('lost rank 2', peer=2)", True, 2),
        ("mc.CommTimeoutError('no answer', peer=None)", True, None),
    ],
)
def test_excepthook_prints_then_records(error: str, consequence: bool, peer: int | None, tmp_path: Path) -> None:
    code = (
        f"import meshcomm as mc\nfrom meshcomm.runtime import exits\nexits.install()\nexits.install()\nraise {error}\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        timeout=60,
        env=job_env(MESHCOMM_JOB_DIR=str(tmp_path), MLX_RANK="5"),
    )
    assert p.returncode == 1, show(p)
    assert p.stderr.decode().count("Traceback (most recent call last)") == 1, show(p)
    records = list((tmp_path / "failures").glob("*.json"))
    assert [r.name for r in records] == ["rank-5.json"], show(p)
    rec = json.loads(records[0].read_text())
    assert rec["rank"] == 5 and rec["code"] == 1 and rec["pid"] > 0
    assert rec["consequence"] is consequence and rec["peer"] == peer, rec
    assert rec["type"] == error.split("(")[0].split(".")[-1], rec
    assert abs(rec["time"] - time.time()) < 60, rec


def test_no_record_without_a_job_dir(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "meshcomm.launch.rank", "-c", "raise SystemExit(4)"],
        capture_output=True,
        timeout=60,
        env=job_env(),
        cwd=tmp_path,
    )
    assert p.returncode == 4 and p.stderr == b"", show(p)
    assert list(tmp_path.iterdir()) == []
