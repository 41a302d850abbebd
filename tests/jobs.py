"""Running real jobs from tests (import as ``from jobs import launch``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "programs"


def launch(n: int, *args: str, backend: str = "sockets", timeout: float = 240, env: dict[str, str] | None = None,
           launch_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``meshcomm launch -n n --backend backend [launch_args] -- args`` and capture its output."""
    cmd = [sys.executable, "-m", "meshcomm", "launch", "-n", str(n), "--backend", backend, *launch_args, "--", *args]
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
