"""What the launcher tells a backend about a job, and what a backend's launcher support returns.

A backend plugin that wants ``meshcomm launch -n N --backend NAME`` to work passes a
``launcher=`` object to ``register``. It implements one of two methods:

* ``rank_env(job: JobSpec) -> list[dict[str, str]]``: the extra environment of each rank
  (index = rank) when meshcomm starts every rank itself (sockets, gloo, third parties);
* ``external_command(job: JobSpec, argv: list[str], env: dict[str, str]) -> list[str]``:
  one command that starts the whole job through another launcher (MPI's ``mpiexec``);
  meshcomm then runs that single command and forwards its output and exit status.
  meshcomm runs the command with ``env`` in its environment: pass secrets (the job secret,
  user variables) by name (Open MPI ``-x NAME``), never with their values on the command
  line, where every local user can read them (``ps``); ``--verbose`` prints the command.

A ``rank_env`` launcher may also have ``cleanup_command(job) -> str | None``: a shell
command the launcher runs on every host when the job ends, however it ended
(:class:`CleanupLauncher`). :data:`LauncherSupport` is the type ``register(launcher=...)``
takes: either protocol (they are checked structurally, so no base class is needed).

The launcher always sets ``MLX_BACKEND``, ``MLX_RANK``, ``MLX_WORLD_SIZE``,
``MLX_LOCAL_RANK``, ``MLX_LOCAL_SIZE``, ``MESHCOMM_JOB_ID``, ``MESHCOMM_JOB_SECRET`` and
``MLX_TIMEOUT`` (when given) for every rank it starts itself; ranks started by an external
launcher get the rank variables from the rank runner, which reads the MPI launcher's.

How ranks are started on their hosts (locally, one ssh session per host, ``srun``) is not
the backend's business: see :mod:`meshcomm.launch.starters`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeAlias, runtime_checkable

__all__ = ["RankPlace", "JobSpec", "RankEnvLauncher", "ExternalLauncher", "CleanupLauncher", "LauncherSupport"]


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs."""

    rank: int
    host: str | None  #: ssh destination, None for this machine
    ip: str  #: the address other ranks use to reach this rank
    local_index: int  #: index of this rank among the ranks of its host


class JobSpec(Protocol):
    """One job as the launcher planned it (implemented by ``meshcomm.launch.job.Job``)."""

    nranks: int
    places: list[RankPlace]
    job_id: str
    secret: str
    verbose: bool
    dir: Path  #: a fresh private directory of this job (same path on every host), removed at the end
    #: a fresh private directory in this machine's shared memory (``/dev/shm``) for the
    #: transport's own files, removed at the end even when the launcher is killed; made for
    #: backends started by an external launcher (mpiexec), else None (and where there is none)
    shm_dir: Path | None
    #: the survivors go on when a rank is lost (``--keep-going``): a launcher that starts the
    #: ranks itself (mpiexec) starts them with its fault tolerance
    keep_going: bool

    def free_port(self, place: RankPlace) -> int:
        """A TCP port that is free on ``place``'s host (probed locally, chosen for remote hosts)."""
        ...

    def listen_socket(self, place: RankPlace) -> tuple[int, int | None]:
        """(port, fd): for a local rank, a listening socket the rank inherits as ``fd`` (no
        race for the port); for a remote rank, a port chosen for it and ``None``."""
        ...

    def add_file(self, name: str, content: str) -> str:
        """Write ``content`` as ``name`` on every host of the job; returns its path there."""
        ...


@runtime_checkable
class RankEnvLauncher(Protocol):
    """meshcomm starts every rank itself; the backend adds each rank's environment."""

    def rank_env(self, job: JobSpec) -> list[dict[str, str]]: ...


@runtime_checkable
class ExternalLauncher(Protocol):
    """One command (e.g. ``mpiexec``) starts the whole job; meshcomm runs and watches it."""

    def external_command(self, job: JobSpec, argv: list[str], env: dict[str, str]) -> list[str]: ...


@runtime_checkable
class CleanupLauncher(Protocol):
    """Optional beside :class:`RankEnvLauncher`: a shell command run on every host at the job's end."""

    def cleanup_command(self, job: JobSpec) -> str | None: ...


#: what a backend passes as ``register(..., launcher=...)``: one of the two launcher protocols
LauncherSupport: TypeAlias = RankEnvLauncher | ExternalLauncher
