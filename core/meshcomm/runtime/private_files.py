"""Files only this user can read, in directories no other user can change.

meshcomm writes logs (``--log-dir``), traces (``--trace``, ``MESHCOMM_TRACE``) and progress
records into directories a user names. If another local user made that directory first
(or can write into it), a symbolic link they plant there turns the job's writes into
overwrites of any file the job's user may write -- as root, any file. So a directory is
created mode 0700 when missing and refused when it is a link, is not this user's, or is
writable by others; files are created ``O_NOFOLLOW`` relative to the opened directory,
mode 0600, and temporary names are random.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from ..protocol.errors import ConfigError

__all__ = ["private_dir", "open_dir", "create_file", "write_atomic"]

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def private_dir(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a directory only this user can change (created 0700 with its parents
    when missing); ConfigError naming ``what`` (e.g. ``--log-dir``), the reason and the fix."""
    folder = Path(path)
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot create this directory: {exc.strerror}") from None
    try:
        st = os.lstat(folder)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot use this directory: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"{what} {path}: is a symbolic link; give the directory it points to (a link can be "
            "changed to send the job's files elsewhere)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path}: exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"{what} {path}: belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}), "
            "who could replace the job's files there with links; use a directory of your own"
        )
    if st.st_mode & 0o022:
        who = "other users" if st.st_mode & 0o002 else "its group"
        raise ConfigError(
            f"{what} {path}: is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}), who could "
            f"put links there in place of the job's files; run chmod go-w {path}, or use a "
            "directory of your own"
        )
    return folder


def open_dir(folder: str | os.PathLike[str]) -> int:
    """A descriptor of ``folder`` (not following a link) to create files relative to."""
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def create_file(dir_fd: int, name: str) -> int:
    """``name`` in the directory ``dir_fd``, created or truncated, mode 0600, never through a
    link; a writable descriptor."""
    return os.open(name, _FLAGS | os.O_TRUNC, 0o600, dir_fd=dir_fd)


def write_atomic(folder: str | os.PathLike[str], name: str, data: bytes) -> Path:
    """Write ``data`` to ``folder/name`` (mode 0600) through a new randomly named file
    renamed over it, so a reader never sees half a file and nobody can guess the name."""
    dfd = open_dir(folder)
    try:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, _FLAGS | os.O_EXCL, 0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)
    return Path(folder) / name
