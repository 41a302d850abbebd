"""Registers the mpi backend with meshcomm (entry point group ``meshcomm``)."""

from __future__ import annotations

from meshcomm.errors import BackendUnavailableError
from meshcomm.hookspecs import hookimpl


def _factory(config, settings):
    raise BackendUnavailableError("the mpi backend is not implemented yet")


@hookimpl
def meshcomm_register_backends(register):
    register("mpi", factory=_factory, available=lambda: "not implemented yet")
