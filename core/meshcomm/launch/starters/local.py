"""The local starter: ranks of this machine, each a child process in its own session.

Each rank is started directly (``subprocess.Popen``) with its environment, the file
descriptors it inherits (the sockets backend's listening sockets) and a parent-death
signal, so no rank outlives a killed launcher. ``--launcher local`` uses it for every
rank and refuses other hosts; the ssh starter uses it for the ranks of this machine.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from ...protocol.errors import ConfigError
from ...runtime.launchsafety import mask
from ...runtime.lifetime import die_with_parent
from ..procs import pump_lines
from . import HostStart, Output, RankStart, Session, start_all

__all__ = ["LocalStarter", "LocalSession", "create"]


class LocalSession:
    """The ranks of one :class:`HostStart` on this machine."""

    def __init__(self, hs: HostStart, output: Output) -> None:
        self.ranks = [r.rank for r in hs.ranks]
        self.cleanup = hs.cleanup
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.threads: list[threading.Thread] = []
        self._hs, self._output = hs, output
        for r in hs.ranks:
            self._start(r, hs, output)

    def restart(self, rank: int) -> None:
        """Start a replacement for ``rank`` (its process ended): :meth:`RankStart.replacement`."""
        r = next(r for r in self._hs.ranks if r.rank == rank)
        self._start(r.replacement(), self._hs, self._output)

    def _start(self, r: RankStart, hs: HostStart, output: Output) -> None:
        env = {**hs.env, **r.env}
        try:
            proc = subprocess.Popen(
                r.argv,
                env={**os.environ, **env},
                cwd=hs.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=tuple(r.pass_fds),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            self.signal(signal.SIGKILL)
            self.finish()
            raise OSError(f"cannot start rank {r.rank}: {exc}") from None
        self.procs[r.rank] = proc
        if hs.verbose:  # secrets (the job's, and credential-like --env values) shown as <hidden>
            shown = " ".join(shlex.quote(c) for c in r.argv)
            sys.stderr.write(mask(f"meshcomm launch: rank {r.rank}: {shown}\n", env))
        assert proc.stdout is not None and proc.stderr is not None
        rank = r.rank
        self.threads += [
            pump_lines(proc.stdout, lambda line: output.rank_line(rank, "out", line)),
            pump_lines(proc.stderr, lambda line: output.rank_line(rank, "err", line)),
        ]

    def poll(self) -> dict[int, int | None]:
        return {rank: p.poll() for rank, p in self.procs.items()}

    def signal(self, sig: int) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def signal_rank(self, sig: int) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def records(self) -> list[dict]:
        return []  # this machine's records are read by the launcher itself

    def finish(self) -> None:
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for t in self.threads:
            t.join(2.0)
        if self.cleanup:
            try:
                subprocess.run(
                    ["bash", "-c", self.cleanup],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=15,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired):
                pass


class LocalStarter:
    """``--launcher local``: every rank on this machine."""

    name = "local"

    def start(self, hosts: Sequence[HostStart], output: Output) -> list[Session]:
        remote = [h.host for h in hosts if h.host is not None]
        if remote:
            raise ConfigError(
                f"--launcher local starts ranks on this machine only, but the job has ranks on "
                f"{', '.join(remote)}; use --launcher ssh (or auto)"
            )
        return start_all(hosts, lambda h: LocalSession(h, output))


def create(options: object) -> LocalStarter:
    return LocalStarter()
