"""The import graph of the core and of the shipped plugins, read from the source with ``ast``
(nothing is imported): every import counts, at module level, inside a function and under
``if TYPE_CHECKING:``. A package's ``__init__`` counts as a module only where it is named
itself (``import meshcomm``, ``from meshcomm import init``); ``from . import x`` of a
submodule ``x`` is an edge to ``x``. Used by test_import_cycles.py and test_layers.py."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [
    ROOT / "core" / "meshcomm",
    *sorted(p for p in (ROOT / "plugins").glob("*/meshcomm_*") if (p / "__init__.py").exists()),
]


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the packages (``pkg`` for ``pkg/__init__.py``)."""
    found = {}
    for pkg in PACKAGES:
        for f in pkg.rglob("*.py"):
            parts = list(f.relative_to(pkg.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = f
    return found


def imports(name: str, path: Path, modules: dict[str, Path], source: str | None = None) -> set[str]:
    """The modules of ``modules`` that ``name`` imports, anywhere in its file (or in ``source``)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # `from pkg import sub` names the submodule, else the package
                sub = f"{target}.{a.name}"
                out.add(sub if sub in modules else target)
    return {m for m in out if m in modules and m != name}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports."""
    found = modules()
    return {name: imports(name, path, found) for name, path in found.items()}
