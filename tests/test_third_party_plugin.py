"""A backend published as its own distribution is discovered, listed and selected without
any change to meshcomm; a plugin that fails to import is listed and harms nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from jobs import ROOT, launch

PLUGINS = ROOT / "tests" / "plugins"


@pytest.fixture(scope="module")
def third_party(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a machine with meshcomm-uds and meshcomm-broken installed: both are
    installed into a directory of their own on PYTHONPATH, so tests that run at the same time
    in other processes never see them (and nothing is left in the venv)."""
    target = tmp_path_factory.mktemp("third-party")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "-q",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(PLUGINS / "meshcomm-uds"),
            str(PLUGINS / "meshcomm-broken"),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {"PYTHONPATH": os.pathsep.join([str(target), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _info(third_party: dict[str, str], env: dict[str, str] | None = None) -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "meshcomm", "info", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **third_party, **(env or {})},
        timeout=120,
    )
    return {i["name"]: i for i in json.loads(out.stdout)}


def test_info_lists_the_installed_plugin_and_the_broken_one(third_party):
    infos = _info(third_party)
    assert infos["uds"]["available"] is True
    assert infos["uds"]["distribution"] == "meshcomm-uds" and infos["uds"]["version"] == "0.3.0"
    assert infos["broken"]["available"] is False
    assert "libbroken.so.1" in infos["broken"]["reason"]
    assert infos["sockets"]["available"] is True, "a broken plugin must not affect the others"


def test_info_table_shows_the_reason(third_party):
    out = subprocess.run(
        [sys.executable, "-m", "meshcomm", "info"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **third_party},
    )
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("broken"))
    assert "plugin failed to load" in line and "libbroken" in line


def test_plugins_can_be_allow_listed_or_disabled(third_party):
    assert "uds" not in _info(third_party, {"MESHCOMM_DISABLE_PLUGINS": "uds"})
    only = _info(third_party, {"MESHCOMM_PLUGINS": "sockets"})
    assert set(only) == {"sockets", "single"}


@pytest.mark.parametrize("n", [1, 3, 5])
def test_selected_by_name_through_the_launcher_and_passes_the_contract(third_party, n):
    res = launch(n, "-m", "meshcomm.testing.contract", "--more", backend="uds", timeout=400, env=third_party)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("on uds: 20 passed, 0 failed") == n, res.stdout


def test_selected_by_any_when_its_environment_is_present(third_party, tmp_path):
    prog = tmp_path / "which.py"
    prog.write_text("import meshcomm as mc\ng = mc.init(strict=True)\nprint('backend', g.backend, g.size())\n")
    res = launch(2, str(prog), backend="uds", launch_args=("--env", "MLX_BACKEND=any"), env=third_party)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("backend uds 2") == 2, res.stdout


def test_named_but_unconfigured_plugin_raises_when_strict(third_party):
    code = "import meshcomm as mc\nmc.init(strict=True, backend='uds')"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "MESHCOMM_UDS"))}, **third_party}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode != 0
    assert "needs MESHCOMM_UDS_DIR, MLX_WORLD_SIZE and MLX_RANK" in res.stderr
