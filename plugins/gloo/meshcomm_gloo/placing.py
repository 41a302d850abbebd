"""Where this rank sits and where the rendezvous store is, from whatever started the job.

In order of precedence:

* rank and world size: the core's :class:`~meshcomm.plugin.Config` (``MLX_RANK``/
  ``MLX_WORLD_SIZE``, else the first launcher family :func:`meshcomm.plugin.placement`
  finds: Slurm, Open MPI, PMIx, MPICH, torchrun); gloo reads no rank variable itself;
* the store: ``MESHCOMM_GLOO_PORT`` (with ``MESHCOMM_GLOO_ADDR``; rank 0 hosts a TCPStore),
  else ``MESHCOMM_GLOO_FILE`` (a FileStore), else the core config's coordinator
  (``MLX_COORDINATOR``, ``MASTER_ADDR``/``MASTER_PORT`` or the Slurm step; from ``MASTER_*``
  it is the port above ``MASTER_PORT``), where rank 0 hosts the TCPStore. Under torchrun
  (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent already serves a TCPStore at
  ``MASTER_ADDR:MASTER_PORT``: every rank connects to it as a client, and meshcomm's keys
  live under a namespace naming the run, the restart and this process's start-up count.

Pure Python (no torch).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from meshcomm.plugin import FAMILIES, BackendUnavailableError, Config

if TYPE_CHECKING:
    from .settings import GlooSettings

__all__ = ["Rendezvous", "resolve", "missing", "job_id", "is_address"]

_OWN, *_SCHEDULERS = FAMILIES  # meshcomm's own variables, then every other launcher's in the core's order
_RANK_VARS = f"{_OWN.rank} (or a scheduler's rank: {', '.join(f.rank for f in _SCHEDULERS)})"
_SIZE_VARS = f"{_OWN.size} (or a scheduler's size: {', '.join(f.size for f in _SCHEDULERS if f.size)})"
_STORE_VARS = (
    "MESHCOMM_GLOO_PORT (with MESHCOMM_GLOO_ADDR), MLX_COORDINATOR=host:port (or MASTER_ADDR and "
    "MASTER_PORT) or MESHCOMM_GLOO_FILE"
)

#: start-ups of the gloo backend in this process on a shared (agent) store; part of the namespace,
#: so a second meshcomm.init() in the same processes does not read the first one's keys
_STARTS = {"count": 0}


@dataclass(frozen=True)
class Rendezvous:
    """How this rank reaches the rendezvous store."""

    rank: int
    size: int
    kind: Literal["host", "client", "file"]  # host: this rank serves the TCPStore
    addr: str
    port: int
    file: Path | None
    namespace: str  # put before every key (a shared store holds others' keys)
    job: str  # bound into every value's tag
    origin: str  # which variables said all this, for messages
    agent: bool = False  # the store is torchrun's agent store

    def describe(self) -> str:
        """E.g. ``TCPStore 10.0.0.1:29500 (hosted by rank 0; from MLX_COORDINATOR)``."""
        if self.kind == "file":
            return f"FileStore {self.file} ({self.origin})"
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        who = "torchrun's agent store" if self.agent else "hosted by rank 0"
        return f"TCPStore {host}:{self.port} ({who}; {self.origin})"


def _first(environ: Mapping[str, str], *names: str) -> str:
    return next((v for v in (environ.get(n, "").strip() for n in names) if v), "")


def _scheduler_id(environ: Mapping[str, str], family: str) -> str:
    """The job id the scheduler ``family`` (a :data:`meshcomm.plugin.FAMILIES` name) gives all its ranks."""
    if family == "Slurm":
        job = _first(environ, "SLURM_HET_JOB_ID", "SLURM_PACK_JOB_ID", "SLURM_JOB_ID")  # a het job's components
        step = _first(environ, "SLURM_STEP_ID", "SLURM_STEPID")  # differ in SLURM_JOB_ID
        return f"slurm {job}.{step}" if job and step else ""
    if family in ("Open MPI", "PMIx"):
        ns = _first(environ, "PMIX_NAMESPACE")  # Open MPI 5 (prterun-<host>-<pid>@<n>), srun --mpi=pmix
        if ns:
            return f"pmix {ns}"
        ompi = _first(environ, "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid")  # Open MPI 4
        return f"openmpi {ompi}" if ompi else ""
    return ""


def job_id(environ: Mapping[str, str], source: str | None = None) -> str:
    """The id every rank of the job shares, bound into every store value's tag ("" when nothing names one).

    meshcomm launch's ``MESHCOMM_JOB_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``, else the id of
    the scheduler whose variables placed this rank (``source``: the core config's
    ``placement_source``): Slurm's job and step (``SLURM_JOB_ID``, or ``SLURM_HET_JOB_ID``, and
    ``SLURM_STEP_ID``), the PMIx namespace (``PMIX_NAMESPACE``: Open MPI 5, ``srun --mpi=pmix``) or
    Open MPI 4's job id (``OMPI_MCA_ess_base_jobid``/``OMPI_MCA_orte_ess_jobid``). ``source`` None:
    the first of those present. A rank placed by ``MLX_RANK`` takes no scheduler's id, because its
    ranks may have been started from shells where those variables differ (a batch script's and a
    step's). The id only keeps jobs apart that a scheduler already tells apart; every start-up is
    kept apart by its nonce (:mod:`.session`), with or without an id.
    """
    own = _first(environ, "MESHCOMM_JOB_ID", "TORCHELASTIC_RUN_ID")
    if own:
        return own
    families = ("Slurm", "Open MPI") if source is None else (source,)
    return next((i for i in (_scheduler_id(environ, f) for f in families) if i), "")


def _said(config: Config) -> str:
    """Whose variables gave rank and size, for messages (the config already checked rank < size)."""
    source = config.placement_source or "MLX_RANK"
    if source in ("MLX_RANK", "argument rank"):
        return f"rank from {source}, size from MLX_WORLD_SIZE"
    return f"rank and size from {source}"


def missing(config: Config, settings: GlooSettings) -> list[str]:
    """What is still needed to start (empty when the environment is complete)."""
    out = []
    if config.rank is None:
        out.append(_RANK_VARS)
    if config.world_size is None:
        out.append(_SIZE_VARS)
    if settings.port is None and settings.file is None and config.coordinator is None:
        out.append(_STORE_VARS)
    return out


def resolve(config: Config, settings: GlooSettings, environ: Mapping[str, str] | None = None) -> Rendezvous:
    """The rendezvous of this rank; BackendUnavailableError naming what is missing.

    ``environ`` (default ``os.environ``) is read for the job id and torchrun's agent store only.
    """
    env = os.environ if environ is None else environ
    lacking = missing(config, settings)
    if lacking:
        raise BackendUnavailableError(
            f"gloo backend: missing {'; '.join(lacking)}. Start the job with `meshcomm launch --backend gloo`, "
            "under a scheduler (srun, mpirun, torchrun) with MLX_COORDINATOR=host:port, or set those variables "
            "on every rank"
        )
    rank, size, said = config.rank, config.world_size, _said(config)
    assert rank is not None and size is not None
    job = job_id(env, config.placement_source or "MLX_RANK")
    if settings.port is not None:
        return Rendezvous(
            rank,
            size,
            "host" if rank == 0 else "client",
            settings.addr,
            settings.port,
            None,
            "",
            job,
            f"{said}; store from MESHCOMM_GLOO_ADDR/MESHCOMM_GLOO_PORT",
        )
    if settings.file is not None:
        return Rendezvous(rank, size, "file", "", 0, settings.file, "", job, f"{said}; store from MESHCOMM_GLOO_FILE")
    coord = config.coordinator_address()
    assert coord is not None
    origin = f"{said}; store at the coordinator from {coord.source}"
    if coord.source.startswith("MASTER_ADDR") and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _STARTS["count"] += 1
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
        namespace = f"meshcomm-torchrun/{job or '-'}/restart{restart}/start{_STARTS['count']}/"
        # the agent's store is at MASTER_PORT itself (the coordinator meshcomm hosts is the port above)
        return Rendezvous(
            rank,
            size,
            "client",
            env["MASTER_ADDR"].strip(),
            int(env["MASTER_PORT"]),
            None,
            namespace,
            job,
            f"{said}; torchrun's agent store at MASTER_ADDR:MASTER_PORT",
            agent=True,
        )
    return Rendezvous(rank, size, "host" if rank == 0 else "client", coord.host, coord.port, None, "", job, origin)


def is_address(text: str) -> bool:
    """Whether ``text`` is an IP address (not a host or interface name)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
