"""The per-user key: what a one-host job without MESHCOMM_JOB_SECRET authenticates with.

Ranks started by hand without a job secret would otherwise authenticate with a key anyone
can compute, so any local user could join the job. Like ssh and Jupyter, meshcomm keeps a
random key in a file only this user can read (``$XDG_CONFIG_HOME/meshcomm/job-key``, else
``~/.config/meshcomm/job-key``, mode 0600 in a 0700 directory), created on first use. Every
rank of a one-host job reads the same file, so the job needs no set-up; other users cannot
read it, so they cannot join. It does not help across hosts (each has its own file).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..protocol.errors import ConfigError
from .private_files import open_dir, private_dir

__all__ = ["KeyUnavailable", "user_key_path", "user_key", "all_loopback"]

#: random bytes in a new key file (written as hex)
KEY_BYTES = 32
_NAME = "job-key"


class KeyUnavailable(Exception):
    """The key file cannot be used here (no home, home not writable): a reason for the
    no-secret warning, not an error, so a simple start keeps working."""


def user_key_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where this user's key file is: ``$XDG_CONFIG_HOME/meshcomm/job-key`` (an absolute
    XDG_CONFIG_HOME, as the XDG spec says), else ``$HOME/.config/meshcomm/job-key``."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CONFIG_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "meshcomm" / _NAME
    home = env.get("HOME", "")
    if not home or not os.path.isabs(home):
        raise KeyUnavailable("HOME is not set (nor XDG_CONFIG_HOME), so there is no place for the key file")
    return Path(home) / ".config" / "meshcomm" / _NAME


def user_key(environ: Mapping[str, str] | None = None) -> tuple[bytes, Path]:
    """This user's key and its path, the file created on first use (race-free: ranks starting
    together all end up reading the one file that was linked into place first).
    KeyUnavailable when the directory cannot be made; ConfigError when the directory or
    the file could be read or replaced by someone else."""
    path = user_key_path(environ)
    try:
        os.makedirs(path.parent, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise KeyUnavailable(f"cannot create {path.parent}: {exc.strerror}") from None
    folder = private_dir(path.parent, "the per-user key directory")
    dfd = open_dir(folder)
    try:
        if not _exists(dfd, path):
            _create(dfd, path)
        return _read(dfd, path), path
    finally:
        os.close(dfd)


def _exists(dfd: int, path: Path) -> bool:
    """Whether ``path`` (in the opened directory) exists, as anything, link included."""
    try:
        os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _create(dfd: int, path: Path) -> None:
    """Write a new key to a randomly named 0600 file and link it to ``path``: a link never
    replaces an existing name, so when two ranks race the first one's key stays for both."""
    tmp = f".{_NAME}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    except OSError as exc:
        raise KeyUnavailable(f"cannot create a file in {path.parent}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(KEY_BYTES).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            pass  # another rank was first: everyone uses its key
    finally:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass


def _read(dfd: int, path: Path) -> bytes:
    """The key in ``path``, refused (ConfigError naming the fix) when it is a link, not this
    user's, or readable or writable by anyone else: such a key proves nothing."""
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        if os.path.islink(path):
            raise ConfigError(
                f"per-user key file {path}: is a symbolic link; remove it (rm {path}) and "
                "meshcomm makes a new key file there"
            ) from None
        raise ConfigError(f"per-user key file {path}: cannot read it: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        _check_owner_and_mode(st, path)
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < 2 * 16:
        raise ConfigError(
            f"per-user key file {path}: holds {len(data)} characters, expected a key of at least 32 "
            f"hex digits; remove it (rm {path}) and meshcomm makes a new one"
        )
    return data


def _check_owner_and_mode(st: os.stat_result, path: Path) -> None:
    """ConfigError unless ``st`` is a regular file of this user that no one else can use."""
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"per-user key file {path}: is not a regular file; remove it (rm {path}) and meshcomm "
            "makes a new key file there"
        )
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"per-user key file {path}: belongs to uid {st.st_uid}, not to this user (uid "
            f"{os.geteuid()}), who may know its key; remove it (rm {path}) and meshcomm makes a new one"
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            f"per-user key file {path}: has mode {stat.S_IMODE(st.st_mode):o}, so other users may "
            f"read or change the key; remove it (rm {path}, a new one is made) or run chmod 600 {path} "
            "if no one else can have read it"
        )


def all_loopback(hosts: Iterable[str]) -> bool:
    """True when every host resolves only to loopback addresses (127.0.0.0/8, ::1): a job
    whose every rendezvous address is one of these runs on this host alone."""
    hosts = list(hosts)
    return bool(hosts) and all(_loopback(h) for h in hosts)


def _loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    try:
        return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)
    except ValueError:
        return False
