"""Run a job: plan it, let the backend set it up, start every rank, watch, stop, report."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from ..errors import ConfigError
from ..exits import JOB_DIR_ENV, read_records
from ..registry import get_registry
from .blame import Failure, blame, describe_status, exit_code
from .hosts import Host, LaunchHostfile, place_ranks
from .job import Job
from .procs import FifoOutput, OutputMux, RankProcess, die_with_parent
from .rank import OUTPUT_DIR_ENV
from .safety import check_env_name, mask, ssh_argv
from .spec import ExternalLauncher, RankEnvLauncher

__all__ = ["launch", "program_argv", "is_python", "GRACE"]

#: seconds ranks get to exit after SIGTERM before they are killed
GRACE = 3.0
#: seconds the other ranks get to exit on their own after one failed, before they are stopped
SETTLE = 1.0
#: seconds ranks get to print their stacks (SIGUSR1) before a timed-out job is stopped
STACK_WAIT = 1.0


def program_argv(argv: Sequence[str], python: str, *, remote: bool = False) -> list[str]:
    """A ``.py`` program (or ``-m module`` / ``-c code``) runs with the chosen interpreter
    through the rank runner (:mod:`meshcomm.launch.rank`); anything else runs as given."""
    if not argv:
        raise ConfigError("no program given: meshcomm launch -n N [options] -- program [args]")
    if is_python(argv):
        if remote or python == sys.executable:
            return [python, "-m", "meshcomm.launch.rank", *argv]
        # another interpreter here may not have meshcomm: the runner needs only its stdlib
        return [python, str(Path(__file__).with_name("rank.py")), *argv]
    return list(argv)


def is_python(argv: Sequence[str]) -> bool:
    """True for the programs the launcher runs with Python (and so through the rank runner)."""
    return bool(argv) and (argv[0].endswith(".py") or argv[0] in ("-m", "-c"))


def _thread_limits(places: list) -> dict[str, str]:
    """Like torchrun: ranks sharing a host split its cores between their BLAS/OpenMP pools,
    unless the user set the variables (oversubscribed thread pools slow NumPy down a lot)."""
    per_host: dict[str | None, int] = {}
    for p in places:
        per_host[p.host] = per_host.get(p.host, 0) + 1
    busiest = max(per_host.values())
    if busiest == 1:
        return {}
    threads = str(max(1, (os.cpu_count() or 1) // busiest))
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    return {k: threads for k in names if k not in os.environ}


class _Interrupt:
    """Turns SIGINT/SIGTERM into a flag the watch loop sees (restored afterwards)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> _Interrupt:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)  # type: ignore[arg-type]


