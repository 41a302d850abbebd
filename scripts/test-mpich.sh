#!/usr/bin/env bash
# The mpi backend's test set on MPICH, in .venv-mpich (made by scripts/setup-mpich.sh).
# scripts/test.sh runs it after the main pytest, which runs the same tests on Open MPI.
#
# The set: every tests/test_mpi_*.py (the backend's own tests, its failure tests), and the
# items of the launcher, failure-matrix, launch-security and conformance-kit tests that
# select the mpi backend (their ids contain "mpi": `-k mpi`; their `mpich` items skip
# here, they are the main venv's way of reaching this one). Extra arguments go to pytest.
#
# MESHCOMM_TEST_MPICH_PART chooses what runs: `all` (the default: the three parts below),
# `parallel` (the tests that share the machine, MESHCOMM_TEST_WORKERS processes), `slurm`
# (the tests of the one Slurm test cluster: never at the same time as another run's) or
# `exclusive` (the tests that compare machine-wide state, one at a time, alone).
# Exits non-zero on any failure, and when no test was selected.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv-mpich/bin/python
if [ ! -x "$VPY" ]; then
  echo "test-mpich: $VPY is missing; run bash scripts/setup-mpich.sh first" >&2
  exit 1
fi
PART=${MESHCOMM_TEST_MPICH_PART:-all}
case "$PART" in all|parallel|slurm|exclusive) ;; *)
  echo "test-mpich: MESHCOMM_TEST_MPICH_PART=$PART; use all, parallel, slurm or exclusive" >&2
  exit 2 ;;
esac
shopt -s nullglob
files=(tests/test_mpi_*.py tests/test_launch*.py tests/test_failure_*.py tests/test_security_launch.py
       tests/test_conformance_kit.py)
echo "== pytest (mpi backend on $("$VPY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])'), $PART)"
log=$(mktemp)
# every pytest run's temporary directories (tmp_path) go here, removed at the end
temps=$(mktemp -d)
if [ "$PART" = all ]; then
  . scripts/leftovers.sh
  leftovers_mark
  trap 'leftovers_remove; rm -rf "$log" "$temps"' EXIT
else  # a part runs beside other jobs: scripts/test.sh removes the leftovers when all have ended
  trap 'rm -rf "$log" "$temps"' EXIT
fi
pytest_() { "$VPY" -m pytest -p no:cacheprovider -q --basetemp "$(mktemp -d "$temps/run.XXXX")" "$@"; }
set +e
rc=0 slurm_rc=0 exclusive_rc=0
if [ "$PART" = all ]; then
  # as in scripts/test.sh: the Slurm cluster's tests in one pytest process beside the others
  pytest_ -m slurm_cluster -k mpi "${files[@]}" "$@" > "$log" 2>&1 &
  slurm=$!
fi
if [ "$PART" = all ] || [ "$PART" = parallel ]; then
  pytest_ -n "${MESHCOMM_TEST_WORKERS:-$(( $(nproc) + 1 ))}" --dist worksteal \
    -m "not slurm_cluster and not exclusive" -k mpi "${files[@]}" "$@"
  rc=$?
fi
if [ "$PART" = all ]; then
  wait "$slurm"
  slurm_rc=$?
  cat "$log"
elif [ "$PART" = slurm ]; then
  pytest_ -m slurm_cluster -k mpi "${files[@]}" "$@"
  slurm_rc=$?
fi
if [ "$PART" = all ] || [ "$PART" = exclusive ]; then
  pytest_ -m "exclusive and not slurm_cluster" -k mpi "${files[@]}" "$@"
  exclusive_rc=$?
fi
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
