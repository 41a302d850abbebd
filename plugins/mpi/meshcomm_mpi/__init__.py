"""meshcomm's mpi backend."""
