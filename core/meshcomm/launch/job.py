"""``Job``: the plan of one launch (ranks, places, secret, files, ports), given to backends."""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from ..protocol.errors import ConfigError
from ..runtime.launchspec import RankPlace
from ..runtime.ports import outgoing_ports_from, unclaimed_port

__all__ = ["Job"]


class Job:
    """Implements :class:`meshcomm.runtime.launchspec.JobSpec` for one run of ``meshcomm launch``."""

    def __init__(
        self,
        places: list[RankPlace],
        *,
        verbose: bool = False,
        port_base: int | None = None,
        shm_dir: bool = False,
        keep_going: bool = False,
    ) -> None:
        self.nranks = len(places)
        self.keep_going = keep_going
        self.places = places
        self.job_id = uuid.uuid4().hex[:12]
        self.secret = secrets.token_hex(16)
        self.verbose = verbose
        self.dir = Path(tempfile.gettempdir()) / f"meshcomm-{self.job_id}"
        _sweep_stale(self.dir.parent)
        self._dir_stat = _make_private_dir(self.dir)
        (self.dir / _OWNER).write_text(str(os.getpid()))
        #: with ``shm_dir``: a private directory in shared memory for the transport's own files
        #: (MPI's segments), when this machine has one; removed with the job directory
        self.shm_dir: Path | None = None
        self._shm_stat: tuple[int, int, int] | None = None
        if shm_dir and os.path.isdir(SHM) and os.access(SHM, os.W_OK):
            _sweep_stale(Path(SHM))
            shm = Path(SHM) / f"meshcomm-{self.job_id}"
            try:  # optional: without it the MPI library keeps its files where it always does
                self._shm_stat = _make_private_dir(shm)
                (shm / _OWNER).write_text(str(os.getpid()))
                self.shm_dir = shm
            except (ConfigError, OSError):
                self.shm_dir = None
        self._reaper = _start_reaper(self.job_id, [self.dir, *([self.shm_dir] if self.shm_dir else [])])
        self.files: dict[str, str] = {}
        self._fds: dict[int, list[int]] = {}
        self._keep: list[socket.socket] = []
        self._port_base = port_base or _remote_port_base(self.nranks)
        self._remote_ports: dict[tuple[str | None, int], int] = {}

    @property
    def hosts(self) -> list[str | None]:
        """Distinct hosts in rank order (None = this machine)."""
        seen: list[str | None] = []
        for p in self.places:
            if p.host not in seen:
                seen.append(p.host)
        return seen

    def add_file(self, name: str, content: str) -> str:
        """Write ``name`` here (and, through the start script, on every remote host)."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"file name {name!r} must be a plain name")
        self.files[name] = content
        path = self.dir / name
        path.write_text(content)
        return str(path)

    def free_port(self, place: RankPlace) -> int:
        """A free port on ``place``'s host: probed here for local ranks, chosen for remote ones."""
        if place.host is None:
            return unclaimed_port(place.ip)
        key = (place.host, place.local_index)
        if key not in self._remote_ports:
            self._remote_ports[key] = self._port_base + len(self._remote_ports)
        return self._remote_ports[key]

    def listen_socket(self, place: RankPlace) -> tuple[int, int | None]:
        """For a local rank: a listening socket it will inherit (port, fd); else (port, None)."""
        if place.host is not None:
            return self.free_port(place), None
        s = socket.socket(_family(place.ip), socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((place.ip, 0))
        s.listen(max(512, self.nranks))
        s.set_inheritable(True)
        self._keep.append(s)
        self._fds.setdefault(place.rank, []).append(s.fileno())
        return int(s.getsockname()[1]), s.fileno()

    def fds_for(self, rank: int) -> list[int]:
        """File descriptors rank ``rank`` must inherit."""
        return self._fds.get(rank, [])

    def release_fds(self) -> None:
        """Close the launcher's copies of inherited sockets (once the ranks have started)."""
        for s in self._keep:
            s.close()
        self._keep.clear()

    def cleanup(self) -> None:
        """Close inherited sockets and remove the job's directory, if it is still the one
        this job made (same inode, ours, not a symlink: never one someone put in its place)."""
        self.release_fds()
        for path, made in ((self.dir, self._dir_stat), (self.shm_dir, self._shm_stat)):
            if path is None:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino, st.st_uid) == made and stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path, ignore_errors=True)
        if self._reaper is not None:  # nothing left for it: it ends at once
            try:
                if self._reaper.stdin is not None:
                    self._reaper.stdin.close()
                self._reaper.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._reaper = None


def _make_private_dir(path: Path) -> tuple[int, int, int]:
    """Create ``path`` 0700 (never reuse an existing one); its (device, inode, owner)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        try:
            uid: object = os.lstat(path).st_uid
        except OSError:
            uid = "?"
        raise ConfigError(
            f"job directory {path} exists already (owned by uid {uid}): another user may have made it "
            "to read or plant the job's files; refusing to use it. Remove it, or set TMPDIR to a private directory"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot create the job directory {path}: {exc.strerror}; set TMPDIR to a writable directory"
        ) from None
    os.chmod(path, 0o700)  # whatever the umask
    st = os.lstat(path)
    return st.st_dev, st.st_ino, st.st_uid


#: the launcher's pid, in its job directory: a directory whose launcher is gone (it was
#: SIGKILLed and its reaper could not clean up either) is removed by the next launch
_OWNER = ".launcher-pid"
#: where shared memory lives on Linux
SHM = "/dev/shm"


def _start_reaper(job_id: str, paths: list[Path]) -> subprocess.Popen[bytes] | None:
    """The process that removes ``paths`` if this launcher is killed (:mod:`.reaper`)."""
    try:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("reaper.py")), job_id, *map(str, paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        return None  # the next launch sweeps what a killed one leaves


def _sweep_stale(tmp: Path) -> None:
    """Remove job directories (``meshcomm-*``) of this user whose launcher no longer runs."""
    for d in tmp.glob("meshcomm-*"):
        try:
            pid = int((d / _OWNER).read_text())
            if d.stat().st_uid != os.getuid():
                continue
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def _remote_port_base(nranks: int) -> int:
    """A random first port for ranks on remote hosts, below the range of ports for outgoing
    connections: in it a rank's connections to its peers could take a port another rank of
    its host is yet to listen on."""
    return random.randrange(10000, max(10100, outgoing_ports_from() - nranks - 100), 100)
