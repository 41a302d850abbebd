"""``LaunchOptions``: everything one ``meshcomm launch`` was asked to do, in one object.

The command line is parsed into one of these (:mod:`meshcomm.launch.cli`) and handed to
:func:`meshcomm.launch.run.launch`; a program can build one itself::

    from meshcomm.launch import LaunchOptions, launch
    status = launch(LaunchOptions(program=["train.py", "--epochs", "3"], nranks=4))
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    #: None: the hostfile's ``backend``, else :data:`DEFAULT_BACKEND`
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

    def backend_name(self) -> str:
        if self.backend:
            return self.backend
        if self.hosts is not None and self.hosts.backend:
            return self.hosts.backend
        return DEFAULT_BACKEND
