"""The ssh starter: one ssh session per remote host, whatever its number of ranks.

sshd accepts only a few unauthenticated connections at once (``MaxStartups``, 10 by
default, beyond which it drops them at random), so a session per rank fails on a host
with many ranks. Here one ``ssh HOST bash -s`` per host runs a start script, read from
ssh's stdin (so the job secret and the user's variables never appear on a command line):
it makes the job's private directory (refusing one another user made:
:func:`meshcomm.launch.procs.private_dir_script`), writes the job's files, exports the
variables every rank shares and execs the host agent (:mod:`.agent`) with Python. The
agent starts the host's ranks, forwards their output lines tagged with the rank (the
launcher prefixes them ``[rank R]`` as for local ranks), reports their pids, exit
statuses and failure records, and takes ``signal`` / ``finish`` commands on the same
stdin. Stopping or killing ranks therefore needs no further ssh connection, and when the
connection ends without ``finish`` (the launcher was killed) the agent stops every rank.

Ranks of this machine (``host=None``) are started by the local starter.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...protocol.errors import ConfigError
from ...runtime.launchsafety import check_env_name, mask, ssh_argv
from ...runtime.lifetime import die_with_parent
from ..procs import private_dir_script, pump_lines
from . import HostStart, Output, RankStart, Session, start_all
from .local import LocalSession

__all__ = ["SshStarter", "SshSession", "start_script", "create", "AGENT_FILE", "LIFETIME_FILE"]

#: the agent's file name in the job's directory on each remote host
AGENT_FILE = ".meshcomm-agent.py"
#: the module the agent imports (:mod:`meshcomm.runtime.lifetime`), shipped next to it
LIFETIME_FILE = "lifetime.py"
#: seconds the agent gives ranks between SIGTERM and SIGKILL when its connection ends
STOP_GRACE = 3.0


def start_script(hs: HostStart) -> str:
    """The bash script ssh runs on ``hs.host``: private job directory, job files (and the
    agent's), shared variables, then ``exec python agent``.

    Every variable name is checked to be a shell identifier (it is pasted unquoted after
    ``export``); every value, path and argument is quoted.
    """
    for k in hs.env:
        check_env_name(k, "remote rank environment")
    lines = ["set -e", *private_dir_script(hs.job_dir)]
    files = {**hs.files, **agent_files()}
    for name, content in files.items():
        marker = "MESHCOMM_EOF_" + os.urandom(6).hex()
        final = shlex.quote(hs.job_dir + "/" + name)
        tmp = shlex.quote(hs.job_dir + "/." + name) + ".$$"
        # written aside and renamed: nothing ever reads a half-written file
        lines.append(f"cat > {tmp} <<'{marker}'\n{content}\n{marker}\nmv -f {tmp} {final}")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in hs.env.items()]
    tried = [hs.python, "python3", "python"]
    agent = shlex.quote(hs.job_dir + "/" + AGENT_FILE)
    # one line, the last: bash reads its script from stdin line by line, and what follows
    # it there (the plan, then commands) is the agent's
    lines.append(
        f"for mc_py in {' '.join(shlex.quote(p) for p in tried)}; do "
        f'if command -v "$mc_py" >/dev/null 2>&1; then exec "$mc_py" {agent}; fi; done; '
        f'echo "meshcomm launch: error: no Python on $(hostname) to run the host agent (tried '
        f'{" ".join(tried)})" >&2; exit 127'
    )
    return "\n".join(lines)


def _spec(r: RankStart) -> dict[str, Any]:
    """How the host agent is told to start rank ``r`` (one JSON object)."""
    return {"rank": r.rank, "argv": r.argv, "env": r.env}


class SshSession:
    """The ranks of one remote host, behind one ssh session and its agent."""

    def __init__(self, hs: HostStart, output: Output, ssh: list[str]) -> None:
        assert hs.host is not None
        self.host = hs.host
        self.ranks = [r.rank for r in hs.ranks]
        self._starts = {r.rank: r for r in hs.ranks}
        self._status: dict[int, int | None] = dict.fromkeys(self.ranks)
        self.pids: dict[int, int] = {}
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._output = output
        self._finished = False
        script = start_script(hs)
        plan = {
            "cwd": hs.cwd,
            "job_dir": hs.job_dir,
            "cleanup": hs.cleanup,
            "grace": STOP_GRACE,
            "ranks": [_spec(r) for r in hs.ranks],
        }
        self.command = ssh_argv(ssh, hs.host, "bash -s")
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        if hs.verbose:  # secrets (the job's, and credential-like --env values) shown as <hidden>
            every = {**hs.env, **{k: v for r in hs.ranks for k, v in r.env.items()}}
            shown = " ".join(shlex.quote(c) for c in [*self.command[:-1], "bash -s"])
            text = f"meshcomm launch: ranks {', '.join(map(str, self.ranks))} on {hs.host}: {shown} <<script\n"
            text += without_agent(script) + "\n"
            for r in hs.ranks:
                own = " ".join(f"{k}={shlex.quote(v)}" for k, v in r.env.items())
                text += f"meshcomm launch: rank {r.rank} on {hs.host}: {own} {' '.join(map(shlex.quote, r.argv))}\n"
            sys.stderr.write(mask(text, every))
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        self._stdin = self.proc.stdin
        self._send(script + "\n" + json.dumps(plan))
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()
        self._err = pump_lines(self.proc.stderr, lambda line: output.host_line(self.host, "err", line))

    def _send(self, text: str) -> None:
        with self._lock:
            try:
                self._stdin.write(text.encode() + b"\n")
                self._stdin.flush()
            except (OSError, ValueError):
                pass  # ssh is gone: its exit status tells why

    def _read(self, stream: Any) -> None:
        for line in iter(stream.readline, b""):
            kind, _, rest = line.partition(b" ")
            try:
                if kind in (b"O", b"E"):
                    rank, _, data = rest.partition(b" ")
                    if not data.endswith(b"\n"):
                        data += b"\n"
                    self._output.rank_line(int(rank), "out" if kind == b"O" else "err", data)
                elif kind == b"S":
                    rank, pid = rest.split()
                    self.pids[int(rank)] = int(pid)
                elif kind == b"X":
                    rank, status = rest.split()
                    self._status[int(rank)] = int(status)
                elif kind == b"R":
                    rec = json.loads(rest)
                    if isinstance(rec, dict):
                        self._records.append(rec)
                elif kind.strip() == b"F":
                    self._finished = True
                else:
                    self._output.host_line(self.host, "out", line)
            except ValueError:
                self._output.host_line(self.host, "out", line)
        stream.close()

    def poll(self) -> dict[int, int | None]:
        if self.proc.poll() is not None and not self._reader.is_alive():
            # ssh ended (could not connect, the script refused the job directory, the agent
            # died): ranks it never reported as exited failed with its status
            rc = self.proc.returncode
            for rank, st in self._status.items():
                if st is None:
                    self._status[rank] = rc if rc not in (0, None) else 255
        return dict(self._status)

    def signal(self, sig: int) -> None:
        self._send(f"signal {int(sig)} group")

    def signal_rank(self, sig: int) -> None:
        self._send(f"signal {int(sig)} rank")

    def restart(self, rank: int) -> None:
        """Have the host's agent start a replacement for ``rank`` (:meth:`RankStart.replacement`)."""
        r = self._starts[rank].replacement()
        self._status[rank] = None
        self._send("restart " + json.dumps(_spec(r)))

    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    def finish(self) -> None:
        self._send("finish")
        with self._lock:
            try:
                self._stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the agent sees the end of its stdin and stops what is left
            self.proc.wait()
        self._reader.join(5)
        self._err.join(5)


def agent_files() -> dict[str, str]:
    """The agent's source and the module it imports, by file name in the job's directory."""
    here = Path(__file__).parent
    return {
        LIFETIME_FILE: (here.parent.parent / "runtime" / "lifetime.py").read_text(),
        AGENT_FILE: (here / "agent.py").read_text(),
    }


def without_agent(script: str) -> str:
    """``script`` without the sources of :func:`agent_files` (not worth printing with ``--verbose``)."""
    for source in agent_files().values():
        script = script.replace(source, "")
    return script


class SshStarter:
    """``--launcher ssh``: this machine's ranks locally, every other host's through one ssh session."""

    name = "ssh"

    def __init__(self, ssh: str) -> None:
        self.ssh = shlex.split(ssh)
        if not self.ssh:
            raise ConfigError("--ssh is empty; give the command that reaches remote hosts, e.g. 'ssh -p 2222'")

    def start(self, hosts: Sequence[HostStart], output: Output) -> list[Session]:
        return start_all(hosts, lambda h: self._open(h, output))

    def _open(self, h: HostStart, output: Output) -> Session:
        if h.host is None:
            return LocalSession(h, output)
        try:
            return SshSession(h, output, self.ssh)
        except OSError as exc:
            raise OSError(f"cannot run {self.ssh[0]} for {h.host}: {exc}") from None


def create(options: Any) -> SshStarter:
    return SshStarter(options.ssh)