def launch(
    n: int,
    argv: Sequence[str],
    *,
    backend: str = "sockets",
    hosts: LaunchHostfile | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    prefix: bool = True,
    verbose: bool = False,
    cwd: str | None = None,
    python: str | None = None,
    ssh: str = "ssh -o BatchMode=yes",
    port_base: int | None = None,
) -> int:
    """Start ``n`` ranks of ``argv`` on ``backend``; return the exit status for the shell."""
    spec = get_registry().spec(backend)
    reason = spec.unavailable_reason()
    if reason is not None:
        raise ConfigError(f"backend {spec.name!r} is not usable here: {reason}")
    support = spec.launcher
    if not isinstance(support, (RankEnvLauncher, ExternalLauncher)):
        raise ConfigError(
            f"backend {spec.name!r} cannot be started by meshcomm launch: its plugin gave no launcher "
            "support (see 'Launcher support' in the README)"
        )
    host_list = hosts.hosts if hosts else [Host(ssh="localhost")]
    places = place_ranks(n, host_list)
    interpreter = python or sys.executable
    if not argv:
        program_argv(argv, interpreter)  # the "no program given" error
    job = Job(places, verbose=verbose, port_base=port_base)
    try:
        base = {
            "MLX_BACKEND": spec.name,
            "MLX_WORLD_SIZE": str(n),
            "MESHCOMM_JOB_ID": job.job_id,
            "MESHCOMM_JOB_SECRET": job.secret,
            "PYTHONUNBUFFERED": "1",
        }
        if timeout is not None:
            base["MLX_TIMEOUT"] = f"{timeout:g}"
        base.update(_thread_limits(places))
        base.update(hosts.env() if hosts else {})
        for k in env or {}:
            check_env_name(k, f"--env {k}")
        base.update(env or {})
        workdir = cwd or os.getcwd()
        runner = is_python(argv)
        if isinstance(support, ExternalLauncher):
            local = all(p.host is None for p in places)
            prog = program_argv(argv, interpreter, remote=not local)
            if local:  # failure records and whole-line output need the job's directory
                base[JOB_DIR_ENV] = str(job.dir)
                if runner:
                    base[OUTPUT_DIR_ENV] = str(job.dir / "io")
            cmd = support.external_command(job, prog, base)
            return _run_external(job, cmd, base, workdir, prefix, verbose, runner)
        base[JOB_DIR_ENV] = str(job.dir)
        envs = support.rank_env(job)
        if len(envs) != n:
            raise ConfigError(f"backend {spec.name!r} launcher returned {len(envs)} environments for {n} ranks")
        cleanup = support.cleanup_command(job) if hasattr(support, "cleanup_command") else None
        progs = [program_argv(argv, interpreter, remote=p.host is not None) for p in places]
        return _run_ranks(job, progs, base, envs, workdir, prefix, verbose, shlex.split(ssh), cleanup, runner)
    finally:
        job.cleanup()


class _Watch:
    """What the launcher learns while a job runs: exits, failure records, stack requests."""

    def __init__(self, job: Job, signal_ranks: Callable[[int], None] | None) -> None:
        self.job = job
        self.failures: list[Failure] = []
        self.records: list[dict[str, Any]] = []
        self._signal_ranks = signal_ranks
        self.stacks_requested = False

    def note_exits(self, statuses: list[tuple[int, int | None]]) -> None:
        seen = {f.rank for f in self.failures}
        for rank, rc in statuses:
            if rc is not None and rc != 0 and rank not in seen:
                self.failures.append(Failure(rank, rc, time.time()))

    def note_records(self) -> None:
        self.records = read_records(self.job.dir)

    def timed_out(self) -> bool:
        """The first failure is a rank's CommTimeoutError: the job hangs somewhere."""
        return bool(self.records) and self.records[0].get("type") == "CommTimeoutError"

    def dump_stacks(self, sleep: Callable[[float], None]) -> None:
        """Ask every live rank for its Python stacks (SIGUSR1 to the rank runner), once, and
        give them a moment to print before the job is stopped."""
        if self.stacks_requested or self._signal_ranks is None:
            return
        self.stacks_requested = True
        sys.stderr.write("meshcomm launch: a rank timed out; every rank's Python stack follows\n")
        sys.stderr.flush()
        self._signal_ranks(signal.SIGUSR1)
        sleep(STACK_WAIT)


