"""Run a job: plan it, let the backend set it up, start every rank, watch, stop, report."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from ..protocol.errors import BackendUnavailableError, ConfigError
from ..runtime.exits import JOB_DIR_ENV, STACKS_FILE, read_records
from ..runtime.launchsafety import check_env_name, mask
from ..runtime.launchspec import CleanupLauncher, ExternalLauncher, RankEnvLauncher
from ..runtime.lifetime import die_with_parent, stop, wait_until
from ..runtime.private_files import private_dir
from ..runtime.registry import BackendSpec, get_registry
from .blame import Failure, blame, describe_status, exit_code
from .hosts import Host, job_size, place_ranks
from .job import Job
from .mpiexec_lines import MpiexecLines
from .options import LaunchOptions
from .preflight import check_program, check_settings, check_timeout
from .procs import FifoOutput, RankOutput, pump_lines, say
from .rank import OUTPUT_DIR_ENV
from .reaper import in_job
from .starters import HostStart, RankStart, Session, Starter
from .starters import choose as choose_starter

__all__ = ["launch", "program_argv", "is_python", "GRACE"]

#: seconds ranks get to exit after SIGTERM before they are killed
GRACE = 3.0
#: seconds the other ranks get to exit on their own after one failed, before they are stopped
SETTLE = 1.0
#: seconds ranks get to print their stacks (SIGUSR1) before a timed-out job is stopped
STACK_WAIT = 1.0


def program_argv(argv: Sequence[str], python: str, *, remote: bool = False, exec_other: bool = False) -> list[str]:
    """A ``.py`` program (or ``-m module`` / ``-c code``) runs with the chosen interpreter
    through the rank runner (:mod:`meshcomm.launch.rank`); anything else runs as given, or
    with ``exec_other`` through the runner's ``--exec`` (which sets up the rank, then execs it)."""
    if not argv:
        raise ConfigError("no program given: meshcomm launch -n N [options] -- program [args]")
    if is_python(argv) or exec_other:
        args = list(argv) if is_python(argv) else ["--exec", *argv]
        if remote or python == sys.executable:
            return [python, "-m", "meshcomm.launch.rank", *args]
        # another interpreter here may not have meshcomm: the runner needs only its stdlib
        return [python, str(Path(__file__).with_name("rank.py")), *args]
    return list(argv)


def is_python(argv: Sequence[str]) -> bool:
    """True for the programs the launcher runs with Python (and so through the rank runner)."""
    return bool(argv) and (argv[0].endswith(".py") or argv[0] in ("-m", "-c"))


def own_python_program(argv: Sequence[str], interpreter: str) -> list[str]:
    """``python prog.py ARGS`` (``-m mod``, ``-c code``) where ``python`` is this launch's
    interpreter (same directory, so the same environment) becomes ``prog.py ARGS``: the rank
    runner then runs it in-process, exactly as ``python`` would, and adds what a rank needs
    (the failing rank's own exit code and failure record, stacks, parent death). Other
    commands, and other interpreters, are left as given."""
    if len(argv) < 2 or not is_python(argv[1:]) or not Path(argv[0]).name.startswith("python"):
        return list(argv)
    found = shutil.which(argv[0]) if os.sep not in argv[0] else argv[0]
    if found is None:
        return list(argv)
    # the same file (not python3.9 beside python3.11) in the same directory (a venv's python
    # is a link to the base interpreter, which lacks the venv's packages)
    same = Path(os.path.abspath(found)).parent == Path(os.path.abspath(interpreter)).parent and os.path.realpath(
        found
    ) == os.path.realpath(interpreter)
    return list(argv[1:]) if same else list(argv)


#: the variables that size a rank's BLAS/OpenMP thread pools
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


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
    return {k: threads for k in THREAD_VARS if k not in os.environ}


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


