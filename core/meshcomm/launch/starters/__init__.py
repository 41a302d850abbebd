"""Starters: how ranks are started and stopped on their hosts (the ``--launcher`` seam).

``meshcomm launch`` plans a job (ranks, hosts, environment, the backend's set-up) and then
hands the starting of processes to a *starter*. A new way of starting ranks (Slurm's
``srun``, PBS's ``pbsdsh``, Kubernetes ``exec``) is one module here; nothing else in the
launcher changes.

Choosing one: ``--launcher {auto,local,ssh,slurm}``. ``auto`` is ``slurm`` inside a Slurm
allocation (``SLURM_JOB_ID`` set, and the ``slurm`` module present), else ``ssh`` (which
starts ranks of this machine locally and the others over one ssh session per host).
``local`` refuses a job with ranks on other hosts.

Writing one: a module ``meshcomm.launch.starters.NAME`` with a function
``create(options: LaunchOptions) -> Starter`` (``LaunchOptions`` is
:class:`meshcomm.launch.options.LaunchOptions`: everything the user asked for, e.g. the
``--ssh`` command) and an entry in :data:`STARTERS`. A :class:`Starter` has:

* ``name``: what ``--launcher`` calls it;
* ``start(hosts, output) -> list[Session]``: start every rank of ``hosts`` (a list of
  :class:`HostStart`, one per host of the job, in rank order, the launcher's own machine
  as ``host=None``) and return sessions that together cover every rank exactly once
  (one per host, or one for the whole job). Each rank's output goes, line by line, to
  ``output`` (:class:`Output`), never to the launcher's stdout directly. If ``start``
  raises (``OSError`` or ``ConfigError``), it must first stop whatever it started;
* optionally ``default_hosts(n: int | None) -> list[Host] | None``: the hosts to use when the
  user named none (a scheduler's allocation); None = this machine;
* optionally ``local_ranks: bool`` (default True): False when the starter runs even this
  machine's ranks through its own mechanism (``srun``): then no rank is planned as local
  (no inherited listening sockets: the sockets backend chooses ports instead).

A :class:`Session` is what the launcher watches and stops:

* ``ranks``: the ranks it covers;
* ``poll() -> dict[int, int | None]``: every rank's status, ``None`` while it runs, else
  ``subprocess`` style (exit code, or ``-N`` when killed by signal N). A rank the
  starter lost track of (its ssh connection died) gets a non-zero status, never ``None``
  forever;
* ``signal(sig)``: send ``sig`` to every rank's process group (the rank and what it
  started), also of ranks that already exited (their children must not outlive the job);
* ``signal_rank(sig)``: send ``sig`` to each running rank's own process only (``SIGUSR1``:
  the rank runner prints its Python stacks);
* ``records() -> list[dict]``: failure records (:mod:`meshcomm.runtime.exits`) that ranks of
  another machine wrote there (the launcher reads this machine's itself); may be called
  repeatedly and return the ones seen so far;
* ``finish()``: the job is over (every rank exited or was killed): wait for the last
  output, remove the job's directory on remote hosts, run ``HostStart.cleanup`` there and
  on this machine, release everything (connections, threads). Called exactly once.

Promises every starter keeps: no secret on a command line (``HostStart.env`` carries the
job secret and user variables: pass them through a pipe or the environment, never argv);
a rank never outlives the launcher (``die_with_parent`` locally; remotely, the end of the
connection stops the ranks); ``--verbose`` output goes through
:func:`meshcomm.runtime.launchsafety.mask`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ...protocol.errors import ConfigError
from ...runtime.launchspec import RankPlace

if TYPE_CHECKING:
    from ..options import LaunchOptions

__all__ = [
    "RankStart",
    "HostStart",
    "Output",
    "Session",
    "Starter",
    "STARTERS",
    "LAUNCHERS",
    "choose",
    "starter_name",
    "start_all",
]


#: the variable by which the sockets backend's launcher support hands a rank its inherited
#: listening socket (``pass_fds``): a replacement has no such socket
INHERITED_LISTENER = "MESHCOMM_SOCKETS_LISTEN_FD"


@dataclass(frozen=True)
class RankStart:
    """One rank to start."""

    place: RankPlace
    argv: list[str]
    #: this rank's own variables (``MLX_RANK``, ``MLX_LOCAL_RANK``, the backend's), set on top
    #: of :attr:`HostStart.env`
    env: dict[str, str]
    #: file descriptors the rank inherits (only for ranks of this machine: the sockets
    #: backend's listening sockets)
    pass_fds: tuple[int, ...] = ()

    @property
    def rank(self) -> int:
        return self.place.rank

    def replacement(self) -> RankStart:
        """This rank's replacement (``meshcomm launch --restart-lost``): the same program and
        variables, told to join the running job (``MESHCOMM_JOIN=1``), without the inherited
        sockets, which went with the lost process (nor the variable naming one)."""
        env = {k: v for k, v in self.env.items() if k != INHERITED_LISTENER}
        return RankStart(self.place, self.argv, {**env, "MESHCOMM_JOIN": "1"}, ())


@dataclass(frozen=True)
class HostStart:
    """Every rank of one host, and what the starter needs to start them there."""

    host: str | None  #: ssh destination (or node name); None = this machine
    ranks: list[RankStart]
    #: variables of every rank of the job (job id and secret, ``--env``, thread limits ...):
    #: contains secrets, so never on a command line
    env: dict[str, str]
    cwd: str  #: working directory of the ranks
    job_dir: str  #: the job's private directory, same path on every host
    #: files (name -> content) the backend needs in ``job_dir`` on every host; on this
    #: machine the launcher has written them already
    files: dict[str, str] = field(default_factory=dict)
    cleanup: str | None = None  #: the backend's shell command to run on the host at the end
    python: str = "python3"  #: an interpreter the host has (for helpers the starter runs there)
    verbose: bool = False  #: print how ranks are started (masked) to stderr


class Output(Protocol):
    """Where starters deliver output, one whole line at a time (``line`` ends with ``\\n``)."""

    def rank_line(self, rank: int, stream: str, line: bytes) -> None:
        """A line rank ``rank`` wrote to ``stream`` (``"out"`` or ``"err"``)."""
        ...

    def host_line(self, host: str | None, stream: str, line: bytes) -> None:
        """A line of no rank (ssh's or the starter's own messages about ``host``)."""
        ...


@runtime_checkable
class Session(Protocol):
    @property
    def ranks(self) -> Sequence[int]: ...

    def poll(self) -> dict[int, int | None]: ...

    def signal(self, sig: int) -> None: ...

    def signal_rank(self, sig: int) -> None: ...

    def records(self) -> list[dict]: ...

    def finish(self) -> None: ...


@runtime_checkable
class Starter(Protocol):
    name: str

    def start(self, hosts: Sequence[HostStart], output: Output) -> list[Session]: ...


def start_all(hosts: Sequence[HostStart], open_session: Callable[[HostStart], Session]) -> list[Session]:
    """One session per host; if opening one fails, the sessions already open are killed
    and finished before the error propagates (no rank outlives a job that never started)."""
    sessions: list[Session] = []
    try:
        for h in hosts:
            sessions.append(open_session(h))
    except BaseException:
        for s in sessions:
            s.signal(signal.SIGKILL)
            s.finish()
        raise
    return sessions


#: ``--launcher`` name -> module under ``meshcomm.launch.starters``
STARTERS: dict[str, str] = {"local": "local", "ssh": "ssh", "slurm": "slurm"}
#: the choices of ``--launcher``
LAUNCHERS = ("auto", *STARTERS)


def _module_present(name: str) -> bool:
    return importlib.util.find_spec(f"{__name__}.{STARTERS[name]}") is not None


def starter_name(requested: str, environ: Mapping[str, str] | None = None) -> str:
    """The starter ``--launcher requested`` means here (``auto`` resolved)."""
    environ = os.environ if environ is None else environ
    if requested == "auto":
        if environ.get("SLURM_JOB_ID") and _module_present("slurm"):
            return "slurm"
        return "ssh"
    if requested not in STARTERS:
        raise ConfigError(f"--launcher {requested!r}: choose one of {', '.join(LAUNCHERS)}")
    return requested


def choose(options: LaunchOptions, environ: Mapping[str, str] | None = None) -> Starter:
    """The starter for ``options.launcher`` (``auto`` resolved), created from ``options``."""
    name = starter_name(options.launcher, environ)
    if not _module_present(name):
        raise ConfigError(
            f"--launcher {name}: this meshcomm has no {name} starter (module "
            f"meshcomm.launch.starters.{STARTERS[name]} is missing); use --launcher ssh or local"
        )
    module = importlib.import_module(f"{__name__}.{STARTERS[name]}")
    starter = module.create(options)
    if not isinstance(starter, Starter):
        raise ConfigError(
            f"--launcher {name}: meshcomm.launch.starters.{STARTERS[name]}.create() did not return a Starter"
        )
    return starter
