"""No module of the core or of a shipped plugin imports one that imports it back.

Every import counts (tests/import_graph.py): at module level, inside a function (where a
cycle would only hide) and under ``if TYPE_CHECKING:`` (a reader follows it all the same).
"""

from __future__ import annotations

import pytest
from import_graph import PACKAGES, graph


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


def test_the_walk_sees_the_packages_and_their_imports() -> None:
    edges = graph()
    assert {
        "meshcomm.api.group",
        "meshcomm.api.observer",
        "meshcomm_sockets.backend",
        "meshcomm_mpi.backend",
        "meshcomm_gloo.backend",
    } <= set(edges)
    assert "meshcomm.api.observer" in edges["meshcomm.api.group"]  # `from . import observer as _observer`
    assert "meshcomm.plugin" in edges["meshcomm_sockets.backend"]


def test_a_cycle_is_found_wherever_its_import_hides() -> None:
    hidden = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(hidden) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", [p.name for p in PACKAGES])
def test_no_import_cycle(package: str) -> None:
    cycles = [c for c in _cycles(graph()) if c[0].split(".")[0] == package]
    assert not cycles, (
        f"modules that import each other (at module level, in a function or for type checking): {cycles}; "
        "move what both need into a module below them, or hand it over (a parameter, a Protocol, a hook)"
    )
