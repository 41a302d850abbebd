"""Arrays of other frameworks: torch tensors and MLX arrays go in, results of the caller's
framework come out (``mc.all_sum(tensor)`` is a tensor), on every backend, bfloat16
included; ``send`` returns what it was given; a torch ``out=`` is written in place.

The checks run in ``tests/programs/frameworks_rank.py`` on 2 real ranks per backend (and
alone, size 1); each rank prints how many checks held."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import meshcomm as mc
import pytest
from test_launch import TESTS, job_env, show
from test_launch_options import BACKENDS

PROG = TESTS / "programs" / "frameworks_rank.py"
# torch is imported by the test that uses it here (2 s: not in every collection of the suite)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_framework_arrays_keep_their_type_on_every_backend(backend: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "meshcomm", "launch", "-n", "2", "--backend", backend, "--timeout", "60", str(PROG)],
        capture_output=True,
        timeout=180,
        env=job_env(),
        cwd=TESTS.parent,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, show(p)
    counts = [int(c) for c in re.findall(rb"CHECKED (\d+)", p.stdout)]
    assert len(counts) == 2 and min(counts) >= 19, show(p)


def test_framework_arrays_on_a_size_one_world() -> None:
    p = subprocess.run(
        [sys.executable, str(PROG)],
        capture_output=True,
        timeout=120,
        env=job_env(),
        cwd=TESTS.parent,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0 and b"CHECKED" in p.stdout, show(p)


def test_tensors_meshcomm_cannot_move_are_refused_with_the_fix(fresh_registry) -> None:
    import torch

    with pytest.raises(ValueError, match=r"requires grad; pass x.detach\(\)"):
        mc.all_sum(torch.ones(3, requires_grad=True))
    if torch.cuda.is_available():  # pragma: no cover - CPU machines
        with pytest.raises(ValueError, match=r"cuda memory.*\.cpu\(\)"):
            mc.all_sum(torch.ones(3, device="cuda"))
    mx = pytest.importorskip("mlx.core")
    with pytest.raises(ValueError, match="immutable"):
        mc.all_sum(mx.ones(3), out=mx.zeros(3))
