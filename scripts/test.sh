#!/usr/bin/env bash
# The test command: set up everything (system packages when root, .venv, every plugin,
# .venv-mpich), then lint, type-check, build the docs site and run the whole test suite (the
# mpi backend on Open MPI), then the mpi backend's test set again on MPICH
# (scripts/test-mpich.sh). Exits non-zero on any failure in any part.
#
# The tests run in parallel (pytest-xdist, MESHCOMM_TEST_WORKERS processes, default: cores + 1,
# because most tests wait on processes they started), the tests of the one Slurm test cluster
# in one more process beside them; tests marked `exclusive` (they compare machine-wide state)
# and `ray_cluster` (a Ray cluster's daemons would slow the others) run after them, one at a
# time; then the MPICH set.
# Extra arguments go to both pytest runs (e.g. scripts/test.sh -k sockets; --cpu-log FILE appends
# each test's wall and CPU seconds, its own and its jobs', to FILE: tests/conftest.py);
# MESHCOMM_TEST_MPICH=0 skips the MPICH venv and run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && [ -f scripts/ci-system-deps.sh ]; then
  bash scripts/ci-system-deps.sh
fi
MPICH=${MESHCOMM_TEST_MPICH:-1}
# one scratch directory for this run's logs and docs site, and the files MPICH's Hydra leaves:
# gone when the script ends, however it ends (short of SIGKILL)
. scripts/leftovers.sh
leftovers_mark
scratch=$(mktemp -d)
trap 'leftovers_remove; rm -rf "$scratch"' EXIT
if [ "$MPICH" != 0 ]; then
  # the two venvs are independent: build them side by side
  mpich_log=$scratch/setup-mpich.log
  bash scripts/setup-mpich.sh > "$mpich_log" 2>&1 &
  mpich_setup=$!
fi
bash scripts/setup.sh
if [ "$MPICH" != 0 ]; then
  if ! wait "$mpich_setup"; then
    cat "$mpich_log" >&2
    echo "FAILED: scripts/setup-mpich.sh" >&2
    exit 1
  fi
  cat "$mpich_log"
fi
echo "== set-up took $SECONDS s"
VPY=.venv/bin/python
# bytecode caches are written in this run (git ignores them): with PYTHONDONTWRITEBYTECODE set,
# each of the ~2000 processes the tests start compiles the project's modules from source again,
# and pytest rewrites every test module again in each of its collections (5.7 s of CPU -> 2.9 s)
unset PYTHONDONTWRITEBYTECODE
WORKERS=${MESHCOMM_TEST_WORKERS:-$(( $(nproc) + 1 ))}
export MESHCOMM_TEST_WORKERS=$WORKERS

# lint, types and the docs site are checked while the tests run (their verdict comes at the end)
checks_log=$scratch/checks.log
site=$scratch/site
mkdir "$site"
(
  set -e
  echo "== ruff (lint, and the one format: ruff format)"
  "$VPY" -m ruff check core plugins tests examples bench scripts
  "$VPY" -m ruff format --check core plugins tests examples bench scripts
  echo "== mypy (core)"
  # its cache outside the checkout, kept between runs and clones like pip's: mypy checks each
  # cached module against its source's hash, so a fresh clone re-checks only what changed
  # (20 s of CPU -> 1 s on this machine)
  "$VPY" -m mypy --cache-dir "${XDG_CACHE_HOME:-$HOME/.cache}/meshcomm/mypy"
  echo "== docs site (mkdocs build --strict: any warning, e.g. a broken link, fails the run)"
  # no --quiet: with it mkdocs drops the warnings before strict mode counts them, and passes
  if ! "$VPY" -m mkdocs build --strict --site-dir "$site/html" > "$site/log" 2>&1; then
    grep -v "^INFO" "$site/log"
    echo "FAILED: the docs site (mkdocs build --strict)"
    exit 1
  fi
) > "$checks_log" 2>&1 &
checks=$!

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# pytest's exit status 5 (no test selected) fails a part, unless arguments chose a subset
none_ok() { if [ "$1" = 5 ] && [ "$2" -gt 0 ]; then echo 0; else echo "$1"; fi; }
set +e
# the tests of the machine's one Slurm test cluster: one pytest process of their own, alongside
slurm_log=$scratch/slurm.log
# each pytest run keeps its temporary directories (tmp_path) in the scratch directory, which
# the exit trap removes (pytest's default, /tmp/pytest-of-$USER, outlives the run)
"$VPY" -m pytest -p no:cacheprovider -q --basetemp "$scratch/tmp-slurm" -m "slurm_cluster and not exclusive" "$@" \
  > "$slurm_log" 2>&1 &
slurm=$!
echo "== pytest ($WORKERS processes; the Slurm cluster's tests in one more)"
# --durations: the slowest tests of every run, where the suite's time goes
"$VPY" -m pytest -p no:cacheprovider -q --basetemp "$scratch/tmp-main" --durations=50 -n "$WORKERS" --dist worksteal \
  -m "not exclusive and not slurm_cluster and not ray_cluster" "$@"
rc=$(none_ok $? $#)
echo "== main pytest ended at $SECONDS s"
wait "$slurm"
slurm_rc=$(none_ok $? $#)
echo "== pytest (the Slurm cluster's tests)"
cat "$slurm_log"
echo "== pytest (tests that need the machine to themselves, one at a time: machine-wide state, the Ray cluster)"
"$VPY" -m pytest -p no:cacheprovider -q --basetemp "$scratch/tmp-exclusive" -m "exclusive or ray_cluster" "$@"
exclusive_rc=$(none_ok $? $#)
mpich_rc=0
if [ "$MPICH" != 0 ]; then
  # after the others: beside the main run, its timing-sensitive failure tests ran on a machine
  # loaded by four test processes (a fresh-clone run failed one), for no gain in wall time
  echo "== MPICH set starts at $SECONDS s"
  bash scripts/test-mpich.sh
  mpich_rc=$?
fi
wait "$checks"
checks_rc=$?
set -e
cat "$checks_log"
echo "== the whole run took $SECONDS s"
if [ "$rc" != 0 ] || [ "$slurm_rc" != 0 ] || [ "$exclusive_rc" != 0 ] || [ "$mpich_rc" != 0 ] \
   || [ "$checks_rc" != 0 ]; then
  echo "FAILED: main pytest (Open MPI) exit $rc, Slurm cluster tests exit $slurm_rc, exclusive tests" \
       "exit $exclusive_rc, mpi tests on MPICH exit $mpich_rc, ruff/mypy/docs exit $checks_rc" >&2
  exit 1
fi
