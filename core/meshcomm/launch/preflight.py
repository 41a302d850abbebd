"""Check a launch before any rank starts: the program can be found, and every setting the
ranks will be given is one they accept.

Without this, a typo (``--timeout -5``, ``MLX_TIMEOUT=abc``, ``prog.pyy``) surfaced as the
same traceback from every rank once they had started; here it is one line, at once.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..protocol.errors import ConfigError
from ..runtime.config import MAX_TIMEOUT, Config, load_settings
from ..runtime.registry import BackendSpec

__all__ = ["check_timeout", "check_program", "check_settings"]


def check_timeout(timeout: float | None) -> None:
    """``--timeout`` must be a finite number of seconds in (0, MAX_TIMEOUT]."""
    if timeout is None:
        return
    if not (0 < timeout <= MAX_TIMEOUT):  # False for NaN too
        raise ConfigError(f"--timeout {timeout:g}: must be a number of seconds > 0 and <= {MAX_TIMEOUT}")


def check_program(argv: Sequence[str], workdir: str) -> None:
    """The program the ranks run exists here: a ``.py`` file (alone or after ``python``)
    relative to the ranks' working directory, or a command on PATH. Called only when every
    rank runs on this machine (another host may have files this one does not)."""
    if not argv or argv[0] in ("-m", "-c"):
        return
    script = argv[0]
    if not script.endswith(".py"):
        exe = shutil.which(script, path=os.environ.get("PATH")) if os.sep not in script else script
        if exe is None or not os.access(Path(workdir, exe), os.X_OK):
            raise ConfigError(
                f"program {script!r} was not found on PATH (or is not executable): check its name, or give its path"
            )
        if Path(exe).name.startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
            script = argv[1]  # meshcomm launch -n N -- python prog.py
        else:
            return
    path = Path(workdir, script)
    if not path.is_file():
        raise ConfigError(
            f"program file {script!r} does not exist in {workdir}: check the path "
            "(relative paths are taken from the ranks' working directory, --cwd)"
        )


def check_settings(spec: BackendSpec, rank_env: Mapping[str, str], world_size: int, *, inherit: bool = True) -> None:
    """Validate the core's and the backend's settings as a rank will read them: what the
    launcher gives every rank, over this environment when the ranks inherit it (``inherit``:
    every rank on this machine). Raises ConfigError naming the variable, its value and what
    it accepts."""
    environ = {
        **(os.environ if inherit else {}),
        **rank_env,
        "MLX_BACKEND": spec.name,
        "MLX_RANK": "0",
        "MLX_WORLD_SIZE": str(world_size),
    }
    try:
        Config.load(environ)
        if spec.settings is not None:
            load_settings(spec.settings, None, environ)
    except ConfigError as exc:
        raise ConfigError(f"the ranks would reject their settings: {exc}") from None
