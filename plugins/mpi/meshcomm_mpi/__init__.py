"""meshcomm's ``mpi`` backend: MPI through mpi4py, registered in the ``meshcomm`` entry-point group.

Importing this package loads neither mpi4py nor MPI; see :mod:`meshcomm_mpi.plugin`.
"""

__all__: list[str] = []
