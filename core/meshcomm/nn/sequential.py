"""``Sequential`` and ``ReLU``: enough to build, run and train an MLP."""

from __future__ import annotations

from typing import Any

import numpy as np

from .module import Module

__all__ = ["Sequential", "ReLU"]


class ReLU(Module):
    """``max(x, 0)`` element-wise; it has no parameters."""

    _mask: np.ndarray | None = None

    def __call__(self, x: Any) -> np.ndarray:
        a = np.asarray(x)
        self._mask = a > 0
        return np.where(self._mask, a, np.zeros((), a.dtype))

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        if self._mask is None:
            raise RuntimeError("ReLU.backward called before a forward pass")
        g = np.asarray(grad_output)
        return np.where(self._mask, g, np.zeros((), g.dtype))


class Sequential(Module):
    """Calls ``layers`` in order; ``backward`` runs them in reverse.

    ``parameters()``, ``trainable_parameters()`` and ``grads`` are
    ``{"layers": [tree of layer 0, tree of layer 1, ...]}`` (MLX's layout), with ``{}``
    for layers without parameters. Replace ``model.layers[i]`` to swap a layer.
    """

    def __init__(self, *layers: Module) -> None:
        super().__init__()
        self.layers: list[Module] = list(layers)

    def _extra_repr(self) -> str:
        inner = "".join(f"\n  ({i}): {layer!r}" for i, layer in enumerate(self.layers))
        return inner + ("\n" if inner else "")

    def __call__(self, x: Any) -> np.ndarray:
        y = np.asarray(x)
        for layer in self.layers:
            y = layer(y)
        return y

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        g = grad_output
        for layer in reversed(self.layers):
            g = layer.backward(g)
        self.grads = {"layers": [layer.grads for layer in self.layers]}
        return g

    def parameters(self) -> dict[str, Any]:
        return {"layers": [layer.parameters() for layer in self.layers]}

    def trainable_parameters(self) -> dict[str, Any]:
        return {"layers": [layer.trainable_parameters() for layer in self.layers]}

    def update(self, parameters: dict[str, Any]) -> Sequential:
        trees = parameters.get("layers", [])
        if len(trees) != len(self.layers):
            raise ValueError(f"got parameters for {len(trees)} layers, the model has {len(self.layers)}")
        for layer, tree in zip(self.layers, trees, strict=True):
            layer.update(tree)
        return self
