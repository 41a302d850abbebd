"""What a collective path needs of the group it runs on, declared below both.

A path (:mod:`meshcomm_sockets.paths`) runs a group's collectives over the group's TCP
links; the group (:class:`~meshcomm_sockets.backend.SocketsBackend`) holds its path. With
the group's surface declared here, backend.py builds on this module and paths.py uses it,
so the two import in one direction only: backend -> paths -> mesh.
"""

from __future__ import annotations

import abc

from meshcomm.plugin import Backend

from .engine import Fabric, Link

__all__ = ["MeshGroup"]


class MeshGroup(Backend):
    """A group of ranks over the job's shared :class:`Fabric`: the generic algorithms'
    :class:`Backend`, plus the links and chunk size the TCP ring drives directly."""

    #: the connections and frame loop every group of the job shares
    fabric: Fabric
    #: the largest piece (bytes) the ring sends or reduces at a time
    chunk_bytes: int

    @abc.abstractmethod
    def link(self, r: int) -> Link:
        """The TCP link to group rank ``r``."""
