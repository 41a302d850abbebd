"""The rank runner: ``python -m meshcomm.launch.rank PROGRAM.py ARGS`` (or ``-m MOD``, ``-c CODE``,
or ``--exec COMMAND ARGS`` for a program that is not Python).

``meshcomm launch`` starts every Python rank through this module. It runs the program the
way ``python`` would (``sys.argv``, ``__main__``, ``sys.path[0]``) and adds what a rank of
a job needs and a plain interpreter lacks:

* a failed program (uncaught exception, or ``sys.exit`` with a non-zero code) prints as
  usual, then :func:`meshcomm.runtime.exits.end_rank` writes the failure record the launcher uses
  to blame the right rank and calls ``backend.abort(code, reason)`` on every started world
  (so MPI's mpiexec ends the job with this rank's code);
* ``SIGUSR1`` prints every thread's Python stack to stderr (``faulthandler``): the launcher
  sends it when the job times out, so the output shows where each rank was waiting;
* a parent-death signal (``PR_SET_PDEATHSIG`` = SIGKILL): a rank never outlives the process
  that started it (the launcher, mpiexec's daemon, or ssh's session);
* under another launcher (``mpiexec``), ``MLX_RANK``, ``MLX_WORLD_SIZE``, ``MLX_LOCAL_RANK``
  and ``MLX_LOCAL_SIZE`` are set from its variables (Open MPI's ``OMPI_COMM_WORLD_*``,
  PMIx's, MPICH Hydra's ``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``), so
  every rank of ``meshcomm launch`` sees them whatever the backend;
* with ``MESHCOMM_OUTPUT_DIR`` (the MPI route), fds 1 and 2 go to the FIFOs
  ``<dir>/<rank>.out`` and ``<dir>/<rank>.err`` the launcher reads, so lines arrive whole
  and are prefixed by the launcher itself, whatever the MPI launcher does with output.

``--exec COMMAND ARGS`` does all of this but the Python parts (exit records, stacks) and then
execs COMMAND in place of the runner (same pid, same output FIFOs).

Importing this module needs only the standard library: it also runs under a ``--python``
interpreter (by path) whose program may never import meshcomm. Its two modules of meshcomm,
:mod:`meshcomm.runtime.launchvars` (the launchers' rank variables) and :mod:`meshcomm.runtime.lifetime`
(the parent-death signal), are standard-library only too and, run by path, are loaded from
their files.
"""

from __future__ import annotations

import builtins
import faulthandler
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import types
from types import TracebackType
from typing import TYPE_CHECKING, Any


def _by_path(*parts: str) -> dict[str, Any]:
    """The names of a standard-library-only module of meshcomm, run from its file (this file
    was run by path, perhaps by an interpreter without meshcomm)."""
    return runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), *parts))


if __package__ or TYPE_CHECKING:  # python -m meshcomm.launch.rank
    from ..runtime.launchvars import FROM_MPI_LAUNCHER, rank_from_env
    from ..runtime.lifetime import die_with_parent
else:  # python .../launch/rank.py (launch.run.program_argv)
    _VARS = _by_path(os.pardir, "runtime", "launchvars.py")
    FROM_MPI_LAUNCHER, rank_from_env = _VARS["FROM_MPI_LAUNCHER"], _VARS["rank_from_env"]
    die_with_parent = _by_path(os.pardir, "runtime", "lifetime.py")["die_with_parent"]

__all__ = ["main", "OUTPUT_DIR_ENV"]

#: set by the launcher when ranks must send their output through per-rank FIFOs
OUTPUT_DIR_ENV = "MESHCOMM_OUTPUT_DIR"
_USAGE = "usage: python -m meshcomm.launch.rank (PROGRAM | -m MODULE | -c CODE | --exec COMMAND) [ARGS...]"


