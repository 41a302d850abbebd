#!/usr/bin/env bash
# Creates .venv-mpich: the mpi backend on MPICH (the family behind Cray MPI, Intel MPI and
# MVAPICH), next to .venv which runs it on Open MPI. The two MPI wheels cannot share a venv:
# mpi4py loads whichever libmpi it finds in the environment at run time.
#
# Contents: the core and the mpi plugin (editable, so the tests run the working tree) with
# the `mpich` wheel through the plugin's `mpich` extra, mpi4py (its PyPI wheel is built
# against the MPI ABI and opens the MPICH library at run time, no compiler involved), and
# the test tools the mpi tests need. No torch, gloo or sockets: small and quick to build.
#
# Safe to run again: when the venv already holds what the current pyproject files ask
# for (a stamp of their hash and this script's), it only checks that mpi4py loads MPICH;
# nothing is installed or downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-mpich
VPY=$VENV/bin/python
STAMP=$VENV/.meshcomm-setup-stamp
export PIP_DISABLE_PIP_VERSION_CHECK=1

# the core's compiled call path and the mpi plugin's compiled small all_sum are built at
# install: their C sources are in the stamp
want=$(cat scripts/setup-mpich.sh scripts/uv-install.py pyproject.toml setup.py core/meshcomm/api/_callpath.c \
  plugins/mpi/pyproject.toml plugins/mpi/setup.py plugins/mpi/meshcomm_mpi/_planned.c | sha256sum | cut -d' ' -f1)
if [ ! -x "$VPY" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  [ -x "$VPY" ] || "$PY" -m venv "$VENV"
  echo "*" > "$VENV/.gitignore"  # git ignores the whole venv (as Python >= 3.13's venv does)
  # with uv, as scripts/setup.sh installs
  "$VPY" scripts/uv-install.py --python "$VPY" -e . -e "plugins/mpi[mpich]" \
    "pytest>=7" "pytest-timeout>=2" "pytest-xdist>=3.5" "hatchling>=1.21" "ml_dtypes>=0.3,<0.7"
  echo "$want" > "$STAMP"
fi

# mpi4py must open MPICH here, never an Open MPI found elsewhere (a wrong library would
# make every test below silently test Open MPI twice).
if ! version=$("$VPY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>&1) \
   || [[ "$version" != MPICH* ]]; then
  echo "setup-mpich: mpi4py in $VENV does not load MPICH: $version" >&2
  echo "  fix: rm -rf $VENV && bash scripts/setup-mpich.sh" >&2
  exit 1
fi
