#!/usr/bin/env bash
# Builds the four distributions (meshcomm, meshcomm-sockets, meshcomm-mpi, meshcomm-gloo) as
# wheels and sdists into DIR (default dist/), exactly what would be uploaded to a package
# index. Install from there as a user of an index would:
#   pip install --find-links dist "meshcomm[sockets]"
# Needs hatchling (in .venv after scripts/setup.sh); PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-dist}
case "$OUT" in /*) ;; *) OUT="$ROOT/$OUT" ;; esac
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$OUT"
for d in . plugins/sockets plugins/mpi plugins/gloo; do
  if ! log=$(cd "$d" && "$PY" -m hatchling build -d "$OUT" 2>&1); then
    echo "build-dists: building $d failed:" >&2
    echo "$log" >&2
    exit 1
  fi
done
ls "$OUT"
