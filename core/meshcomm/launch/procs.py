"""Watching the processes of a job, with rank-prefixed output (their parent-death signal and
how they are stopped: :mod:`.lifetime`)."""

from __future__ import annotations

import os
import shlex
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from ..protocol.errors import ConfigError
from ..runtime.private_files import create_file, open_dir, private_dir

__all__ = ["RankOutput", "FifoOutput", "private_dir_script", "DIR_REFUSED", "pump_lines", "say"]


def say(text: str) -> None:
    """Write one of the launcher's own messages to stderr. A stderr nobody reads any more
    (``meshcomm launch ... 2>&1 | head``) is pointed at /dev/null instead of raising, so the
    launcher still finishes its clean-up and exits with the job's status."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except OSError:
        to_devnull(sys.stderr)


def to_devnull(stream: IO[Any]) -> None:
    """Point ``stream``'s file descriptor at /dev/null (after a write to it failed), so the
    bytes left in its buffer and every later write, including the flush at interpreter exit,
    go nowhere instead of raising or printing "Exception ignored ..."."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):
        pass


class RankOutput:
    """Where every rank's output lines end up (the launcher's side of
    :class:`meshcomm.launch.starters.Output`): our stdout/stderr, prefixed ``[rank R] ``
    unless ``prefix`` is off, whole lines never mixed; with ``log_dir``, also the file
    ``log_dir/rank-R.log`` of each rank (both streams, in arrival order, unprefixed).

    When one of our streams can no longer be written (its reader went away, as in
    ``meshcomm launch ... | head``), later lines for it are dropped and the job goes on:
    the ranks' pipes are still drained, so no rank blocks on a full pipe, the other stream
    and the log files still get every line, and the launcher's exit status is the job's.
    Decision: a reader that stops reading does not stop the job (Open MPI's mpirun aborts
    the job on SIGPIPE, and under torchrun the ranks fail on their own broken pipe)."""

    def __init__(self, prefix: bool, nranks: int = 0, log_dir: str | None = None) -> None:
        self.prefix = prefix
        self.lock = threading.Lock()
        self.logs: dict[int, IO[bytes]] = {}
        #: our streams ("out", "err") that failed: their lines are dropped from then on
        self.lost: set[str] = set()
        if log_dir:
            folder = private_dir(log_dir, "--log-dir")  # not another user's: no links planted in it
            dfd = open_dir(folder)
            try:
                for rank in range(nranks):
                    self.logs[rank] = os.fdopen(create_file(dfd, f"rank-{rank}.log"), "wb")
            except OSError as exc:
                self.close()
                raise ConfigError(f"--log-dir {log_dir!r}: cannot write the rank logs there: {exc.strerror}") from None
            finally:
                os.close(dfd)

    def rank_line(self, rank: int, stream: str, line: bytes) -> None:
        with self.lock:
            self._write(stream, (f"[rank {rank}] ".encode() if self.prefix else b"") + line)
            log = self.logs.get(rank)
            if log is not None:
                log.write(line)
                log.flush()

    def host_line(self, host: str | None, stream: str, line: bytes) -> None:
        with self.lock:
            self._write(stream, (f"[{host}] ".encode() if self.prefix and host else b"") + line)

    def _write(self, stream: str, data: bytes) -> None:
        """Write ``data`` to our stdout (``"out"``) or stderr, unless that stream failed before.

        Called from the threads that drain the ranks' pipes, so it must not raise: an error
        would end the thread, and its rank would block for ever once its pipe is full. A
        stream whose write fails is lost for good: a closed reader (EPIPE) is dropped
        silently, as ``cat`` would end silently; any other error of stdout (a full disk
        behind a redirection) is said once on stderr."""
        if stream in self.lost:
            return
        out = sys.stdout.buffer if stream == "out" else sys.stderr.buffer
        try:
            out.write(data)
            out.flush()
        except OSError as exc:
            self._lose(stream, out, exc)

    def _lose(self, stream: str, out: IO[bytes], exc: OSError) -> None:
        """Give up ``stream`` after ``exc`` (its file descriptor then writes to /dev/null)."""
        self.lost.add(stream)
        to_devnull(out)
        if stream == "out" and not isinstance(exc, BrokenPipeError):
            kept = " (--log-dir still gets it)" if self.logs else ""
            self._write(
                "err",
                f"meshcomm launch: cannot write to stdout ({exc.strerror or exc}); the ranks' "
                f"further output to it is dropped{kept}\n".encode(),
            )

    def close(self) -> None:
        with self.lock:
            for log in self.logs.values():
                log.close()
            self.logs.clear()


#: exit status of a remote start script that refused the job's directory
DIR_REFUSED = 97


