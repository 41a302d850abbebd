#!/usr/bin/env bash
# The mpi backend's test set on MPICH, in .venv-mpich (made by scripts/setup-mpich.sh).
# scripts/test.sh runs it after the main pytest, which runs the same tests on Open MPI.
#
# The set: every tests/test_mpi_*.py (the backend's own tests, its failure tests), and the
# items of the launcher, failure-matrix, launch-security and conformance-kit tests that
# select the mpi backend (their ids contain "mpi": `-k mpi`; their `mpich` items skip
# here, they are the main venv's way of reaching this one). Extra arguments go to pytest.
# Exits non-zero on any failure, and when no test was selected.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv-mpich/bin/python
if [ ! -x "$VPY" ]; then
  echo "test-mpich: $VPY is missing; run bash scripts/setup-mpich.sh first" >&2
  exit 1
fi
shopt -s nullglob
files=(tests/test_mpi_*.py tests/test_launch*.py tests/test_failure_*.py tests/test_security_launch.py
       tests/test_conformance_kit.py)
echo "== pytest (mpi backend on $("$VPY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])'))"
set +e
# as in scripts/test.sh: the tests of the one Slurm test cluster in one pytest process of their
# own beside the parallel ones (MESHCOMM_TEST_WORKERS processes; alone: cores + 1)
. scripts/leftovers.sh
leftovers_mark
log=$(mktemp)
trap 'leftovers_remove; rm -f "$log"' EXIT
"$VPY" -m pytest -p no:cacheprovider -q -m slurm_cluster -k mpi "${files[@]}" "$@" > "$log" 2>&1 &
slurm=$!
"$VPY" -m pytest -p no:cacheprovider -q -n "${MESHCOMM_TEST_WORKERS:-$(( $(nproc) + 1 ))}" --dist worksteal \
  -m "not slurm_cluster and not exclusive" -k mpi "${files[@]}" "$@"
rc=$?
wait "$slurm"
slurm_rc=$?
cat "$log"
# the tests that compare machine-wide state (marked exclusive): after the others, one at a time
"$VPY" -m pytest -p no:cacheprovider -q -m "exclusive and not slurm_cluster" -k mpi "${files[@]}" "$@"
exclusive_rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test-mpich: pytest collected no mpi tests: that is a failure" >&2
  exit 1
fi
if [ "$slurm_rc" != 0 ] && { [ "$slurm_rc" != 5 ] || [ $# = 0 ]; }; then
  echo "test-mpich: the Slurm cluster's mpi tests failed (exit $slurm_rc)" >&2
  exit 1
fi
if [ "$exclusive_rc" != 0 ] && [ "$exclusive_rc" != 5 ]; then
  echo "test-mpich: the exclusive mpi tests failed (exit $exclusive_rc)" >&2
  exit 1
fi
exit "$rc"
