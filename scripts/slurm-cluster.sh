#!/usr/bin/env bash
# A real Slurm test cluster on this machine (as root): munge, slurmctld and three slurmd
# "nodes" h1..h3 in network namespaces with their own hostnames, an sshd per node.
#   scripts/slurm-cluster.sh up          bring it up (tears down leftovers first)
#   scripts/slurm-cluster.sh down        tear everything down (idempotent)
#   scripts/slurm-cluster.sh run CMD...  run CMD on the login host, e.g. run srun -N3 -n3 hostname
# The tests (tests/test_slurm.py, tests/test_mpi_multihost.py) bring up and tear down
# their own through tests/slurm.py; this script is for trying things by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" tests/slurm.py "$@"
