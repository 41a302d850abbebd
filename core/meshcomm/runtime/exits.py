"""How a rank ends when its program fails: print, leave a failure record, tell the peers.

A rank whose program fails (an uncaught exception, or a non-zero exit code) must not leave
its peers waiting: :func:`end_rank` writes a *failure record* for the launcher (when the
launcher asked for one, ``MESHCOMM_JOB_DIR``) and then calls ``backend.abort(code, reason)``
on every started world, so each peer raises ``PeerLostError`` naming this rank (and MPI
ends the job with ``code``). :func:`install` hooks this into ``sys.excepthook``;
``meshcomm.api.world.init`` installs it for multi-process backends and the launcher's rank
runner (``python -m meshcomm.launch.rank``) calls :func:`end_rank` itself.

The record lets ``meshcomm launch`` blame the rank that failed for its own reason rather
than a rank that raised ``PeerLostError`` *because of* it: a record is written as
``<MESHCOMM_JOB_DIR>/failures/rank-<R>.json``::

    {"rank": 1, "time": 1796000000.1, "code": 1, "type": "KeyError", "message": "'x'",
     "reason": "KeyError: 'x'", "peer": null, "consequence": false, "pid": 4242, "host": "node1"}

``consequence`` is true for a ``PeerLostError`` or ``CommTimeoutError`` (``peer`` is the rank
it names, when the transport knows): the launcher skips those when it looks for the rank
to blame.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .launchvars import rank_from_env

__all__ = [
    "JOB_DIR_ENV",
    "STACKS_FILE",
    "install",
    "install_stack_dump",
    "end_rank",
    "failure_record",
    "read_records",
    "rank_from_env",
]

#: set by ``meshcomm launch``: the job's directory, where ranks leave their failure records
JOB_DIR_ENV = "MESHCOMM_JOB_DIR"

#: ``<MESHCOMM_JOB_DIR>/pids/stacks-<R>.pid``: rank R's process prints its Python stacks on
#: SIGUSR1 (the launcher sends it on a timeout only to processes that wrote this file)
STACKS_FILE = "stacks-{rank}.pid"

_lock = threading.Lock()
_installed = False
_stacks_installed = False
_ended = False
_previous_hook: Callable[[type[BaseException], BaseException, TracebackType | None], Any] | None = None
#: what the failure path needs of the layers above, handed over by them (this module imports
#: none of them: the rank runner starts with the standard library only): the started worlds'
#: (name, backend) pairs, and what must run before their abort (the tracer writes its file)
_worlds: Callable[[], list[tuple[str, Any]]] = list
_before_abort: list[Callable[[], object]] = []


def install(worlds: Callable[[], list[tuple[str, Any]]] | None = None) -> None:
    """Wrap ``sys.excepthook`` (once; calling again only takes ``worlds``).

    The previous hook prints the traceback first, then :func:`end_rank` runs with code 1.
    ``worlds`` returns the (name, backend) of every world this process started: the ones
    :func:`end_rank` aborts (:func:`meshcomm.api.world.started_backends`).
    """
    global _installed, _previous_hook, _worlds
    with _lock:
        if worlds is not None:
            _worlds = worlds
        if _installed:
            return
        _installed = True
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def install_stack_dump(rank: int) -> None:
    """``SIGUSR1`` prints every thread's Python stack to stderr, however this rank was started
    (the rank runner, ``-- python prog.py``, mpirun, srun, torchrun), unless the program
    handles ``SIGUSR1`` itself; under ``meshcomm launch`` the process then says so in the
    job's directory (:data:`STACKS_FILE`), so that a timed-out job's launcher asks it for its
    stacks. Once per process; the first call's rank is recorded."""
    global _stacks_installed
    with _lock:
        if _stacks_installed:
            return
        _stacks_installed = True
    try:
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return  # the program's own handler stays
    except ValueError:
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (ValueError, OSError, RuntimeError, AttributeError):
        return  # no usable stderr (e.g. closed): no stacks, nothing else changes
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir:
        return
    folder = os.path.join(job_dir, "pids")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        tmp = os.path.join(folder, f".stacks.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, os.path.join(folder, STACKS_FILE.format(rank=rank)))
    except OSError:
        pass  # the launcher will not ask this rank for stacks; nothing else changes


def _excepthook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    previous = _previous_hook or sys.__excepthook__
    try:
        previous(etype, value, tb)
    finally:
        if not issubclass(etype, SystemExit):
            end_rank(1, describe(value), value)


def describe(exc: BaseException) -> str:
    """``"KeyError: 'x'"``: the exception's type and message, on one line."""
    text = str(exc).strip().replace("\n", " ")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def end_rank(code: int, reason: str, exc: BaseException | None = None) -> None:
    """This rank ends because its program failed: flush output, write the failure record
    (when the launcher asked for one), then ``backend.abort(code, reason)`` on every started
    world that has it. Only the first call does anything.

    ``backend.abort`` may end the process (MPI_Abort), so the record and the output go first.
    """
    global _ended
    with _lock:
        if _ended:
            return
        _ended = True
    _flush()
    try:
        write_record(code, reason, exc)
    except OSError as err:  # a full or vanished job directory must not hide the real failure
        sys.stderr.write(f"meshcomm: could not write the failure record of this rank: {err}\n")
    _flush()
    _run_before_abort()
    _abort_worlds(code, reason)


def has_ended() -> bool:
    """True once :func:`end_rank` ran in this process."""
    return _ended


def worlds_without_abort() -> list[str]:
    """Backends of started worlds that have no ``abort`` method (their peers learn of this
    rank's end only when its connections close)."""
    return [name for name, backend in _started_backends() if not callable(getattr(backend, "abort", None))]


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def before_abort(hook: Callable[[], object]) -> None:
    """Run ``hook()`` when this rank's program fails, after its record and before the worlds
    abort (which may end the process): the tracer writes its file. Adding it again does nothing."""
    with _lock:
        if hook not in _before_abort:
            _before_abort.append(hook)


def _started_backends() -> list[tuple[str, Any]]:
    """(name, backend) of every world this process started, as :func:`install` was told;
    none when no world started (the rank runner alone)."""
    return _worlds()


def _run_before_abort() -> None:
    for hook in list(_before_abort):
        try:
            hook()
        except Exception as err:  # noqa: BLE001 - the rank is ending anyway; say why the hook failed
            sys.stderr.write(
                f"meshcomm: before the abort, {getattr(hook, '__qualname__', hook)} failed: {describe(err)}\n"
            )
            _flush()


def _abort_worlds(code: int, reason: str) -> None:
    for name, backend in _started_backends():
        abort = getattr(backend, "abort", None)
        if not callable(abort):
            continue
        try:
            abort(code, reason)
        except Exception as err:  # noqa: BLE001 - the rank is ending anyway; say why abort failed
            sys.stderr.write(f"meshcomm: {name} backend's abort({code}) failed: {describe(err)}\n")
            _flush()


def _rank() -> int | None:
    for _, backend in _started_backends():
        try:
            return int(backend.rank())
        except Exception:  # noqa: BLE001 - a broken backend: fall back to the environment
            break
    return rank_from_env()


def failure_record(code: int, reason: str, exc: BaseException | None = None) -> dict[str, Any]:
    """The record :func:`end_rank` writes (see the module docstring)."""
    from ..protocol.errors import CommTimeoutError, PeerLostError

    # a lost peer or a timeout is a consequence of another rank, whether or not the
    # transport could tell which one
    consequence = isinstance(exc, (PeerLostError, CommTimeoutError))
    peer = getattr(exc, "peer", None) if consequence else None
    return {
        "rank": _rank(),
        "time": time.time(),
        "code": int(code),
        "type": type(exc).__name__ if exc is not None else "SystemExit",
        "message": str(exc) if exc is not None else f"exit code {code}",
        "reason": reason,
        "peer": peer if isinstance(peer, int) else None,
        "consequence": consequence,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }


def write_record(code: int, reason: str, exc: BaseException | None = None) -> str | None:
    """Write this rank's failure record under ``$MESHCOMM_JOB_DIR/failures`` (written aside
    and renamed, so the launcher never reads half a record); returns its path, or None when
    no launcher asked for records."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir:
        return None
    record = failure_record(code, reason, exc)
    folder = os.path.join(job_dir, "failures")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    name = f"rank-{record['rank']}" if record["rank"] is not None else f"rank-unknown-{os.getpid()}"
    path = os.path.join(folder, name + ".json")
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return path


def read_records(job_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every failure record of a job, oldest first (unreadable files are skipped)."""
    folder = os.path.join(os.fspath(job_dir), "failures")
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith(".")]
    except OSError:
        return []
    records = []
    for n in names:
        try:
            with open(os.path.join(folder, n)) as f:
                records.append(json.load(f))
        except (OSError, ValueError):
            continue
    records.sort(key=lambda r: (r.get("time", 0.0), r.get("rank") or 0))
    return records
