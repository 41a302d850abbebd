"""The conformance kit (``meshcomm.testing`` as a pytest plugin) as a backend author runs it:
``pytest --pyargs meshcomm.testing --meshcomm-backend NAME``.

It passes on every shipped backend and on the example third-party one (uds), and it fails —
naming the checks and the ranks — on a backend whose all_sum is wrong (tests/plugins/
meshcomm-wrongsum). The third-party plugins are installed with pip into a directory of their
own on PYTHONPATH (entry points are found there too), so the shared environment is untouched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import ROOT

PLUGINS = ROOT / "tests" / "plugins"
NCHECKS = 11


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    target = tmp_path_factory.mktemp("site")
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
            str(PLUGINS / "meshcomm-wrongsum"),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    yield target


def _env(plugin_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "MESHCOMM_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _installed(plugin_path: Path) -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "meshcomm", "info", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=_env(plugin_path),
        timeout=120,
    )
    return {i["name"]: i for i in json.loads(out.stdout)}


def run_kit(plugin_path: Path, backend: str, ranks: str | None, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        "meshcomm.testing",
        "--meshcomm-backend",
        backend,
        "--meshcomm-timeout",
        "60",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
    ]
    if ranks is not None:
        cmd += ["--meshcomm-ranks", ranks]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(plugin_path), cwd=tmp_path, timeout=600)


def _counts(out: str) -> dict[str, int]:
    last = out.strip().splitlines()[-1]
    return {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}


@pytest.mark.parametrize("backend,ranks", [("sockets", None), ("uds", "1,3"), ("mpi", "2"), ("gloo", "2")])
def test_kit_passes_on_a_correct_backend(plugin_path: Path, tmp_path: Path, backend: str, ranks: str | None) -> None:
    info = _installed(plugin_path).get(backend)
    if info is None:
        pytest.skip(f"backend {backend!r} is not installed (meshcomm info does not list it)")
    if not info["available"]:
        pytest.skip(f"backend {backend!r} is installed but unusable here: {info['reason']}")
    p = run_kit(plugin_path, backend, ranks, tmp_path)
    nranks = len((ranks or "1,2,4").split(","))
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    # test_survivors passes where survivors agree and shrink (sockets, gloo, mpi on Open MPI's
    # fault tolerance); the others say they cannot: skipped
    offered = backend in ("sockets", "gloo") or (backend == "mpi" and _mpi_library().startswith("Open MPI"))
    want = {"passed": nranks * (NCHECKS + 1) + offered, **({} if offered else {"skipped": 1})}
    assert _counts(p.stdout) == want, p.stdout[-3000:]


def _mpi_library() -> str:
    """The MPI library mpi4py loads in this interpreter (without initialising MPI)."""
    from meshcomm_mpi.discover import find_library

    return str(find_library().version)


def test_kit_fails_on_a_wrong_backend_naming_checks_and_ranks(plugin_path: Path, tmp_path: Path) -> None:
    p = run_kit(plugin_path, "wrongsum", "2", tmp_path)
    assert p.returncode == 1, p.stdout[-6000:] + p.stderr[-3000:]
    counts = _counts(p.stdout)
    assert counts.get("failed", 0) >= 3 and counts.get("passed", 0) >= 3, counts
    failed = set(re.findall(r"^FAILED \S+::test_(\w+\[[^\]]+\])", p.stdout, re.M))
    assert {"contract[2-check_reductions]", "contract[2-check_large_and_noncontiguous]", "job[2]"} <= failed, failed
    assert "contract[2-check_all_gather]" not in failed and "contract[2-check_identity]" not in failed, failed
    # the item's message names the check, the ranks and what differed
    assert "check_reductions on 2 ranks of wrongsum" in p.stdout
    assert re.search(r"rank 1: rank 1: all_sum\(\w+, shape=\S*\) differs from NumPy", p.stdout), p.stdout[-4000:]


def test_kit_without_a_backend_skips_with_the_reason(plugin_path: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "meshcomm.testing", "-p", "no:cacheprovider", "-q", "-rs"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(plugin_path), cwd=tmp_path, timeout=300)
    assert p.returncode == 0 and "pass --meshcomm-backend NAME" in p.stdout, p.stdout[-3000:]
