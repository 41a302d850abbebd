"""Registers the ``mpi`` backend with meshcomm (entry-point group ``meshcomm``).

Importing this module must be fast and must never fail, whatever MPI is (or is not)
installed: it imports neither mpi4py nor numpy. The availability check, the launcher
check and the factory load what they need when the core calls them.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from meshcomm.plugin import BackendRegistrar, Config, JobSpec, hookimpl

from .environment import launch_reason, unavailable_reason
from .settings import MPISettings

if TYPE_CHECKING:  # NumPy's import waits for a backend to start: the launcher loads this module too
    from meshcomm.plugin import Backend

__all__ = ["meshcomm_register_backends", "MPILauncher"]


def _factory(config: Config, settings: Any) -> Backend:
    from .factory import create_backend

    return create_backend(config, settings)


class MPILauncher:
    """``meshcomm launch --backend mpi`` support: one mpiexec command for the whole job."""

    def external_command(self, job: JobSpec, argv: list[str], env: dict[str, str]) -> list[str]:
        """The mpiexec command that runs ``argv`` on ``job.nranks`` ranks with ``env`` set."""
        from .launcher import job_command

        return job_command(job, argv, env)


@hookimpl
def meshcomm_register_backends(register: BackendRegistrar) -> None:
    register(
        "mpi",
        factory=_factory,
        available=unavailable_reason,
        environment=launch_reason,
        settings=MPISettings,
        launcher=MPILauncher(),
        priority=20,
        description=f"MPI through mpi4py (native collectives; start under mpiexec); {which_path()} small all_sum",
    )


def which_path() -> str:
    """How this installation runs a small all_sum: "compiled" when the wheel's extension
    (``meshcomm_mpi._planned``) is there, else "pure-Python" (a build without a compiler)."""
    return "compiled" if importlib.util.find_spec("meshcomm_mpi._planned") is not None else "pure-Python"
