"""The walls inside the core: every module of ``core/meshcomm`` belongs to one layer and
imports only from its own layer or the layers below it, counting every import
(tests/import_graph.py: in functions and under ``if TYPE_CHECKING:`` too), so the core
reads from the bottom up one layer at a time. docs/layout.md is the map in words.

The shipped plugins have their own wall: they import only :mod:`meshcomm.plugin`
(test_plugin_api.py).
"""

from __future__ import annotations

import pytest
from import_graph import ROOT, graph, imports, modules

#: bottom to top: layer -> where its modules live under ``core/meshcomm``, by dotted prefix:
#: the three lower layers have a folder each, the faces and the command are the top-level
#: modules, and the tools are the top-level packages
LAYERS: dict[str, tuple[str, ...]] = {
    # what a transport is and does: the Backend protocol, the generic algorithms over
    # send/recv, the operation table, dtypes, errors
    "protocol": ("protocol",),
    # the plugin runtime: hooks and registry, settings, placement, job secret, how a rank
    # ends, the launchers' protocols and rank variables, the size-1 built-in backend
    "runtime": ("runtime",),
    # what users call: groups, operations, init, handles, the one-thread guard, call checks,
    # the observer slot tools attach to
    "api": ("api",),
    # the two public faces: `meshcomm` for users, `meshcomm.plugin` for backend authors
    "faces": ("__init__", "plugin"),
    # tools built on the faces: launcher, tracer, benchmarks, conformance kit, layers, Ray groups
    "tools": ("launch", "trace", "bench", "testing", "nn", "ray"),
    # the `meshcomm` command
    "commands": ("cli", "__main__"),
}
ORDER = list(LAYERS)


def layer_of(module: str) -> str | None:
    """The layer of ``module`` (a dotted name under ``meshcomm``): its longest prefix in
    :data:`LAYERS`; None when no layer claims it."""
    rel = "__init__" if module == "meshcomm" else module.removeprefix("meshcomm.")
    best: tuple[int, str] | None = None
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (rel == prefix or rel.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), layer)
    return best[1] if best else None


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import of ``edges`` (module -> modules it imports) into a higher layer."""
    found = []
    for module, targets in sorted(edges.items()):
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if mine and theirs and ORDER.index(theirs) > ORDER.index(mine):
                found.append(f"{module} ({mine}) imports {target} ({theirs})")
    return found


def _core() -> dict[str, set[str]]:
    return {m: t for m, t in graph().items() if m == "meshcomm" or m.startswith("meshcomm.")}


def test_every_module_of_the_core_has_a_layer() -> None:
    homeless = sorted(m for m in _core() if layer_of(m) is None)
    assert not homeless, (
        f"modules in no layer: {homeless}; add each to LAYERS (tests/test_layers.py) and docs/layout.md"
    )


def test_no_layer_imports_a_layer_above_it() -> None:
    """Where a lower layer needs a higher one it is handed over: the tracer, for one, attaches
    through the hook meshcomm_world_started instead of being imported by init()."""
    up = upward(_core())
    assert not up, (
        f"imports that run up through the layers ({' < '.join(ORDER)}): {up}; move what the lower "
        "module needs down, or hand it over from above (a parameter, a Protocol, a hook)"
    )


@pytest.mark.parametrize(
    "source",
    [
        "from ..api.group import Group\n",  # at module level
        "def f():\n    from ..api import world\n    return world\n",  # hidden in a function
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..trace import recorder\n",  # for types
    ],
)
def test_an_upward_import_is_caught_wherever_it_hides(source: str) -> None:
    found = modules()
    backend = ROOT / "core" / "meshcomm" / "protocol" / "backend.py"
    edges = {"meshcomm.protocol.backend": imports("meshcomm.protocol.backend", backend, found, source=source)}
    assert len(upward(edges)) == 1 and upward(edges)[0].startswith("meshcomm.protocol.backend (protocol) imports "), (
        upward(edges)
    )
