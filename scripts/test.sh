#!/usr/bin/env bash
# The test command: set up everything (system packages when root, .venv, every plugin,
# .venv-mpich), then lint, type-check and run the whole test suite (the mpi backend on
# Open MPI), then the mpi backend's test set again on MPICH (scripts/test-mpich.sh).
# Exits non-zero on any failure in either run.
# Extra arguments go to the main pytest (e.g. scripts/test.sh -k sockets);
# MESHCOMM_TEST_MPICH=0 skips the MPICH venv and run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && [ -f scripts/ci-system-deps.sh ]; then
  bash scripts/ci-system-deps.sh
fi
bash scripts/setup.sh
MPICH=${MESHCOMM_TEST_MPICH:-1}
if [ "$MPICH" != 0 ]; then
  bash scripts/setup-mpich.sh
fi
VPY=.venv/bin/python
echo "== ruff"
"$VPY" -m ruff check core plugins tests examples bench
echo "== mypy (core)"
"$VPY" -m mypy
echo "== docs site (mkdocs build --strict: any warning, e.g. a broken link, fails the run)"
site=$(mktemp -d)
# no --quiet: with it mkdocs drops the warnings before strict mode counts them, and passes
if ! "$VPY" -m mkdocs build --strict --site-dir "$site/html" > "$site/log" 2>&1; then
  grep -v "^INFO" "$site/log" >&2
  rm -rf "$site"
  echo "FAILED: the docs site (mkdocs build --strict)" >&2
  exit 1
fi
rm -rf "$site"
echo "== pytest"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
set +e
# --durations: the slowest tests of every run, where the suite's time goes
"$VPY" -m pytest -p no:cacheprovider -q --durations=25 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  rc=1
fi
mpich_rc=0
if [ "$MPICH" != 0 ]; then
  set +e
  bash scripts/test-mpich.sh
  mpich_rc=$?
  set -e
fi
if [ "$rc" != 0 ] || [ "$mpich_rc" != 0 ]; then
  echo "FAILED: main pytest (Open MPI) exit $rc, mpi tests on MPICH exit $mpich_rc" >&2
  [ "$rc" != 0 ] && exit "$rc"
  exit "$mpich_rc"
fi
