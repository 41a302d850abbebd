"""No module of the core or of a shipped plugin imports one that imports it back.

Every import counts: at module level, inside a function (where a cycle would only hide) and
under ``if TYPE_CHECKING:`` (a reader follows it all the same). Read from the source with
``ast``, nothing is imported. A package's ``__init__`` counts as a module only where it is
named itself (``import meshcomm``, ``from meshcomm import init``); ``from . import x`` of a
submodule ``x`` is an edge to ``x``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [ROOT / "core" / "meshcomm",
            *sorted(p for p in (ROOT / "plugins").glob("*/meshcomm_*") if (p / "__init__.py").exists())]


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the packages (``pkg`` for ``pkg/__init__.py``)."""
    found = {}
    for pkg in PACKAGES:
        for f in pkg.rglob("*.py"):
            parts = list(f.relative_to(pkg.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = f
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports, anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_walk_sees_the_packages_and_their_imports() -> None:
    graph = _graph()
    assert {"meshcomm.group", "meshcomm.observer", "meshcomm_sockets.backend", "meshcomm_mpi.backend",
            "meshcomm_gloo.backend"} <= set(graph)
    assert "meshcomm.observer" in graph["meshcomm.group"]  # `from . import observer as _observer`
    assert "meshcomm.plugin" in graph["meshcomm_sockets.backend"]


def test_a_cycle_is_found_wherever_its_import_hides() -> None:
    hidden = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(hidden) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", [p.name for p in PACKAGES])
def test_no_import_cycle(package: str) -> None:
    cycles = [c for c in _cycles(_graph()) if c[0].split(".")[0] == package]
    assert not cycles, (
        f"modules that import each other (at module level, in a function or for type checking): {cycles}; "
        "move what both need into a module below them, or hand it over (a parameter, a Protocol, a hook)"
    )
