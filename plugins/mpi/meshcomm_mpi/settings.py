"""The mpi backend's own settings, each tied to an environment variable.

Loaded by the core with :func:`meshcomm.runtime.config.load_settings`, so an invalid value is a
ConfigError naming the variable and what it accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from meshcomm.plugin import setting
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MPISettings", "FT_ENV"]

#: set by ``meshcomm launch --keep-going`` in every rank it starts under Open MPI's fault tolerance
FT_ENV = "MESHCOMM_MPI_FT"


class MPISettings(BaseModel):
    """Settings of the ``mpi`` backend (see docs/backends/mpi.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mpiexec: Path | None = setting(
        None,
        env="MESHCOMM_MPIEXEC",
        accepts="the path of an mpiexec/mpirun of the MPI library that mpi4py loads",
        description=(
            "mpiexec used by `meshcomm launch --backend mpi`; default: the one installed "
            "next to the MPI library mpi4py loads"
        ),
    )
    mpiexec_args: str = setting(
        "",
        env="MESHCOMM_MPIEXEC_ARGS",
        accepts="extra mpiexec arguments as one shell-quoted string, e.g. '--mca btl tcp,self'",
        description="extra arguments `meshcomm launch --backend mpi` passes to mpiexec",
    )
    int_sum: Literal["auto", "native", "numpy"] = setting(
        "auto",
        env="MESHCOMM_MPI_INT_SUM",
        tuning=True,
        accepts="auto, native or numpy",
        description=(
            "how 8/16-bit integer sums are reduced: auto = MPI's own op unless a start-up "
            "probe finds it saturating instead of wrapping; native = always MPI's; "
            "numpy = always a user-defined MPI op running NumPy's add"
        ),
    )
    spin_us: float = setting(
        200.0,
        env="MESHCOMM_MPI_SPIN_US",
        tuning=True,
        accepts="a number of microseconds from 0 to 10000000",
        description=(
            "how long a waiting operation polls MPI without sleeping before it starts to "
            "sleep between polls (longer: lower latency, more CPU burnt by waiting ranks)"
        ),
        ge=0,
        le=10_000_000,
        allow_inf_nan=False,
    )
    ring_from: Literal["auto", "off"] | Annotated[int, Field(ge=0)] = setting(
        "auto",
        env="MESHCOMM_MPI_RING_FROM",
        tuning=True,
        accepts="auto, off, or a number of bytes from 0 up",
        description=(
            "from which array size all_sum/all_max/all_min run Open MPI's ring algorithm for the "
            "non-blocking all-reduce instead of its default binomial tree: auto = 64 KiB on 2 ranks, "
            "64 KiB per rank on more; off = always Open MPI's own choice (other MPIs: always theirs)"
        ),
    )
    compiled: bool = setting(
        True,
        env="MESHCOMM_MPI_COMPILED",
        tuning=True,
        accepts="1/0, true/false, yes/no, on/off",
        description=(
            "run small all_sums in the backend's C extension, carried inside the call check's own "
            "operation, when this installation has it (meshcomm info says; 0: the pure-Python steps, "
            "the call check and the data as two operations; the ranks agree at start-up)"
        ),
    )
    fault_tolerance: bool = setting(
        False,
        env=FT_ENV,
        accepts="1/0, true/false, yes/no, on/off",
        description=(
            "the job runs under MPI's fault tolerance (Open MPI's mpiexec --with-ft ulfm), so survivors "
            "can agree and shrink; `meshcomm launch --keep-going --backend mpi` sets it (Open MPI's own "
            "OMPI_MCA_mpi_ft_enable counts too)"
        ),
    )
