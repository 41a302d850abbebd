#!/usr/bin/env bash
# The test command: set up everything (system packages when root, .venv, every plugin),
# then lint, type-check and run the whole test suite. Exits non-zero on any failure.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sockets).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && [ -f scripts/ci-system-deps.sh ]; then
  bash scripts/ci-system-deps.sh
fi
bash scripts/setup.sh
VPY=.venv/bin/python
echo "== ruff"
"$VPY" -m ruff check core plugins tests examples bench
echo "== mypy (core)"
"$VPY" -m mypy
echo "== pytest"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
set +e
"$VPY" -m pytest -p no:cacheprovider -q "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
