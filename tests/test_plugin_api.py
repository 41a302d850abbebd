"""The stated plugin API: backends import meshcomm only through ``meshcomm.plugin`` and the
public ``meshcomm`` package, so everything else in the core stays private (issue 18)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import meshcomm
import meshcomm.plugin as api
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: every plugin package the project ships or uses as an example
PLUGIN_SOURCES = sorted(
    [p for p in (ROOT / "plugins").glob("*/meshcomm_*/**/*.py")]
    + [p for p in (ROOT / "tests" / "plugins").glob("*/meshcomm_*/**/*.py")]
)


def private_imports(path: Path) -> list[str]:
    """``line: statement`` for every import of a meshcomm module other than the public ones."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("meshcomm.") and alias.name != "meshcomm.plugin":
                    bad.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("meshcomm.") and node.module != "meshcomm.plugin":
                bad.append(f"{node.lineno}: from {node.module} import ...")
            elif node.module == "meshcomm":
                for alias in node.names:
                    if alias.name not in meshcomm.__all__:  # e.g. a submodule such as algorithms
                        bad.append(f"{node.lineno}: from meshcomm import {alias.name}")
    return bad


def test_there_are_plugin_sources() -> None:
    packages = {next(part for part in p.parts if part.startswith("meshcomm_")) for p in PLUGIN_SOURCES}
    assert {"meshcomm_sockets", "meshcomm_mpi", "meshcomm_gloo", "meshcomm_uds"} <= packages


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_only_the_plugin_api(path: Path) -> None:
    bad = private_imports(path)
    assert not bad, (
        f"{path.relative_to(ROOT)} imports private meshcomm modules: {bad}. Import the name from "
        "meshcomm.plugin (add it there, to __all__, if a backend really needs it)"
    )


def test_the_checker_catches_private_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "import meshcomm\nfrom meshcomm import all_sum, algorithms\nfrom meshcomm.plugin import Backend\n"
        "def f():\n    from meshcomm.runtime.registry import get_registry\n    import meshcomm.protocol.dtypes\n"
    )
    assert [b.split(":")[0] for b in private_imports(f)] == ["2", "5", "6"]


@pytest.mark.parametrize("face", [api, meshcomm], ids=lambda m: m.__name__)
def test_every_exported_name_exists(face) -> None:
    """Both faces import their names on first use: each name of ``__all__`` must resolve."""
    missing = [name for name in face.__all__ if not hasattr(face, name)]
    assert not missing and len(set(face.__all__)) == len(face.__all__)


def test_the_plugin_api_loads_no_plugin_and_no_launcher() -> None:
    code = (
        "import sys, meshcomm.plugin; "
        "print(sorted(m for m in sys.modules if m.startswith(('meshcomm_', 'meshcomm.launch.run', "
        "'meshcomm.launch.starters', 'torch', 'mpi4py'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_register_checks_the_launcher_type() -> None:
    from meshcomm.runtime.registry import Registry

    reg = Registry()

    class NoLauncher:
        def start(self) -> None: ...

    with pytest.raises(TypeError, match="rank_env"):
        api.BackendRegistrar(reg)("x", factory=lambda c, s: None, launcher=NoLauncher())  # type: ignore[arg-type, return-value]


def test_job_secret_settings_and_check_are_shared(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from meshcomm_gloo.settings import GlooSettings
    from meshcomm_sockets.plugin import SocketsSettings

    for model in (SocketsSettings, GlooSettings):  # one definition of the two variables
        assert issubclass(model, api.JobSecretSettings)
        s = api.load_settings(model, environ={"MESHCOMM_JOB_SECRET": "k", "MESHCOMM_REQUIRE_SECRET": "1"})
        assert (s.secret, s.require_secret) == ("k", True)
    log = logging.getLogger("meshcomm.test-secret")
    required = api.JobSecretSettings(require_secret=True)
    with pytest.raises(api.ConfigError, match="demo backend, rank 1: MESHCOMM_REQUIRE_SECRET is set"):
        api.check_job_secret(required, who="demo backend", rank=1, size=1, warning="w", log=log)
    none = api.JobSecretSettings()
    with caplog.at_level(logging.WARNING, logger="meshcomm.test-secret"):
        for rank in (0, 1, 0):
            api.check_job_secret(none, who="demo", rank=rank, size=2, warning="no secret (test)", log=log)
        api.check_job_secret(none, who="demo", rank=0, size=1, warning="alone (test)", log=log)
    assert [r.getMessage() for r in caplog.records] == ["no secret (test)"]
