"""Starting, watching and stopping the processes of a job, with rank-prefixed output."""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

from .safety import check_env_name, mask, ssh_argv

__all__ = ["OutputMux", "RankProcess", "FifoOutput", "remote_script", "remote_kill_command", "die_with_parent",
           "private_dir_script", "DIR_REFUSED"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """``preexec_fn`` of every process the launcher starts: the kernel sends it ``sig`` when
    the launcher dies (even by SIGKILL), so no rank or mpiexec outlives a killed launcher."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class OutputMux:
    """Writes whole lines from many processes to our stdout/stderr, never mixing them."""

    def __init__(self, prefix: bool) -> None:
        self.prefix = prefix
        self.lock = threading.Lock()

    def pump(self, stream: IO[bytes], out: IO[bytes], tag: str, first_line_hook=None,
             strip_nul: bool = False) -> threading.Thread:
        """Copy ``stream`` to ``out`` line by line, each prefixed ``tag`` (when prefixing);
        ``strip_nul`` drops NUL bytes (Open MPI's mpiexec ends its help texts with one)."""
        def run() -> None:
            first = True
            for line in iter(stream.readline, b""):
                if strip_nul:
                    line = line.replace(b"\x00", b"")
                    if not line:
                        continue
                if first and first_line_hook is not None:
                    first = False
                    if first_line_hook(line):
                        continue
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self.lock:
                    out.write((tag.encode() if self.prefix else b"") + line)
                    out.flush()
            stream.close()

        t = threading.Thread(target=run, name=f"pump {tag.strip()}", daemon=True)
        t.start()
        return t


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
        f"mc_owner() {{ echo \"{owner}\"; }}",
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
        'echo "meshcomm launch: error: job directory $mc_dir on $(hostname) exists already and is not this job\'s '
        '($([ -L "$mc_dir" ] && echo "a symlink, ")$(mc_owner "$mc_dir"), where this job makes it 0700 and owned '
        'by uid $(id -u)): another user may have made it first to read or plant the job\'s files; refusing to use '
        'it. Remove it (rm -rf $mc_dir) unless someone else needs it, and start the job again" >&2; '
        f'exit {DIR_REFUSED}; fi',
    ]


def remote_script(argv: Sequence[str], env: dict[str, str], cwd: str, files: dict[str, str], filedir: str) -> str:
    """The bash script a remote host runs: make the job's private directory (refusing one
    another user made), write the job's files, cd, export, report pid, exec.

    Every variable name is checked to be a shell identifier (it is pasted unquoted after
    ``export``); every value, path and argument is quoted.
    """
    for k in env:
        check_env_name(k, "remote rank environment")
    lines = ["set -e", *private_dir_script(filedir)]
    for name, content in files.items():
        marker = "MESHCOMM_EOF_" + os.urandom(6).hex()
        final = shlex.quote(filedir + "/" + name)
        tmp = shlex.quote(filedir + "/." + name) + ".$$"
        # write aside and rename: ranks sharing the host never read a half-written file
        lines.append(f"cat > {tmp} <<'{marker}'\n{content}\n{marker}\nmv -f {tmp} {final}")
    lines.append(f"cd {shlex.quote(cwd)}")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    # pid and process group (field 5 of /proc/PID/stat), so the launcher can stop the group
    lines.append('pg=$(cut -d" " -f5 /proc/$$/stat 2>/dev/null || echo 0); echo "MESHCOMM_PID $$ $pg"')
    lines.append("exec " + " ".join(shlex.quote(a) for a in argv))
    return "\n".join(lines)


def remote_kill_command(sig_name: str, pid: int) -> str:
    """POSIX shell command: send SIG to the process group of ``pid`` (the rank and anything it
    started, like a local rank's killpg), or to ``pid`` alone when its group cannot be read."""
    return (f's=$(cat /proc/{pid}/stat 2>/dev/null) && s=${{s##*") "}} && set -- $s && [ "$3" -gt 1 ] '
            f"&& kill -{sig_name} -$3 2>/dev/null || kill -{sig_name} {pid}")


class RankProcess:
    """One rank: a local child in its own session, or a remote one started over ssh."""

    def __init__(self, rank: int, host: str | None, argv: list[str], env: dict[str, str], *,
                 cwd: str, ssh: list[str], mux: OutputMux, pass_fds: Sequence[int] = (),
                 files: dict[str, str] | None = None, filedir: str = "", verbose: bool = False) -> None:
        self.rank = rank
        self.host = host
        self.ssh = ssh
        self.remote_pid: int | None = None
        self.remote_pgid: int | None = None
        tag = f"[rank {rank}] "
        if host is None:
            cmd = argv
            full_env = {**os.environ, **env}
            self.proc = subprocess.Popen(
                cmd, env=full_env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=tuple(pass_fds), start_new_session=True,
                preexec_fn=die_with_parent,
            )
        else:
            # the script (with the job secret) goes through ssh's stdin, never on a command
            # line where any local user could read it with ps; bash reads it line by line,
            # so the program it execs finds stdin at its end
            script = remote_script(argv, env, cwd, files or {}, filedir)
            cmd = ssh_argv(ssh, host, "bash -s")
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=die_with_parent,
            )
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(script.encode() + b"\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass  # ssh failed at once; its exit status and stderr tell why
        if verbose:  # secrets (the job's, and credential-like --env values) shown as <hidden>
            shown = " ".join(shlex.quote(c) for c in (argv if host is None else [*cmd[:-1], "bash -s <<script"]))
            sys.stderr.write(mask(f"meshcomm launch: rank {rank}{' on ' + host if host else ''}: {shown}\n", env))
            if host is not None:
                sys.stderr.write(mask(script, env) + "\n")
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.threads = [
            mux.pump(self.proc.stdout, sys.stdout.buffer, tag, self._pid_line if host else None),
            mux.pump(self.proc.stderr, sys.stderr.buffer, tag),
        ]

    def _pid_line(self, line: bytes) -> bool:
        if line.startswith(b"MESHCOMM_PID "):
            parts = line.split()
            try:
                self.remote_pid = int(parts[1])
                pgid = int(parts[2]) if len(parts) > 2 else 0
            except (IndexError, ValueError):
                return False
            self.remote_pgid = pgid if pgid > 1 else None
            return True
        return False

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_rank(self, sig: int) -> None:
        """Send ``sig`` to the rank's own process only (not what it started): SIGUSR1 asks
        the rank runner for its threads' stacks."""
        if self.proc.poll() is not None:
            return
        if self.host is None:
            try:
                os.kill(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        elif self.remote_pid is not None:
            name = signal.Signals(sig).name.replace("SIG", "")
            subprocess.Popen(ssh_argv(self.ssh, self.host, f"kill -{name} {self.remote_pid} 2>/dev/null"),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank's whole process group (locally, or over ssh) — also after
        the rank itself exited, so that what it started does not outlive the job."""
        if self.host is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            return
        if self.remote_pid is not None:
            name = signal.Signals(sig).name.replace("SIG", "")
            if self.remote_pgid is not None:
                command = f"kill -{name} -{self.remote_pgid} 2>/dev/null || true"
            elif self.proc.poll() is None:
                command = remote_kill_command(name, self.remote_pid)
            else:
                return
            try:
                subprocess.run(ssh_argv(self.ssh, self.host, command),
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=10, check=False)
            except subprocess.TimeoutExpired:
                pass
        if sig == signal.SIGKILL:
            self.proc.kill()

    def join_output(self, timeout: float = 2.0) -> None:
        for t in self.threads:
            t.join(timeout)


class FifoOutput:
    """Per-rank FIFOs ``<folder>/<rank>.out`` / ``.err`` that ranks started by another
    launcher (mpiexec) write to (see :mod:`meshcomm.launch.rank`): the launcher reads each
    stream itself, so lines arrive whole and prefixed ``[rank R] `` whatever mpiexec does.

    The launcher holds a write end of every FIFO too, so a stream does not end before its
    rank opened it; :meth:`close` drops them once the job is over, and the readers end when
    the ranks' ends are closed as well.
    """

    def __init__(self, folder: str, nranks: int, mux: OutputMux) -> None:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.folder = folder
        self._hold: list[int] = []
        self.threads: list[threading.Thread] = []
        for rank in range(nranks):
            for name, out in ((f"{rank}.out", sys.stdout.buffer), (f"{rank}.err", sys.stderr.buffer)):
                path = os.path.join(folder, name)
                os.mkfifo(path, 0o600)
                rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                self._hold.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
                os.set_blocking(rfd, True)
                self.threads.append(mux.pump(os.fdopen(rfd, "rb"), out, f"[rank {rank}] "))

    def close(self, timeout: float = 2.0) -> None:
        """The job is over: let every stream end and wait for its last lines."""
        for fd in self._hold:
            os.close(fd)
        self._hold.clear()
        for t in self.threads:
            t.join(timeout)
