"""The environment variables through which launchers tell a process its place in a job.

One table, :data:`FAMILIES`, names each launcher's variables; every other list of them is
built from it: :func:`meshcomm.runtime.placement.placement` reads the families in this order, the
rank runner (:mod:`meshcomm.launch.rank`) and :mod:`meshcomm.runtime.exits` read
:data:`RUNNER_RANK_VARS` and :data:`FROM_MPI_LAUNCHER`, and plugins get the table through
:mod:`meshcomm.plugin`.

Standard library only, and no import of meshcomm: the rank runner starts before anything
heavy is imported, and may run this file by path under an interpreter without meshcomm.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "Family",
    "FAMILIES",
    "MPI_FAMILIES",
    "family",
    "variables",
    "RUNNER_RANK_VARS",
    "FROM_MPI_LAUNCHER",
    "rank_from_env",
]


@dataclass(frozen=True)
class Family:
    """One starter's variable names (None: that starter does not set it)."""

    name: str
    rank: str
    size: str | None
    local_rank: str | None
    local_size: str | None


#: in the order they are consulted: meshcomm's own first, torchrun's generic names last
FAMILIES: tuple[Family, ...] = (
    Family("meshcomm", "MLX_RANK", "MLX_WORLD_SIZE", "MLX_LOCAL_RANK", "MLX_LOCAL_SIZE"),
    Family("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
    Family(
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    Family("PMIx", "PMIX_RANK", None, None, None),
    Family("MPICH (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    Family("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
)

#: the families that are MPI launchers: Open MPI's mpiexec, a PMIx launcher (prterun,
#: ``srun --mpi=pmix``), MPICH/Hydra
MPI_FAMILIES: tuple[str, ...] = ("Open MPI", "PMIx", "MPICH (PMI)")


def family(name: str) -> Family:
    """The family of :data:`FAMILIES` called ``name``; KeyError if there is none."""
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise KeyError(name)


def variables(field: str, names: Iterable[str]) -> tuple[str, ...]:
    """The ``field`` variable (``"rank"``, ``"size"``, ``"local_rank"`` or ``"local_size"``) of
    each family named, in the order named; a family that sets none is skipped."""
    found = (getattr(family(name), field) for name in names)
    return tuple(var for var in found if var is not None)


#: which variable tells a rank of ``meshcomm launch`` its rank, in order of precedence (the rank
#: runner's own rank, the failure records of :mod:`meshcomm.runtime.exits`). It differs from
#: :data:`FAMILIES` on purpose: only the launchers that start those ranks count (meshcomm's own
#: and the MPI route's mpiexec; the Slurm starter removes Slurm's task variables, and a batch
#: script's ``SLURM_PROCID`` or torchrun's generic ``RANK`` would name no rank of the job), and
#: MPICH's ``PMI_RANK`` comes before ``PMIX_RANK``, the order these readers have always used
#: (it matters only when both are set, i.e. one was inherited from an enclosing job).
RUNNER_RANK_VARS: tuple[str, ...] = variables("rank", ("meshcomm", "Open MPI", "MPICH (PMI)", "PMIx"))


def rank_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's rank as the launcher that started it says (:data:`RUNNER_RANK_VARS`)."""
    for var in RUNNER_RANK_VARS:
        value = environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


#: meshcomm's variable <- the first of these an MPI launcher sets (the rank runner sets meshcomm's
#: from them): the MPI families in :data:`FAMILIES` order, and for the local rank and size also
#: ``PMI_LOCAL_RANK``/``PMI_LOCAL_SIZE``, which the runner accepts as a last resort and
#: :func:`meshcomm.runtime.placement.placement` does not read
FROM_MPI_LAUNCHER: dict[str, tuple[str, ...]] = {
    "MLX_RANK": variables("rank", MPI_FAMILIES),
    "MLX_WORLD_SIZE": variables("size", MPI_FAMILIES),
    "MLX_LOCAL_RANK": (*variables("local_rank", MPI_FAMILIES), "PMI_LOCAL_RANK"),
    "MLX_LOCAL_SIZE": (*variables("local_size", MPI_FAMILIES), "PMI_LOCAL_SIZE"),
}
