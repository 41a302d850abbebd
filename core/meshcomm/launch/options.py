"""``LaunchOptions``: everything one ``meshcomm launch`` was asked to do, in one object.

The command line is parsed into one of these (:mod:`meshcomm.launch.cli`) and handed to
:func:`meshcomm.launch.run.launch`; a program can build one itself::

    from meshcomm.launch import LaunchOptions, launch
    status = launch(LaunchOptions(program=["train.py", "--epochs", "3"], nranks=4))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..protocol.errors import ConfigError
from .hosts import LaunchHostfile

__all__ = ["LaunchOptions", "DEFAULT_SSH", "DEFAULT_BACKEND"]

DEFAULT_SSH = "ssh -o BatchMode=yes"
#: the backend when neither ``--backend`` nor the hostfile's ``backend`` names one
DEFAULT_BACKEND = "sockets"


@dataclass
class LaunchOptions:
    #: the program and its arguments (a ``.py`` file, ``-m module`` or ``-c code`` runs with
    #: ``python`` through the rank runner; anything else runs as given)
    program: list[str]
    #: total number of ranks; None: the hosts' slots (``--hosts a:2,b:2``, hostfile
    #: ``slots``, ``ranks_per_host``) decide
    nranks: int | None = None
    #: None: ``--env MLX_BACKEND=X``, else an exported ``MLX_BACKEND``, else the hostfile's
    #: ``backend``, else :data:`DEFAULT_BACKEND` (see :meth:`backend_choice`)
    backend: str | None = None
    hosts: LaunchHostfile | None = None  #: None: this machine (or the starter's hosts)
    ranks_per_host: int | None = None  #: slots of every host that does not give its own
    launcher: str = "auto"  #: the starter: auto, local, ssh, slurm
    env: dict[str, str] = field(default_factory=dict)  #: variables for every rank
    timeout: float | None = None  #: ``MLX_TIMEOUT`` of every rank, seconds
    prefix: bool = True  #: prefix output lines with ``[rank R] ``
    verbose: bool = False  #: print how ranks are started (secrets masked)
    cwd: str | None = None  #: working directory of every rank (default: the current one)
    python: str | None = None  #: interpreter of ``.py`` programs (default: this one)
    ssh: str = DEFAULT_SSH  #: command that reaches remote hosts
    port_base: int | None = None  #: first port of ranks on remote hosts
    log_dir: str | None = None  #: also write each rank's output to ``DIR/rank-R.log``
    #: ``MESHCOMM_TRACE`` of every rank; the ranks' files are merged into ``DIR/trace.json`` at the end
    trace: str | None = None
    #: a rank that fails does not end the job: the others may shrink and go on; the job
    #: exits 0 when some rank exited 0 (the lost ones are listed)
    keep_going: bool = False
    #: start up to this many replacements for ranks that fail (implies ``keep_going``); each
    #: joins (``MESHCOMM_JOIN=1``) when the others call ``Group.grow()``
    restart_lost: int = 0

    def backend_choice(self, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
        """The backend's name and where it came from, first that is set: ``--backend``,
        ``--env MLX_BACKEND=X``, ``MLX_BACKEND`` in the launcher's environment, the
        hostfile's ``backend``, :data:`DEFAULT_BACKEND`. ``any`` (MLX_BACKEND's default)
        names no backend here. An exported ``MLX_BACKEND`` that contradicts the hostfile is
        refused rather than silently overriding either one."""
        env = os.environ if environ is None else environ
        if self.backend and self.backend.strip():
            name = self.backend.strip().lower()
            given = self.env.get("MLX_BACKEND", "").strip().lower()
            if given and given not in (name, "any"):  # "any": the ranks choose by their environment
                raise ConfigError(
                    f"--backend {self.backend} and --env MLX_BACKEND={self.env['MLX_BACKEND']} "
                    "disagree: give the backend once, with --backend"
                )
            return name, f"--backend {self.backend}"
        hostfile = self.hosts.backend if self.hosts is not None and self.hosts.backend else None
        for value, source in (
            (self.env.get("MLX_BACKEND"), "--env MLX_BACKEND={}"),
            (env.get("MLX_BACKEND"), "MLX_BACKEND={} (from the environment)"),
        ):
            name = (value or "").strip().lower()
            if not name or name == "any":
                continue
            if hostfile is not None and hostfile.strip().lower() != name:
                raise ConfigError(
                    f"{source.format(value)} contradicts the hostfile's backend {hostfile!r}: "
                    f"pass --backend NAME to choose one, or unset MLX_BACKEND"
                )
            return name, source.format(value)
        if hostfile is not None:
            return hostfile.strip().lower(), "the hostfile's backend"
        return DEFAULT_BACKEND, "the default"