def _run_ranks(job: Job, progs: list[list[str]], base: dict[str, str], envs: list[dict[str, str]], cwd: str,
               prefix: bool, verbose: bool, ssh: list[str], cleanup: str | None, runner: bool) -> int:
    mux = OutputMux(prefix)
    procs: list[RankProcess] = []

    def signal_ranks(sig: int) -> None:
        for p in procs:
            p.signal_rank(sig)

    watch = _Watch(job, signal_ranks if runner else None)
    with _Interrupt() as intr:
        try:
            for place in job.places:
                env = {**base, "MLX_RANK": str(place.rank), **envs[place.rank]}
                procs.append(RankProcess(
                    place.rank, place.host, progs[place.rank], env, cwd=cwd, ssh=ssh, mux=mux,
                    pass_fds=job.fds_for(place.rank), files=job.files, filedir=str(job.dir),
                    verbose=verbose,
                ))
        except OSError as exc:
            _stop(procs)
            raise ConfigError(f"cannot start rank {len(procs)}: {exc}") from None
        job.release_fds()

        def sleep(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and intr.signum is None:
                watch.note_exits([(p.rank, p.poll()) for p in procs])
                time.sleep(0.02)

        while True:
            codes = [p.poll() for p in procs]
            watch.note_exits([(p.rank, rc) for p, rc in zip(procs, codes, strict=True)])
            watch.note_records()
            if watch.timed_out():
                watch.dump_stacks(sleep)
                break
            if watch.failures or intr.signum is not None:
                break
            if all(rc is not None for rc in codes):
                break
            time.sleep(0.05)
        if watch.failures and intr.signum is None and not watch.stacks_requested:
            # The other ranks usually end of this failure on their own (PeerLostError) within
            # a moment: let them, so that their records and messages are there to read.
            deadline = time.monotonic() + SETTLE
            while time.monotonic() < deadline and intr.signum is None and any(p.poll() is None for p in procs):
                time.sleep(0.02)
            watch.note_exits([(p.rank, p.poll()) for p in procs])
        watch.note_records()
        running = [p.rank for p in procs if p.poll() is None]
        verdict = blame(watch.failures, watch.records, running)
        if verdict is not None or intr.signum is not None:
            _stop(procs)
        else:
            running = []
        for p in procs:
            p.join_output()
        remote_records = _cleanup_hosts(job, ssh, cleanup, fetch_records=verdict is not None)
        if remote_records:
            verdict = blame(watch.failures, sorted(watch.records + remote_records,
                                                   key=lambda r: (r.get("time", 0.0), r.get("rank") or 0)),
                            running)
    if intr.signum is not None:
        sys.stderr.write(f"meshcomm launch: interrupted by {signal.Signals(intr.signum).name}; stopped all ranks\n")
        return 128 + intr.signum
    if verdict is not None:
        others = f"; stopped ranks {', '.join(map(str, running))}" if running else ""
        host = job.places[verdict.rank].host if 0 <= verdict.rank < job.nranks else None
        where = f" on {host}" if host else ""
        sys.stderr.write(f"meshcomm launch: rank {verdict.rank}{where} {verdict.text}{others}\n")
        return verdict.code
    return 0


def _stop(procs: list[RankProcess]) -> None:
    """SIGTERM every rank's process group, then SIGKILL them after the grace period (groups
    of ranks that already exited too: what they started must not outlive the job)."""
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        p.signal(signal.SIGKILL)
    for p in procs:
        try:
            p.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _cleanup_hosts(job: Job, ssh: list[str], backend_cmd: str | None,
                   fetch_records: bool = False) -> list[dict[str, Any]]:
    """Remove the job's files on remote hosts and run the backend's clean-up command (if
    any) on every host, whatever way the job ended. When the job failed, the failure records
    remote ranks left are read first (printed by the same ssh command) and returned."""
    records: list[dict[str, Any]] = []
    for host in job.hosts:
        parts = [] if host is None else [_remote_cleanup(str(job.dir), fetch_records)]
        if backend_cmd:
            parts.append(backend_cmd)
        if not parts:
            continue
        cmd = ["bash", "-c", "; ".join(parts)] if host is None else ssh_argv(ssh, host, "; ".join(parts))
        try:
            done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, timeout=15, check=False)
        except subprocess.TimeoutExpired:
            continue
        if host is not None and fetch_records:
            for line in done.stdout.splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    records.append(rec)
    return records


def _remote_cleanup(folder: str, fetch_records: bool) -> str:
    """Shell command for a remote host: print the failure records (when asked) and remove
    the job's directory, only if it is ours (a directory, not a symlink, owned by this user:
    one another user made, which the ranks refused to use, is neither read nor removed)."""
    d = shlex.quote(folder)
    body = f"rm -rf {d}"
    if fetch_records:
        records = shlex.quote(folder + "/failures")
        body = f'for f in {records}/rank-*.json; do [ -f "$f" ] && cat "$f" && echo; done; ' + body
    return f"if [ -d {d} ] && [ ! -L {d} ] && [ -O {d} ]; then {body}; fi"