def set_rank_variables(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Under another launcher (mpiexec) started by meshcomm launch (``MESHCOMM_JOB_ID`` set):
    ``MLX_RANK`` & co. from its variables, where meshcomm's own are not set."""
    if not environ.get("MESHCOMM_JOB_ID") or environ.get("MLX_RANK", "").isdigit():
        return
    for mine, theirs in FROM_MPI_LAUNCHER.items():
        if environ.get(mine, "").isdigit():
            continue
        for var in theirs:
            value = environ.get(var, "")
            if value.isdigit():
                environ[mine] = value
                break


def redirect_output(folder: str, rank: int) -> bool:
    """Point fds 1 and 2 at the launcher's FIFOs of ``rank``; False (nothing changed) when
    the launcher is not reading them."""
    fds = []
    try:
        for name in (f"{rank}.out", f"{rank}.err"):
            # non-blocking open fails at once (ENXIO) if nobody reads, instead of waiting forever
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.set_blocking(fd, True)
            fds.append(fd)
    except OSError:
        for fd in fds:
            os.close(fd)
        return False
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for target, fd in zip((1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    return True


def whole_line_writes() -> None:
    """Make every line the program prints one ``write`` (up to 1 MiB): an MPI launcher that
    forwards output itself (MPICH's Hydra) tags each write with the rank, so an unbuffered
    ``print("a", b)`` (``PYTHONUNBUFFERED``) would arrive as several tagged pieces."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        if old is None:
            continue
        try:
            old.flush()
            raw = io.FileIO(fd, "w", closefd=False)
            new = io.TextIOWrapper(
                io.BufferedWriter(raw, buffer_size=1 << 20),
                encoding=old.encoding,
                errors=old.errors,
                line_buffering=True,
            )
        except (OSError, ValueError, AttributeError):
            continue
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _record_pid(rank: int | None, suffix: str = "pid") -> None:
    """``<job dir>/pids/rank-R.pid`` (the launcher signals and reaps by it); with suffix
    ``done``: the program ended with status 0 (how ``--keep-going`` under mpiexec, which
    reports one status for the job, tells survivors from lost ranks)."""
    job_dir = os.environ.get("MESHCOMM_JOB_DIR")
    if not job_dir or rank is None:
        return
    folder = os.path.join(job_dir, "pids")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        with open(os.path.join(folder, f"rank-{rank}.{suffix}"), "w") as f:
            f.write(f"{os.getpid()}\n")
    except OSError:
        pass


def _strip_runner(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without this module's and runpy's frames (as ``python prog.py`` shows it)."""
    here = os.path.abspath(__file__)
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if os.path.abspath(name) == here or name == runpy.__file__ or name.startswith("<frozen runpy"):
            tb = tb.tb_next
            continue
        break
    return tb


def _exit_status(exc: SystemExit) -> int:
    """The status ``python`` exits with for ``SystemExit(exc.code)`` (printing a message code)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:  # noqa: BLE001 - python prints what it can
        pass
    return 1


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _run(args: list[str]) -> None:
    """Run the program as ``python ARGS`` would; exceptions propagate."""
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit(f"meshcomm.launch.rank: -m needs a module name\n{_USAGE}")
        sys.argv = [args[1], *args[2:]]  # run_module sets argv[0] to the module's file
        if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
            sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        if len(args) < 2:
            raise SystemExit(f"meshcomm.launch.rank: -c needs a program text\n{_USAGE}")
        sys.argv = ["-c", *args[2:]]
        if sys.path:
            sys.path[0] = ""
        main = _fresh_main()
        exec(compile(args[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - python -c
    else:
        path = args[0]
        sys.argv = list(args)
        full = os.path.abspath(path)
        directory = os.path.dirname(os.path.realpath(path))
        if sys.path:
            sys.path[0] = directory
        else:
            sys.path.insert(0, directory)
        if os.path.isdir(path) or not path.endswith(".py"):
            runpy.run_path(path, run_name="__main__")  # a directory or zip with __main__.py
            return
        main = _fresh_main()
        main.__dict__.update(
            __file__=full, __cached__=None, __loader__=importlib.machinery.SourceFileLoader("__main__", full)
        )
        with io.open_code(full) as f:
            code = compile(f.read(), full, "exec")
        exec(code, main.__dict__)  # noqa: S102 - what python does with a script


def _fresh_main() -> types.ModuleType:
    """A new ``__main__`` module in ``sys.modules`` (it stays there, as python's does)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __spec__=None, __package__=None)
    sys.modules["__main__"] = main
    return main


def _end_rank(code: int, reason: str, exc: BaseException | None) -> None:
    """Record and abort through meshcomm.runtime.exits (imported only now: the program may not use
    meshcomm, and then there is no world to abort but the record still blames this rank)."""
    try:
        from meshcomm.runtime import exits
    except ImportError:
        return
    exits.end_rank(code, reason, exc)
    if exits.worlds_without_abort():
        # A backend with no abort cannot tell its peers; close the worlds ourselves and end
        # now, so that no collective shutdown (MPI_Finalize waiting for the peers) can hang.
        world = sys.modules.get("meshcomm.api.world")
        if world is not None:
            world.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def run(args: list[str]) -> int:
    """Run the program; the exit status ``python`` would give (after ending the rank on failure)."""
    try:
        _run(args)
    except SystemExit as exc:
        status = _exit_status(exc)
        if status != 0:
            _end_rank(status, f"exit code {status}", None)
        return status
    except BaseException as exc:  # noqa: BLE001 - exactly what python's top level catches
        tb = _strip_runner(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        status = 130 if isinstance(exc, KeyboardInterrupt) else 1
        _end_rank(status, _describe(exc), exc)
        return status
    return 0


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        sys.stderr.write(_USAGE + "\n")
        raise SystemExit(2)
    die_with_parent(signal.SIGKILL, check="exit")  # an orphaned rank ends before its program starts
    set_rank_variables()
    rank = rank_from_env()
    folder = os.environ.get(OUTPUT_DIR_ENV)
    redirected = bool(folder) and rank is not None and redirect_output(str(folder), rank)
    if (
        not redirected
        and os.environ.get("MESHCOMM_JOB_ID")
        and any(os.environ.get(v) for vs in FROM_MPI_LAUNCHER.values() for v in vs)
    ):
        whole_line_writes()
    _record_pid(rank)
    if args[0] == "--exec":
        if len(args) < 2:
            sys.stderr.write(f"meshcomm.launch.rank: --exec needs a command\n{_USAGE}\n")
            raise SystemExit(2)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            os.execvp(args[1], args[1:])
        except OSError as exc:
            sys.stderr.write(f"meshcomm.launch.rank: cannot run {args[1]}: {exc}\n")
            raise SystemExit(127) from None
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    status = run(args)
    if status == 0:
        _record_pid(rank, "done")
    sys.exit(status)


if __name__ == "__main__":
    main()
