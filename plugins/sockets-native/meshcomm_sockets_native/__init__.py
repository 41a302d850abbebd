"""Optional compiled hot loop for the sockets backend's shared-memory path.

``meshcomm_sockets.shm`` uses :class:`Channel` when this package is installed and
``MESHCOMM_SOCKETS_NATIVE`` is not 0; the protocol is the same either way, so ranks with
and without it work together.
"""

from ._shm import Channel

__all__ = ["Channel"]
