#!/usr/bin/env bash
# The main job: set up .venv with every backend, then run the quickstart on 4 ranks of the
# default sockets backend through meshcomm launch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/meshcomm launch -n 4 examples/quickstart.py