def launch(options: LaunchOptions) -> int:
    """Run the job ``options`` describes; return the exit status for the shell."""
    name, source = options.backend_choice()
    try:
        spec = get_registry().spec(name)
    except (ValueError, BackendUnavailableError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    reason = spec.unavailable_reason()
    if reason is not None:
        raise ConfigError(f"backend {spec.name!r} is not usable here: {reason}")
    support = spec.launcher
    if not isinstance(support, (RankEnvLauncher, ExternalLauncher)):
        raise ConfigError(
            f"backend {spec.name!r} cannot be started by meshcomm launch: its plugin gave no launcher "
            "support (see 'Launcher support' in docs/writing-a-backend.md)"
        )
    argv = list(options.program)
    interpreter = options.python or sys.executable
    if not argv:
        program_argv(argv, interpreter)  # the "no program given" error
    external = isinstance(support, ExternalLauncher)
    starter = None if external else choose_starter(options)
    if options.hosts is not None:
        host_list = options.hosts.hosts
    else:
        default_hosts = getattr(starter, "default_hosts", None)
        host_list = (default_hosts(options.nranks) if default_hosts else None) or [Host(ssh="localhost")]
    n = job_size(options.nranks, host_list, options.ranks_per_host)
    places = place_ranks(n, host_list, options.ranks_per_host, local_ranks=getattr(starter, "local_ranks", True))
    _check_before_start(options, spec, places, n)
    if options.restart_lost and external:
        raise ConfigError(
            f"--restart-lost {options.restart_lost}: replacements are started for a backend meshcomm launch "
            f"starts itself (sockets, gloo); {spec.name} runs under mpiexec"
        )
    if all(p.host is None for p in places):
        argv = own_python_program(argv, interpreter)
    output = RankOutput(options.prefix, n, options.log_dir)
    try:
        # a shared-memory directory only for an MPI-style launcher, whose library keeps its files there
        job = Job(
            places,
            verbose=options.verbose,
            port_base=options.port_base,
            shm_dir=external,
            keep_going=options.keep_going or bool(options.restart_lost),
        )
    except BaseException:
        output.close()
        raise
    trace_dir: str | None = None
    try:
        base = {
            "MLX_BACKEND": spec.name,
            "MLX_WORLD_SIZE": str(n),
            "MESHCOMM_JOB_ID": job.job_id,
            "MESHCOMM_JOB_SECRET": job.secret,
            "PYTHONUNBUFFERED": "1",
        }
        if options.timeout is not None:
            base["MLX_TIMEOUT"] = f"{options.timeout:g}"
        if options.trace is not None:
            base["MESHCOMM_TRACE"] = trace_dir = _fresh_trace_dir(options.trace)
        base.update(_thread_limits(places))
        base.update(options.hosts.env() if options.hosts else {})
        for k in options.env:
            check_env_name(k, f"--env {k}")
        base.update(options.env)
        workdir = options.cwd or os.getcwd()
        runner = is_python(argv)
        if isinstance(support, ExternalLauncher):
            local = all(p.host is None for p in places)
            # every rank runs through the rank runner (non-Python programs with --exec): it
            # sets MLX_RANK & co. from the MPI launcher's variables and, on this machine,
            # sends its output to the launcher's FIFOs (the same [rank R] prefix as elsewhere)
            prog = program_argv(argv, interpreter, remote=not local, exec_other=True)
            if local:  # failure records and whole-line output need the job's directory
                base[JOB_DIR_ENV] = str(job.dir)
                base[OUTPUT_DIR_ENV] = str(job.dir / "io")
            cmd = support.external_command(job, prog, base)
            return _run_external(job, cmd, base, workdir, output, options.verbose, runner)
        base[JOB_DIR_ENV] = str(job.dir)
        envs = support.rank_env(job)
        if len(envs) != n:
            raise ConfigError(f"backend {spec.name!r} launcher returned {len(envs)} environments for {n} ranks")
        cleanup = support.cleanup_command(job) if isinstance(support, CleanupLauncher) else None
        local_size: dict[str | None, int] = {}
        for p in places:
            local_size[p.host] = local_size.get(p.host, 0) + 1
        by_host: dict[str | None, list[RankStart]] = {}
        for p in places:
            rank_env = {
                "MLX_RANK": str(p.rank),
                "MLX_LOCAL_RANK": str(p.local_index),
                "MLX_LOCAL_SIZE": str(local_size[p.host]),
                **envs[p.rank],
            }
            by_host.setdefault(p.host, []).append(
                RankStart(
                    p, program_argv(argv, interpreter, remote=p.host is not None), rank_env, tuple(job.fds_for(p.rank))
                )
            )
        host_starts = [
            HostStart(
                host,
                ranks,
                base,
                workdir,
                str(job.dir),
                files=dict(job.files),
                cleanup=cleanup,
                python=interpreter,
                verbose=options.verbose,
            )
            for host, ranks in by_host.items()
        ]
        assert starter is not None
        keep_going = options.keep_going or bool(options.restart_lost)
        return _run_ranks(job, starter, host_starts, output, runner, keep_going, options.restart_lost)
    finally:
        output.close()
        job.cleanup()
        if trace_dir is not None:  # only the directory --trace named, checked and emptied
            _merge_trace(trace_dir)


def _check_before_start(options: LaunchOptions, spec: BackendSpec, places: list, n: int) -> None:
    """Everything the ranks would reject, refused once here before any of them starts."""
    check_timeout(options.timeout)
    if all(p.host is None for p in places):
        check_program(options.program, options.cwd or os.getcwd())
    given = dict(options.hosts.env() if options.hosts else {})
    given.update(options.env)
    if options.timeout is not None:
        given["MLX_TIMEOUT"] = f"{options.timeout:g}"
    # ranks on other hosts get only what the launcher gives them, not this environment
    check_settings(spec, given, n, inherit=all(p.host is None for p in places))


def _fresh_trace_dir(folder: str) -> str:
    """``folder`` made absolute and created, without the rank files of an earlier job."""
    path = private_dir(Path(folder).absolute(), "--trace")  # not another user's: no links planted in it
    try:
        for old in path.glob("rank-*.json"):
            old.unlink()
    except OSError as exc:
        raise ConfigError(f"--trace {folder}: cannot use this directory: {exc}") from None
    return str(path)


def _merge_trace(folder: str) -> None:
    """Merge the ranks' trace files (however the job ended) and say where the result is."""
    from ..trace.chrome import merge_dir

    try:
        path, missing = merge_dir(folder)
    except (OSError, ValueError) as exc:
        say(f"meshcomm launch: no merged trace: {exc}\n")
        return
    lost = f" (no file from ranks {', '.join(map(str, missing))}: killed, or on another host)" if missing else ""
    say(f"meshcomm launch: trace written to {path}{lost}\n")


class _Watch:
    """What the launcher learns while a job runs: exits, failure records, stack requests."""

    def __init__(
        self,
        job: Job,
        signal_ranks: Callable[[int], None] | None,
        remote_records: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.job = job
        self._remote_records = remote_records
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
        """This machine's records, and those the starters brought from other hosts (the
        same record once, when a "remote" host is this machine)."""
        records = read_records(self.job.dir)
        if self._remote_records is not None:
            seen = {_record_key(r) for r in records}
            for rec in self._remote_records():
                if _record_key(rec) not in seen:
                    seen.add(_record_key(rec))
                    records.append(rec)
            records.sort(key=lambda r: (r.get("time", 0.0), r.get("rank") or 0))
        self.records = records

    def timed_out(self) -> bool:
        """The first failure is a rank's CommTimeoutError: the job hangs somewhere."""
        return bool(self.records) and self.records[0].get("type") == "CommTimeoutError"

    def dump_stacks(self, sleep: Callable[[float], None]) -> None:
        """Ask every live rank for its Python stacks (SIGUSR1 to the rank runner), once, and
        give them a moment to print before the job is stopped."""
        if self.stacks_requested or self._signal_ranks is None:
            return
        self.stacks_requested = True
        say("meshcomm launch: a rank timed out; every rank's Python stack follows\n")
        self._signal_ranks(signal.SIGUSR1)
        sleep(STACK_WAIT)


def _record_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    return rec.get("rank"), rec.get("pid"), rec.get("time"), rec.get("type")


def _run_ranks(
    job: Job,
    starter: Starter,
    hosts: list[HostStart],
    output: RankOutput,
    runner: bool,
    keep_going: bool = False,
    restart_lost: int = 0,
) -> int:
    sessions: list[Session] = []

    def signal_ranks(sig: int) -> None:
        for s in sessions:
            s.signal_rank(sig)

    def remote_records() -> list[dict[str, Any]]:
        return [rec for s in sessions for rec in s.records()]

    def statuses() -> dict[int, int | None]:
        merged: dict[int, int | None] = {}
        for s in sessions:
            merged.update(s.poll())
        return merged

    watch = _Watch(job, signal_ranks if runner else _stack_signaller(job), remote_records)
    with _Interrupt() as intr:
        try:
            sessions = starter.start(hosts, output)
        except OSError as exc:
            raise ConfigError(str(exc)) from None
        finally:
            job.release_fds()

        def sleep(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and intr.signum is None:
                watch.note_exits(sorted(statuses().items()))
                time.sleep(0.02)

        lost: list[Failure] = []  # failures a replacement was started for (--restart-lost)
        while True:
            codes = statuses()
            watch.note_exits(sorted(codes.items()))
            if len(lost) < restart_lost:
                _restart(sessions, watch, lost, restart_lost)
                codes = statuses()
            watch.note_records()
            if intr.signum is not None or all(rc is not None for rc in codes.values()):
                break
            if not keep_going:  # else the survivors go on (Group.shrink) and end on their own
                if watch.timed_out():
                    watch.dump_stacks(sleep)
                    break
                if watch.failures:
                    break
            time.sleep(0.05)
        gone = [*lost, *watch.failures]
        if keep_going and intr.signum is None and gone and any(rc == 0 for rc in statuses().values()):
            for s in sessions:
                s.finish()
            names = ", ".join(f"{f.rank} ({describe_status(f.status)})" for f in sorted(gone, key=lambda f: f.rank))
            say(f"meshcomm launch: ranks lost during the job: {names}; the others went on and exited 0\n")
            return 0
        if watch.failures and intr.signum is None and not watch.stacks_requested:
            # The other ranks usually end of this failure on their own (PeerLostError) within
            # a moment: let them, so that their records and messages are there to read.
            deadline = time.monotonic() + SETTLE
            while time.monotonic() < deadline and intr.signum is None and any(rc is None for rc in statuses().values()):
                time.sleep(0.02)
            watch.note_exits(sorted(statuses().items()))
        watch.note_records()
        running = sorted(r for r, rc in statuses().items() if rc is None)
        verdict = blame(watch.failures, watch.records, running)
        if verdict is not None or intr.signum is not None:
            _stop(sessions, statuses)
        else:
            running = []
        for s in sessions:  # last output, remote clean-up, late remote records
            s.finish()
        if verdict is not None and remote_records():
            watch.note_records()
            verdict = blame(watch.failures, watch.records, running)
    if intr.signum is not None:
        say(f"meshcomm launch: interrupted by {signal.Signals(intr.signum).name}; stopped all ranks\n")
        return 128 + intr.signum
    if verdict is not None:
        others = f"; stopped ranks {', '.join(map(str, running))}" if running else ""
        host = job.places[verdict.rank].host if 0 <= verdict.rank < job.nranks else None
        where = f" on {host}" if host else ""
        say(f"meshcomm launch: rank {verdict.rank}{where} {verdict.text}{others}\n")
        return verdict.code
    return 0


def _restart(sessions: list[Session], watch: _Watch, lost: list[Failure], limit: int) -> None:
    """Start a replacement for each newly failed rank while ``limit`` allows (``--restart-lost``):
    the same program and environment, with ``MESHCOMM_JOIN=1``, so it joins when the
    others call ``grow()``."""
    for f in list(watch.failures):
        if len(lost) >= limit:
            return
        session = next((s for s in sessions if f.rank in s.ranks), None)
        restart = getattr(session, "restart", None)
        if restart is None:
            continue
        watch.failures.remove(f)
        lost.append(f)
        say(
            f"meshcomm launch: rank {f.rank} {describe_status(f.status)}; starting a replacement that joins when "
            f"the others call grow() ({len(lost)} of {limit})\n"
        )
        restart(f.rank)


def _stop(sessions: list[Session], statuses: Callable[[], dict[int, int | None]]) -> None:
    """Stop every rank's process group (:func:`.lifetime.stop`: SIGTERM, SIGCONT, SIGKILL after
    the grace period), groups of ranks that already exited too: what they started must not
    outlive the job."""

    def send(signals: Sequence[int]) -> None:
        for s in sessions:  # one session after another, each its signals in order
            for sig in signals:
                s.signal(sig)

    stop(
        send,
        lambda grace: wait_until(lambda: all(rc is not None for rc in statuses().values()), grace),
        GRACE,
        kill_always=True,
    )


def _run_external(
    job: Job, cmd: list[str], base: dict[str, str], cwd: str, output: RankOutput, verbose: bool, runner: bool
) -> int:
    """Run the one command that starts every rank (mpiexec). Ranks run through the rank
    runner write their output to FIFOs read here (whole lines, prefixed by us), their
    failure records to the job's directory (blame, and stacks on a timeout)."""
    if verbose:  # the secret is never on the command line; masked anyway, and in the environment
        say("meshcomm launch: " + mask(" ".join(shlex.quote(c) for c in cmd), base) + "\n")
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in base.items())
        say(f"meshcomm launch: variables set for {cmd[0]} and every rank: {mask(shown, base)}\n")
    fifos = None
    if OUTPUT_DIR_ENV in base:
        fifos = FifoOutput(base[OUTPUT_DIR_ENV], job.nranks, output)
    with _Interrupt() as intr:
        # mpiexec gets SIGTERM if we die, so it can stop its ranks (which also die with
        # their parent: the rank runner asks for that)
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **base},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),
        )
        assert proc.stdout is not None and proc.stderr is not None
        # mpiexec's own messages, and the ranks' output when it tags them (ranks on other hosts)
        own = {stream: MpiexecLines(_host_writer(output, stream)) for stream in ("out", "err")}
        pumps = [
            pump_lines(proc.stdout, _retagger(output, "out", own["out"]), strip_nul=True),
            pump_lines(proc.stderr, _retagger(output, "err", own["err"]), strip_nul=True),
        ]

        def signal_ranks(sig: int) -> None:
            if proc.poll() is None:
                proc.send_signal(sig)  # Open MPI's and MPICH's (Hydra) mpiexec forward SIGUSR1

        watch = _Watch(job, signal_ranks if runner else _stack_signaller(job))

        def sleep(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and intr.signum is None and proc.poll() is None:
                time.sleep(0.02)

        stopped = False
        while proc.poll() is None and intr.signum is None:
            watch.note_records()
            # under --keep-going a rank's timeout is the survivors' to handle (Group.shrink)
            if watch.timed_out() and not watch.stacks_requested and not job.keep_going:
                watch.dump_stacks(sleep)
                stopped = True
                break
            time.sleep(0.05)
        if (intr.signum is not None or stopped) and proc.poll() is None:
            # mpiexec's group: SIGTERM, SIGCONT, SIGKILL only if it has not ended after 2 x GRACE
            stop(
                lambda signals: _killpg(proc.pid, signals),
                lambda grace: _ended(proc, grace),
                GRACE * 2,
                kill_always=False,
            )
            proc.wait()
        _kill_ranks(job)
        if fifos is not None:
            fifos.close()
        for t in pumps:
            t.join(2.0)
        for lines in own.values():
            lines.close()
    if intr.signum is not None:
        say(f"meshcomm launch: interrupted by {signal.Signals(intr.signum).name}; stopped all ranks\n")
        return 128 + intr.signum
    rc = proc.returncode
    watch.note_records()
    done = _ranks_done(job)
    if job.keep_going and done and len(done) < job.nranks and not stopped:
        lost = ", ".join(str(r) for r in range(job.nranks) if r not in done)
        say(f"meshcomm launch: ranks lost during the job: {lost}; the others went on and exited 0\n")
        return 0
    verdict = blame([], watch.records) if watch.records else None
    if verdict is not None:
        say(f"meshcomm launch: rank {verdict.rank} {verdict.text}\n")
        # A rank its peers say was lost (killed: no record of its own) ended the job with the
        # status mpiexec reports for it, not with the survivors' code 1 -- unless that status
        # is only our own stopping of mpiexec.
        return exit_code(rc) if verdict.lost and rc != 0 and not stopped else verdict.code
    if rc != 0:
        say(f"meshcomm launch: {cmd[0]} {describe_status(rc)}\n")
    return exit_code(rc)


def _killpg(pgid: int, signals: Sequence[int]) -> None:
    """Send ``signals``, in order, to the process group ``pgid``."""
    for sig in signals:
        os.killpg(pgid, sig)


def _ended(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to end; whether it did."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


#: how mpiexec tags a rank's line: Open MPI ``--tag-output`` (``[1,2]<stdout>: ``), MPICH
#: ``-prepend-rank`` (``[2] ``)
_MPI_TAG = re.compile(rb"^\[\d+,(\d+)\]<(stdout|stderr|stddiag)>: ?|^\[(\d+)\] ")


def _host_writer(output: RankOutput, stream: str) -> Callable[[bytes], None]:
    return lambda line: output.host_line("mpiexec", stream, line)


def _retagger(output: RankOutput, stream: str, mpiexec: MpiexecLines) -> Callable[[bytes], None]:
    """Deliver mpiexec's lines: a line mpiexec tagged with a rank goes out as that rank's
    (prefixed ``[rank R] `` like on every backend, and into its log); mpiexec's own lines
    as ``[mpiexec] `` lines, its failure banners condensed (:mod:`.mpiexec_lines`)."""

    def deliver(line: bytes) -> None:
        m = _MPI_TAG.match(line)
        if m is None:
            mpiexec.feed(line)
            return
        rank = int(m.group(1) or m.group(3))
        own = "err" if m.group(2) in (b"stderr", b"stddiag") else ("out" if m.group(2) else stream)
        output.rank_line(rank, own, line[m.end() :])

    return deliver


def _job_pids(job: Job, pattern: str) -> list[int]:
    """Live pids of this job's local ranks recorded in ``<job dir>/pids/PATTERN`` (checked
    against the job's id in their environment, so a recycled pid is never signalled)."""
    pids = []
    for f in (job.dir / "pids").glob(pattern):
        try:
            pid = int(f.read_text())
        except (OSError, ValueError):
            continue
        if in_job(pid, job.job_id):
            pids.append(pid)
    return pids


def _ranks_done(job: Job) -> set[int]:
    """Ranks whose program ended with status 0 (the rank runner's ``pids/rank-R.done``)."""
    done = set()
    for f in (job.dir / "pids").glob("rank-*.done"):
        try:
            done.add(int(f.name[len("rank-") : -len(".done")]))
        except ValueError:
            continue
    return done


def _stack_signaller(job: Job) -> Callable[[int], None]:
    """Signals the ranks that said they print their stacks on SIGUSR1 (``meshcomm.init`` does,
    :data:`meshcomm.runtime.exits.STACKS_FILE`): for programs the rank runner does not run
    (``-- python prog.py``), whose processes would otherwise die of the signal."""

    def signal_ranks(sig: int) -> None:
        for pid in _job_pids(job, STACKS_FILE.format(rank="*")):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    return signal_ranks


def _kill_ranks(job: Job) -> None:
    """Ranks of an external launcher that are still there once it ended (it was killed, or
    left them): SIGKILL, so that none outlives the job."""
    for pid in _job_pids(job, "rank-*.pid"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