def private_dir_script(folder: str) -> list[str]:
    """Shell lines that make ``folder`` this user's private directory, or end the script.

    Ranks sharing a host each run this, so the directory may exist already, made by a
    sibling rank (or, on this machine, by the launcher): it is accepted only if it is a real
    directory (not a symlink), owned by this user, mode exactly 0700. Anything else, such
    as a directory another user made first to read the job's files or to plant its own, is
    refused with a message naming its owner and mode, and exit status ``DIR_REFUSED``. Its
    parent must be ours or root's, and not writable by others unless sticky (``/tmp``), or
    a stranger could swap our directory afterwards.
    """
    parent = os.path.dirname(folder.rstrip("/")) or "/"
    owner = 'owned by uid $(stat -c %u "$1" 2>/dev/null || echo ?), mode $(stat -c %a "$1" 2>/dev/null || echo ?)'
    return [
        "umask 077",
        f"mc_dir={shlex.quote(folder)}; mc_parent={shlex.quote(parent)}",
        f'mc_owner() {{ echo "{owner}"; }}',
        'mkdir -p "$mc_parent" 2>/dev/null || true',
        # the parent: root's or ours, and not group/other-writable unless sticky (find: POSIX tests)
        'if [ -z "$(find "$mc_parent" -maxdepth 0 \\( -user 0 -o -user "$(id -u)" \\) '
        '\\( -perm -1000 -o \\( ! -perm -020 ! -perm -002 \\) \\) 2>/dev/null)" ]; then '
        'echo "meshcomm launch: error: the parent of the job directory, $mc_parent on $(hostname), is '
        '$(mc_owner "$mc_parent"): another user could replace the job directory in it; refusing it. Use a TMPDIR '
        f'that only you (or root) can write to, or a sticky one like /tmp" >&2; exit {DIR_REFUSED}; fi',
        'mkdir -m 700 "$mc_dir" 2>/dev/null || true',
        # the directory: a real one (find does not follow a symlink given to it), ours, 0700
        'if [ -z "$(find "$mc_dir" -maxdepth 0 -type d -user "$(id -u)" -perm 700 2>/dev/null)" ]; then '
        "echo \"meshcomm launch: error: job directory $mc_dir on $(hostname) exists already and is not this job's "
        '($([ -L "$mc_dir" ] && echo "a symlink, ")$(mc_owner "$mc_dir"), where this job makes it 0700 and owned '
        "by uid $(id -u)): another user may have made it first to read or plant the job's files; refusing to use "
        'it. Remove it (rm -rf $mc_dir) unless someone else needs it, and start the job again" >&2; '
        f"exit {DIR_REFUSED}; fi",
    ]


class FifoOutput:
    """Per-rank FIFOs ``<folder>/<rank>.out`` / ``.err`` that ranks started by another
    launcher (mpiexec) write to (see :mod:`meshcomm.launch.rank`): the launcher reads each
    stream itself, so lines arrive whole and prefixed ``[rank R] `` whatever mpiexec does.

    The launcher holds a write end of every FIFO too, so a stream does not end before its
    rank opened it; :meth:`close` drops them once the job is over, and the readers end when
    the ranks' ends are closed as well.
    """

    def __init__(self, folder: str, nranks: int, output: RankOutput) -> None:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.folder = folder
        self._hold: list[int] = []
        self.threads: list[threading.Thread] = []
        for rank in range(nranks):
            for stream in ("out", "err"):
                name = f"{rank}.{stream}"
                path = os.path.join(folder, name)
                os.mkfifo(path, 0o600)
                rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                self._hold.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
                os.set_blocking(rfd, True)
                self.threads.append(pump_lines(os.fdopen(rfd, "rb"), _deliver(output, rank, stream)))

    def close(self, timeout: float = 2.0) -> None:
        """The job is over: let every stream end and wait for its last lines."""
        for fd in self._hold:
            os.close(fd)
        self._hold.clear()
        for t in self.threads:
            t.join(timeout)


def _deliver(output: RankOutput, rank: int, stream: str) -> Callable[[bytes], None]:
    return lambda line: output.rank_line(rank, stream, line)


def pump_lines(stream: IO[bytes], deliver: Callable[[bytes], None], *, strip_nul: bool = False) -> threading.Thread:
    """A thread that calls ``deliver(line)`` for every line of ``stream`` (a last line
    without a newline gets one); ``strip_nul`` drops NUL bytes (Open MPI ends its help
    texts with one)."""

    def run() -> None:
        for line in iter(stream.readline, b""):
            if strip_nul:
                line = line.replace(b"\x00", b"")
                if not line:
                    continue
            if not line.endswith(b"\n"):
                line += b"\n"
            deliver(line)
        stream.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t
