"""``Module``: the small base every layer shares, and helpers for parameter trees.

A module is called on a NumPy array (``y = layer(x)``), keeps what its backward pass
needs, and ``layer.backward(dy)`` returns ``dx`` and stores the parameter gradients in
``layer.grads``. Parameters are plain, settable NumPy attributes; ``parameters()`` and
``grads`` are nested dicts (and lists, for containers) in MLX's tree layout, so
``average_gradients`` and optimisers can walk them without knowing the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Module", "tree_flatten", "tree_map"]

Tree = Any


class Module:
    """Base of the layers: forward through ``__call__``, vector-Jacobian product in ``backward``.

    Subclasses list their parameter attributes in ``_parameters`` and the trainable
    ones in ``_trainable`` (quantized layers train only their bias).
    """

    _parameters: tuple[str, ...] = ()
    _trainable: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.grads: dict[str, Any] = {}

    def __call__(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """Gradient of the loss with respect to the last input, given the output gradient."""
        raise NotImplementedError

    def parameters(self) -> dict[str, Any]:
        """Every parameter (trainable or not) by name; absent ones (``bias=False``) are left out."""
        return {k: getattr(self, k) for k in self._parameters if getattr(self, k, None) is not None}

    def trainable_parameters(self) -> dict[str, Any]:
        """The parameters ``backward`` computes gradients for; ``grads`` has the same keys."""
        return {k: getattr(self, k) for k in self._trainable if getattr(self, k, None) is not None}

    def update(self, parameters: dict[str, Any]) -> Module:
        """Set parameters from a (possibly partial) tree like ``parameters()``; returns self."""
        for k, v in parameters.items():
            if k not in self._parameters:
                raise ValueError(f"{type(self).__name__} has no parameter {k!r}; it has {self._parameters}")
            setattr(self, k, v)
        return self

    def _extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._extra_repr()})"


def tree_flatten(tree: Tree, prefix: str = "") -> list[tuple[str, Any]]:
    """``[(dotted.path, leaf), ...]`` of a tree of dicts and lists, in a stable order."""
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in tree_flatten(v, f"{prefix}{k}.")]
    if isinstance(tree, (list, tuple)):
        return [kv for i, v in enumerate(tree) for kv in tree_flatten(v, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """Apply ``fn`` to the leaves of ``tree`` (and the matching leaves of ``rest``)."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, v, *(r[i] for r in rest)) for i, v in enumerate(tree))
    return fn(tree, *rest)
