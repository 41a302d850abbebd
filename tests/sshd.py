"""A throwaway OpenSSH server on a loopback address, for tests that start ranks over ssh.

``LoopbackSshd(addr)`` generates a host key and a client key in a temporary directory,
runs ``sshd -D`` with its own config (own port, own authorized_keys, own pid file) on
``addr`` and gives the ``ssh`` command that reaches it (``ssh_command``). ``stop()`` kills
the server; connections still open end with their sessions.

The system's sshd is never touched. sshd is installed by ``scripts/ci-system-deps.sh``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["LoopbackSshd", "find_sshd", "SshdUnavailable"]


class SshdUnavailable(RuntimeError):
    """sshd cannot run here (reason in the message)."""


def find_sshd() -> str | None:
    for cand in (shutil.which("sshd"), "/usr/sbin/sshd", "/sbin/sshd"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _free_port(addr: str) -> int:
    from jobs import free_ports

    return free_ports(1, addr)[0]


class LoopbackSshd:
    def __init__(self, addr: str = "127.0.0.2") -> None:
        sshd = find_sshd()
        if sshd is None:
            raise SshdUnavailable("sshd is not installed (scripts/ci-system-deps.sh installs openssh-server)")
        if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
            raise SshdUnavailable("ssh / ssh-keygen are not installed (openssh-client)")
        self.addr = addr
        self.dir = Path(tempfile.mkdtemp(prefix="mc-sshd-"))
        self.port = _free_port(addr)
        self.key = self.dir / "client_key"
        host_key = self.dir / "host_key"
        for k in (host_key, self.key):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)],
                check=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        auth = self.dir / "authorized_keys"
        auth.write_text(Path(str(self.key) + ".pub").read_text())
        auth.chmod(0o600)
        self.log = self.dir / "sshd.log"
        config = self.dir / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress {addr}",
                    f"Port {self.port}",
                    f"HostKey {host_key}",
                    f"AuthorizedKeysFile {auth}",
                    f"PidFile {self.dir / 'sshd.pid'}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "StrictModes no",
                    "UsePAM no",
                    "X11Forwarding no",
                    "PrintMotd no",
                    "LogLevel ERROR",
                    "MaxStartups 100",
                    "MaxSessions 100",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation directory
        self.proc = subprocess.Popen(
            [sshd, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "wb"),
        )
        self._wait_up()

    @property
    def ssh_command(self) -> str:
        """The ``--ssh`` value for ``meshcomm launch``."""
        return shlex.join(
            [
                "ssh",
                "-p",
                str(self.port),
                "-i",
                str(self.key),
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "BatchMode=yes",
                "-o",
                "LogLevel=ERROR",
                "-o",
                "IdentitiesOnly=yes",
                "-F",
                "/dev/null",
            ]
        )

    def run(self, command: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*shlex.split(self.ssh_command), self.addr, command],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def _wait_up(self) -> None:
        deadline = time.monotonic() + 20
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise SshdUnavailable(f"sshd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                p = self.run("echo up", timeout=10)
                if p.returncode == 0 and p.stdout.strip() == "up":
                    return
                last = p.stderr
            except subprocess.TimeoutExpired:
                last = "ssh timed out"
            time.sleep(0.2)
        log = self.log.read_text()[-2000:]
        self.stop()
        raise SshdUnavailable(f"cannot ssh to the test sshd on {self.addr}:{self.port}: {last}\n{log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
