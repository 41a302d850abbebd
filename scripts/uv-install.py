"""Install packages into a venv with uv, from the same sources pip is configured with.

uv installs what pip would in a fraction of the time (this project's .venv: ~7 s against pip's
~90 s; torch alone ~3 s against ~28 s), but it reads no pip configuration. This passes pip's
index, extra indexes, find-links, constraints, trusted hosts and CA bundle (as `pip config list`
reports them, environment variables included) to uv, and lets uv choose among the indexes as pip
does: the best version across all of them, not the first index that has the name.

usage: VENV/bin/python scripts/uv-install.py --python TARGET/bin/python [uv pip install args...]
The running Python gets uv (:data:`UV_VERSION`, by pip) first if it has another or none.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import subprocess
import sys

#: the uv every set-up installs with (scripts/setup.sh, setup-mpich.sh, tests/test_packaging.py)
UV_VERSION = "0.13.9"
#: what pip says of a find-links or index path without the package (this machine's extra
#: indexes lack most names): noise, not a problem
_PIP_NOISE = "is ignored: it is neither a file nor a directory"

# pip's settings that say where packages come from, and uv's flag for each
_LIST_FLAGS = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
# later sources override earlier ones: a config file's [global], its [install], the environment
_PRECEDENCE = ("global", "install", ":env:")


def pip_settings() -> dict[str, str]:
    """pip's effective configuration for `pip install`, as key -> value."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True, text=True
    ).stdout
    found: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if sep and section in _PRECEDENCE:
            found.setdefault(key, {})[section] = str(ast.literal_eval(value))
    return {key: next(by[s] for s in reversed(_PRECEDENCE) if s in by) for key, by in found.items()}


def uv_arguments(settings: dict[str, str]) -> list[str]:
    """uv pip install flags that name the same package sources as pip's `settings`."""
    args = ["--index-strategy", "unsafe-best-match"]  # pip's rule: best match across all indexes
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if "index-url" in settings:
        args += ["--index-url", settings["index-url"]]
    for key, flag in _LIST_FLAGS.items():
        for item in settings.get(key, "").split():
            args += [flag, item]
    return args


def ensure_uv() -> None:
    """Install uv :data:`UV_VERSION` into the running Python unless it has exactly that one."""
    try:
        if md.version("uv") == UV_VERSION:
            return
    except md.PackageNotFoundError:
        pass
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"], capture_output=True, text=True
    )
    sys.stderr.write("".join(ln for ln in res.stderr.splitlines(keepends=True) if _PIP_NOISE not in ln))
    if res.returncode != 0:
        raise SystemExit(f"uv-install: pip could not install uv=={UV_VERSION} (exit {res.returncode})")


def main(argv: list[str]) -> int:
    ensure_uv()
    from uv import find_uv_bin

    settings = pip_settings()
    env = dict(os.environ)
    if "cert" in settings:
        env.setdefault("SSL_CERT_FILE", settings["cert"])
    cmd = [find_uv_bin(), "pip", "install", "--quiet", *uv_arguments(settings), *argv]
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