def _run_external(job: Job, cmd: list[str], base: dict[str, str], cwd: str, prefix: bool, verbose: bool,
                  runner: bool) -> int:
    """Run the one command that starts every rank (mpiexec). Ranks run through the rank
    runner write their output to FIFOs read here (whole lines, prefixed by us), their
    failure records to the job's directory (blame, and stacks on a timeout)."""
    if verbose:  # the secret is never on the command line; masked anyway, and in the environment
        sys.stderr.write("meshcomm launch: " + mask(" ".join(shlex.quote(c) for c in cmd), base) + "\n")
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in base.items())
        sys.stderr.write(f"meshcomm launch: variables set for {cmd[0]} and every rank: {mask(shown, base)}\n")
    fifos = None
    if OUTPUT_DIR_ENV in base:
        fifos = FifoOutput(base[OUTPUT_DIR_ENV], job.nranks, OutputMux(prefix))
    with _Interrupt() as intr:
        # mpiexec gets SIGTERM if we die, so it can stop its ranks (which also die with
        # their parent: the rank runner asks for that)
        proc = subprocess.Popen(cmd, env={**os.environ, **base}, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        assert proc.stdout is not None and proc.stderr is not None
        plain = OutputMux(False)  # mpiexec's own messages (and ranks' output when it tags them)
        pumps = [plain.pump(proc.stdout, sys.stdout.buffer, "", strip_nul=True),
                 plain.pump(proc.stderr, sys.stderr.buffer, "", strip_nul=True)]

        def signal_ranks(sig: int) -> None:
            if proc.poll() is None:
                proc.send_signal(sig)  # Open MPI's and MPICH's (Hydra) mpiexec forward SIGUSR1

        watch = _Watch(job, signal_ranks if runner else None)

        def sleep(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and intr.signum is None and proc.poll() is None:
                time.sleep(0.02)

        stopped = False
        while proc.poll() is None and intr.signum is None:
            watch.note_records()
            if watch.timed_out() and not watch.stacks_requested:
                watch.dump_stacks(sleep)
                stopped = True
                break
            time.sleep(0.05)
        if (intr.signum is not None or stopped) and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(GRACE * 2)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _kill_ranks(job)
        if fifos is not None:
            fifos.close()
        for t in pumps:
            t.join(2.0)
    if intr.signum is not None:
        sys.stderr.write(f"meshcomm launch: interrupted by {signal.Signals(intr.signum).name}; stopped all ranks\n")
        return 128 + intr.signum
    rc = proc.returncode
    watch.note_records()
    verdict = blame([], watch.records) if watch.records else None
    if verdict is not None:
        sys.stderr.write(f"meshcomm launch: rank {verdict.rank} {verdict.text}\n")
        # A rank its peers say was lost (killed: no record of its own) ended the job with the
        # status mpiexec reports for it, not with the survivors' code 1 -- unless that status
        # is only our own stopping of mpiexec.
        return exit_code(rc) if verdict.lost and rc != 0 and not stopped else verdict.code
    if rc != 0:
        sys.stderr.write(f"meshcomm launch: {cmd[0]} {describe_status(rc)}\n")
    return exit_code(rc)


def _rank_pids(job: Job) -> list[int]:
    """Pids the local ranks' runners recorded (``<job dir>/pids``)."""
    pids = []
    for f in (job.dir / "pids").glob("rank-*.pid"):
        try:
            pids.append(int(f.read_text()))
        except (OSError, ValueError):
            continue
    return pids


def _kill_ranks(job: Job) -> None:
    """Ranks of an external launcher that are still there once it ended (it was killed, or
    left them): SIGKILL, so that none outlives the job."""
    for pid in _rank_pids(job):
        try:
            os.kill(pid, 0)
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except (OSError, ProcessLookupError):
            continue
        if f"MESHCOMM_JOB_ID={job.job_id}".encode() in env.split(b"\0"):  # not a recycled pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
