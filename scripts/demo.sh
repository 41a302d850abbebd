#!/usr/bin/env bash
# The main job: run the quickstart on 4 ranks of the default sockets backend through
# meshcomm launch. On a fresh checkout it first sets up .venv with only what that needs
# (the core and the sockets backend: numpy, pydantic, pluggy), saying what it does;
# scripts/test.sh (scripts/setup.sh) adds every other backend and the tools later.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$SECONDS
say() { echo "demo: $* ($((SECONDS - start)) s)"; }
if ! { [ -x .venv/bin/python ] && .venv/bin/python -c "import meshcomm, meshcomm_sockets" 2>/dev/null; }; then
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $($PY --version 2>&1)"
    "$PY" -m venv .venv
  fi
  say "installing the core and the sockets backend into .venv (numpy, pydantic, pluggy; under a minute)"
  PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install -q -e . -e plugins/sockets \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  say "installed"
fi
# which shared-memory loop this installation runs (compiled, or pure Python where it was
# built without a C compiler)
say "$(.venv/bin/meshcomm info | grep '^sockets' | sed 's/  */ /g')"
say "starting 4 ranks: .venv/bin/meshcomm launch -n 4 examples/quickstart.py"
exec .venv/bin/meshcomm launch -n 4 examples/quickstart.py
