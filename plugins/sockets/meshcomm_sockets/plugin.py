"""Registers the sockets backend with meshcomm (entry point group ``meshcomm``)."""

from __future__ import annotations

from meshcomm.errors import BackendUnavailableError
from meshcomm.hookspecs import hookimpl


def _factory(config, settings):
    raise BackendUnavailableError("the sockets backend is not implemented yet")


@hookimpl
def meshcomm_register_backends(register):
    register("sockets", factory=_factory, available=lambda: "not implemented yet")
