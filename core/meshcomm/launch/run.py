"""Run a job: plan it, let the backend set it up, start every rank, watch, stop, report."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from ..errors import ConfigError
from ..registry import get_registry
from .hosts import Host, LaunchHostfile, place_ranks
from .job import Job
from .procs import OutputMux, RankProcess
from .spec import ExternalLauncher, RankEnvLauncher

__all__ = ["launch", "program_argv", "GRACE"]

#: seconds ranks get to exit after SIGTERM before they are killed
GRACE = 3.0
#: seconds the other ranks get to exit on their own after one failed, before they are stopped
SETTLE = 1.0


def program_argv(argv: Sequence[str], python: str) -> list[str]:
    """A ``.py`` program (or ``-m module`` / ``-c code``) runs with the chosen interpreter;
    anything else runs as given."""
    if not argv:
        raise ConfigError("no program given: meshcomm launch -n N [options] -- program [args]")
    if argv[0].endswith(".py") or argv[0] in ("-m", "-c"):
        return [python, *argv]
    return list(argv)


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


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


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
    prog = program_argv(argv, python or sys.executable)
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
        for item in (hosts.envs if hosts else []):
            k, _, v = item.partition("=")
            base[k] = v
        base.update(env or {})
        workdir = cwd or os.getcwd()
        if isinstance(support, ExternalLauncher):
            cmd = support.external_command(job, prog, base)
            return _run_external(cmd, base, workdir, verbose)
        envs = support.rank_env(job)
        if len(envs) != n:
            raise ConfigError(f"backend {spec.name!r} launcher returned {len(envs)} environments for {n} ranks")
        cleanup = support.cleanup_command(job) if hasattr(support, "cleanup_command") else None
        return _run_ranks(job, prog, base, envs, workdir, prefix, verbose, shlex.split(ssh), cleanup)
    finally:
        job.cleanup()


def _run_ranks(job: Job, prog: list[str], base: dict[str, str], envs: list[dict[str, str]], cwd: str,
               prefix: bool, verbose: bool, ssh: list[str], cleanup: str | None) -> int:
    mux = OutputMux(prefix)
    procs: list[RankProcess] = []
    with _Interrupt() as intr:
        try:
            for place in job.places:
                env = {**base, "MLX_RANK": str(place.rank), **envs[place.rank]}
                procs.append(RankProcess(
                    place.rank, place.host, prog, env, cwd=cwd, ssh=ssh, mux=mux,
                    pass_fds=job.fds_for(place.rank), files=job.files, filedir=str(job.dir),
                    verbose=verbose,
                ))
        except OSError as exc:
            _stop(procs)
            raise ConfigError(f"cannot start rank {len(procs)}: {exc}") from None
        job.release_fds()
        failures: list[tuple[int, int]] = []  # (rank, status) in the order they were seen
        while True:
            codes = [p.poll() for p in procs]
            _note_failures(procs, codes, failures)
            if failures or intr.signum is not None:
                break
            if all(rc is not None for rc in codes):
                break
            time.sleep(0.05)
        if failures and intr.signum is None:
            # The other ranks usually die of this failure on their own (PeerLostError, status 1),
            # often before the failed rank's interpreter has finished exiting: wait a moment so
            # the summary names the rank that failed first rather than the lowest-numbered one.
            deadline = time.monotonic() + SETTLE
            while time.monotonic() < deadline and intr.signum is None and any(p.poll() is None for p in procs):
                time.sleep(0.02)
            _note_failures(procs, [p.poll() for p in procs], failures)
        failed = _culprit(failures)
        if failed is not None or intr.signum is not None:
            running = [p.rank for p in procs if p.poll() is None]
            _stop(procs)
        for p in procs:
            p.join_output()
        _cleanup_hosts(job, ssh, cleanup)
    if intr.signum is not None:
        sys.stderr.write(f"meshcomm launch: interrupted by {signal.Signals(intr.signum).name}; stopped all ranks\n")
        return 128 + intr.signum
    if failed is not None:
        rank, rc = failed
        others = f"; stopped ranks {', '.join(map(str, running))}" if running else ""
        where = f" on {job.places[rank].host}" if job.places[rank].host else ""
        sys.stderr.write(f"meshcomm launch: rank {rank}{where} {_describe(rc)}{others}\n")
        return _exit_code(rc)
    return 0


def _note_failures(procs: list[RankProcess], codes: list[int | None], failures: list[tuple[int, int]]) -> None:
    seen = {rank for rank, _ in failures}
    for p, rc in zip(procs, codes, strict=True):
        if rc is not None and rc != 0 and p.rank not in seen:
            failures.append((p.rank, rc))


def _culprit(failures: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The failure to report: the first one seen that is not a plain status 1 (the status of
    an uncaught exception, which is how ranks that lost a peer end), else the first one."""
    for rank, rc in failures:
        if rc != 1:
            return rank, rc
    return failures[0] if failures else None


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


def _cleanup_hosts(job: Job, ssh: list[str], backend_cmd: str | None) -> None:
    """Remove the job's files on remote hosts and run the backend's clean-up command (if
    any) on every host, whatever way the job ended."""
    for host in job.hosts:
        parts = [] if host is None else [f"rm -rf {shlex.quote(str(job.dir))}"]
        if backend_cmd:
            parts.append(backend_cmd)
        if not parts:
            continue
        cmd = ["bash", "-c", "; ".join(parts)] if host is None else [*ssh, host, "; ".join(parts)]
        try:
            subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=15, check=False)
        except subprocess.TimeoutExpired:
            pass


def _run_external(cmd: list[str], base: dict[str, str], cwd: str, verbose: bool) -> int:
    if verbose:
        sys.stderr.write("meshcomm launch: " + " ".join(shlex.quote(c) for c in cmd) + "\n")
    with _Interrupt() as intr:
        proc = subprocess.Popen(cmd, env={**os.environ, **base}, cwd=cwd, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        while proc.poll() is None and intr.signum is None:
            time.sleep(0.05)
        if intr.signum is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(GRACE * 2)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if intr.signum is not None:
        return 128 + intr.signum
    rc = proc.returncode
    if rc != 0:
        sys.stderr.write(f"meshcomm launch: {cmd[0]} {_describe(rc)}\n")
    return _exit_code(rc)
