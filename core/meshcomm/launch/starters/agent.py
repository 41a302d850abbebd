"""The host agent: one process per remote host that starts, watches and stops that host's ranks.

The ssh starter (:mod:`meshcomm.launch.starters.ssh`) opens ONE ssh session per host (sshd
drops connections beyond ``MaxStartups``, 10 by default, so a session per rank fails on
big hosts). The session's start script makes the job's private directory, writes the
job's files, exports the variables every rank shares and execs this file with Python.
Everything after that travels over the session's pipes:

stdin (launcher -> agent), one line each:
  first a JSON object ``{"cwd", "job_dir", "cleanup", "grace", "ranks": [{"rank", "argv",
  "env"}]}`` (``env``: the rank's own variables; secrets arrive this way or in the
  exported environment, never on a command line), then commands:
  ``signal N group`` (every rank's process group, also of exited ranks),
  ``signal N rank`` (each running rank's own process), ``restart {rank, argv, env}`` (start
  that replacement of a lost rank: ``meshcomm launch --restart-lost``), ``finish`` (the job is over:
  clean up and exit). The end of stdin without ``finish`` means the launcher or its
  connection is gone: the ranks are stopped (SIGTERM, then SIGKILL after ``grace``
  seconds) and the host is cleaned up.

stdout (agent -> launcher), one line each, written whole:
  ``S RANK PID`` started; ``O RANK <line>`` / ``E RANK <line>`` a line the rank wrote to
  stdout / stderr; ``X RANK STATUS`` exited (negative: killed by that signal);
  ``R <json>`` a failure record a rank left in ``job_dir/failures``; ``F`` done.

Only the standard library: the host may run the agent with an interpreter that has no
meshcomm. The ssh starter ships :mod:`meshcomm.runtime.lifetime` next to it (as
``lifetime.py``): the parent-death signal and the stop sequence come from there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

if __package__:  # imported as meshcomm.launch.starters.agent
    from ...runtime.lifetime import die_with_parent, stop, wait_until
else:  # run as the shipped file: lifetime.py lies next to it (sys.path need not hold it)
    import runpy

    _LIFETIME = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "lifetime.py"))
    die_with_parent, stop, wait_until = _LIFETIME["die_with_parent"], _LIFETIME["stop"], _LIFETIME["wait_until"]

_out_lock = threading.Lock()
_out = sys.stdout.buffer


def send(kind: str, *parts: object, data: bytes = b"") -> None:
    head = " ".join([kind, *map(str, parts)]).encode()
    line = head + (b" " + data if data else b"")
    if not line.endswith(b"\n"):
        line += b"\n"
    with _out_lock:
        try:
            _out.write(line)
            _out.flush()
        except (OSError, ValueError):
            pass  # the launcher is gone: the end of stdin stops the ranks


class Rank:
    def __init__(self, spec: dict, cwd: str) -> None:
        self.rank = int(spec["rank"])
        self.status: int | None = None
        env = {**os.environ, **{str(k): str(v) for k, v in spec["env"].items()}}
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [str(a) for a in spec["argv"]],
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            self.proc = None
            send("E", self.rank, data=f"meshcomm launch: cannot start rank {self.rank}: {exc}".encode())
            self.status = 127
            send("X", self.rank, self.status)
            return
        send("S", self.rank, self.proc.pid)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, "O"), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, "E"), daemon=True),
        ]
        for t in self.pumps:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _pump(self, stream: Any, kind: str) -> None:
        for line in iter(stream.readline, b""):
            send(kind, self.rank, data=line)
        stream.close()

    def _wait(self) -> None:
        assert self.proc is not None
        status = self.proc.wait()
        for t in self.pumps:  # the rank's last lines first, unless a child holds its pipes
            t.join(0.5)
        self.status = status
        send("X", self.rank, status)

    def signal(self, sig: int, group: bool) -> None:
        if self.proc is None:
            return
        try:
            if group:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                os.kill(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Agent:
    def __init__(self, plan: dict) -> None:
        self.job_dir = str(plan["job_dir"])
        self.cleanup_cmd = plan.get("cleanup")
        self.grace = float(plan.get("grace", 3.0))
        self.sent: set[str] = set()
        self.cwd = str(plan["cwd"])
        self.ranks: list[Rank] = []
        for spec in plan["ranks"]:
            self.ranks.append(Rank(spec, self.cwd))

    def restart(self, spec: dict) -> None:
        """Start ``spec`` (a rank's replacement, as the launcher made it) in that rank's place."""
        fresh = Rank(spec, self.cwd)
        self.ranks = [fresh if r.rank == fresh.rank else r for r in self.ranks]

    def send_records(self) -> None:
        folder = os.path.join(self.job_dir, "failures")
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith("."))
        except OSError:
            return
        for name in names:
            if name in self.sent:
                continue
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    data = f.read()
                json.loads(data)
            except (OSError, ValueError):
                continue
            self.sent.add(name)
            send("R", data=data.replace(b"\n", b" ").strip())

    def watch_records(self, stop: threading.Event) -> None:
        """Send records as ranks leave them (a rank writes its record before it exits)."""
        while not stop.wait(0.1):
            self.send_records()

    def signal(self, sig: int, group: bool) -> None:
        for r in self.ranks:
            r.signal(sig, group)

    def stop(self) -> None:
        """The launcher is gone: SIGTERM every rank's group (SIGCONT after it, so that a
        stopped rank gets it now), SIGKILL after the grace period."""
        stop(
            self.signal_groups,
            lambda grace: wait_until(lambda: not self.running(), grace),
            self.grace,
            kill_always=True,
        )

    def signal_groups(self, signals: Sequence[int]) -> None:
        """Send each of ``signals`` in turn to every rank's process group."""
        for sig in signals:
            self.signal(sig, True)

    def running(self) -> bool:
        return any(r.proc is not None and r.proc.poll() is None for r in self.ranks)

    def finish(self) -> None:
        if self.running():
            self.stop()  # the launcher stops ranks before it finishes: only if it could not
        for r in self.ranks:
            for t in getattr(r, "pumps", []):
                t.join(2.0)
        self.send_records()
        d = self.job_dir
        try:  # only our own directory: a real one, owned by us
            st = os.lstat(d)
            if os.path.isdir(d) and not os.path.islink(d) and st.st_uid == os.getuid():
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass
        if self.cleanup_cmd:
            try:
                subprocess.run(
                    ["/bin/sh", "-c", str(self.cleanup_cmd)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=15,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired):
                pass
        send("F")


def main() -> None:
    stdin = sys.stdin.buffer
    first = stdin.readline()
    if not first:
        return
    # no rank outlives this agent (and so the ssh session: sshd ends it with the connection)
    agent = Agent(json.loads(first))
    stop = threading.Event()
    threading.Thread(target=agent.watch_records, args=(stop,), daemon=True).start()
    finished = False
    for raw in iter(stdin.readline, b""):
        words = raw.decode(errors="replace").split()
        if words[:1] == ["signal"] and len(words) == 3 and words[1].lstrip("-").isdigit():
            agent.signal(int(words[1]), words[2] == "group")
        elif words[:1] == ["restart"] and len(words) > 1:
            agent.restart(json.loads(raw.decode().split(None, 1)[1]))
        elif words == ["finish"]:
            finished = True
            break
    stop.set()
    if not finished:
        agent.stop()
    agent.finish()


if __name__ == "__main__":
    main()
