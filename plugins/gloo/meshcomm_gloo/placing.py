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

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from meshcomm.plugin import BackendUnavailableError, Config

if TYPE_CHECKING:
    from .settings import GlooSettings

__all__ = ["Rendezvous", "resolve", "missing", "job_id"]

_RANK_VARS = "MLX_RANK (or a scheduler's rank: SLURM_PROCID, OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK, RANK)"
_SIZE_VARS = "MLX_WORLD_SIZE (or a scheduler's size: SLURM_NTASKS, OMPI_COMM_WORLD_SIZE, PMI_SIZE, WORLD_SIZE)"
_STORE_VARS = ("MESHCOMM_GLOO_PORT (with MESHCOMM_GLOO_ADDR), MLX_COORDINATOR=host:port (or MASTER_ADDR and "
               "MASTER_PORT) or MESHCOMM_GLOO_FILE")

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


def job_id(environ: Mapping[str, str]) -> str:
    """The id every rank of the job shares: meshcomm launch's, else torchrun's run id, else empty."""
    return environ.get("MESHCOMM_JOB_ID", "").strip() or environ.get("TORCHELASTIC_RUN_ID", "").strip()


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
            "on every rank")
    rank, size, said = config.rank, config.world_size, _said(config)
    assert rank is not None and size is not None
    job = job_id(env)
    if settings.port is not None:
        return Rendezvous(rank, size, "host" if rank == 0 else "client", settings.addr, settings.port, None, "",
                          job, f"{said}; store from MESHCOMM_GLOO_ADDR/MESHCOMM_GLOO_PORT")
    if settings.file is not None:
        return Rendezvous(rank, size, "file", "", 0, settings.file, "", job,
                          f"{said}; store from MESHCOMM_GLOO_FILE")
    coord = config.coordinator_address()
    assert coord is not None
    origin = f"{said}; store at the coordinator from {coord.source}"
    if coord.source.startswith("MASTER_ADDR") and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _STARTS["count"] += 1
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
        namespace = f"meshcomm-torchrun/{job or '-'}/restart{restart}/start{_STARTS['count']}/"
        # the agent's store is at MASTER_PORT itself (the coordinator meshcomm hosts is the port above)
        return Rendezvous(rank, size, "client", env["MASTER_ADDR"].strip(), int(env["MASTER_PORT"]), None,
                          namespace, job, f"{said}; torchrun's agent store at MASTER_ADDR:MASTER_PORT", agent=True)
    return Rendezvous(rank, size, "host" if rank == 0 else "client", coord.host, coord.port, None, "", job, origin)
