"""``Linear`` and ``QuantizedLinear``: ``y = x @ W.T + b`` with MLX's shapes and initialisation."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from .module import Module
from .quantize import check_mode, dequantize, quantize

__all__ = ["Linear", "QuantizedLinear", "make_rng"]

Seed = np.random.Generator | int | None


def make_rng(rng: Seed) -> np.random.Generator:
    """A generator from a seed, a generator (used as is) or ``None`` (fresh entropy)."""
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _dims(input_dims: Any, output_dims: Any) -> tuple[int, int]:
    dims = []
    for name, value in (("input_dims", input_dims), ("output_dims", output_dims)):
        try:
            d = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
        if d <= 0:
            raise ValueError(f"{name} must be positive, got {d}")
        dims.append(d)
    return dims[0], dims[1]


def init_linear(input_dims: int, output_dims: int, bias: bool, rng: Seed) -> tuple[np.ndarray, np.ndarray | None]:
    """MLX's initialisation: weight and then bias drawn from ``U(-1/sqrt(in), 1/sqrt(in))``.

    The draw order is fixed so a sharded layer built from the same seed can take its
    slice of exactly the matrix an unsharded ``Linear`` would have.
    """
    input_dims, output_dims = _dims(input_dims, output_dims)
    gen = make_rng(rng)
    scale = math.sqrt(1.0 / input_dims)
    weight = gen.uniform(-scale, scale, (output_dims, input_dims)).astype(np.float32)
    b = gen.uniform(-scale, scale, (output_dims,)).astype(np.float32) if bias else None
    return weight, b


def affine(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``x @ weight.T + bias`` over the last axis of ``x``."""
    y = x @ weight.T
    return y + bias if bias is not None else y


def affine_backward(
    x: np.ndarray,
    weight: np.ndarray,
    grad_output: np.ndarray,
    *,
    with_weight: bool = True,
    with_bias: bool = True,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Input gradient and ``{"weight", "bias"}`` gradients of :func:`affine`."""
    g = np.asarray(grad_output)
    g2 = g.reshape(-1, g.shape[-1])
    grads: dict[str, np.ndarray] = {}
    if with_weight:
        grads["weight"] = (g2.T @ x.reshape(-1, x.shape[-1])).astype(weight.dtype, copy=False)
    if with_bias:
        grads["bias"] = g2.sum(axis=0).astype(weight.dtype, copy=False)
    grad_input = (g2 @ weight).reshape(*g.shape[:-1], weight.shape[1])
    return grad_input, grads


class Cached(Module):
    """Keeps the input of the last forward pass for ``backward``."""

    _x: np.ndarray | None = None

    def _remember(self, x: Any) -> np.ndarray:
        a = np.asarray(x)
        self._x = a
        return a

    def _input(self) -> np.ndarray:
        if self._x is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before a forward pass")
        return self._x

    def _affine_vjp(self, weight: np.ndarray, grad_output: np.ndarray, *, train_weight: bool = True) -> np.ndarray:
        """This layer's local backward of ``affine(x, weight, self.bias)``: stores the parameter
        gradients in ``self.grads`` (the weight's only when ``train_weight``) and returns the
        input gradient."""
        grad_input, self.grads = affine_backward(
            self._input(),
            weight,
            grad_output,
            with_weight=train_weight,
            with_bias=getattr(self, "bias", None) is not None,
        )
        return grad_input


class Linear(Cached):
    """Applies ``y = x @ weight.T + bias``.

    ``weight`` has shape ``(output_dims, input_dims)`` and ``bias`` ``(output_dims,)``;
    both start uniform in ``[-1/sqrt(input_dims), 1/sqrt(input_dims)]`` as in MLX.

    Args:
        input_dims (int): features of the input.
        output_dims (int): features of the output.
        bias (bool): whether to add a bias. Default: ``True``.
        rng (Generator | int | None): seed or generator for the initial values; pass
            the same seed on every rank to get the same model. Default: ``None``.
    """

    _parameters = ("weight", "bias")
    _trainable = ("weight", "bias")

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True, *, rng: Seed = None) -> None:
        super().__init__()
        self.weight, self.bias = init_linear(input_dims, output_dims, bias, rng)

    @property
    def input_dims(self) -> int:
        return int(self.weight.shape[1])

    @property
    def output_dims(self) -> int:
        return int(self.weight.shape[0])

    def _extra_repr(self) -> str:
        return f"input_dims={self.input_dims}, output_dims={self.output_dims}, bias={self.bias is not None}"

    def __call__(self, x: Any) -> np.ndarray:
        return affine(self._remember(x), self.weight, self.bias)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return self._affine_vjp(self.weight, grad_output)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> QuantizedLinear:
        """A :class:`QuantizedLinear` with this layer's weight quantized and its bias copied."""
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class QuantizedLinear(Cached):
    """``Linear`` with the weight stored quantized (see :func:`meshcomm.nn.quantize`).

    ``weight`` is ``uint32`` of shape ``(output_dims, input_dims * bits / 32)``;
    ``scales`` and ``biases`` are ``(output_dims, input_dims / group_size)``. As in MLX,
    only ``bias`` is trainable (and starts at zero): ``backward`` returns the input
    gradient through the dequantized weight and stores ``grads = {"bias": ...}``.

    Args:
        input_dims (int): features of the input.
        output_dims (int): features of the output.
        bias (bool): whether to add a bias. Default: ``True``.
        group_size (int): weights sharing a scale and bias. Default: ``64``.
        bits (int): bits per weight. Default: ``4``.
        mode (str): only ``"affine"``. Default: ``"affine"``.
        rng (Generator | int | None): seed or generator for the initial weight. Default: ``None``.
    """

    _parameters = ("weight", "scales", "biases", "bias")
    _trainable = ("bias",)

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        bias: bool = True,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
        *,
        rng: Seed = None,
    ) -> None:
        super().__init__()
        check_mode(mode)
        weight, _ = init_linear(input_dims, output_dims, False, rng)
        self.group_size = group_size
        self.bits = bits
        self.weight, self.scales, self.biases = quantize(weight, group_size, bits)
        self.bias = np.zeros((output_dims,), np.float32) if bias else None

    @property
    def input_dims(self) -> int:
        return int(self.weight.shape[1]) * 32 // self.bits

    @property
    def output_dims(self) -> int:
        return int(self.weight.shape[0])

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"bias={self.bias is not None}, group_size={self.group_size}, bits={self.bits}"
        )

    def dequantized_weight(self) -> np.ndarray:
        """The weight as floats, ``(output_dims, input_dims)``."""
        return dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)

    def __call__(self, x: Any) -> np.ndarray:
        return affine(self._remember(x), self.dequantized_weight(), self.bias)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return self._affine_vjp(self.dequantized_weight(), grad_output, train_weight=False)

    @classmethod
    def from_linear(cls, linear: Linear, group_size: int = 64, bits: int = 4, mode: str = "affine") -> QuantizedLinear:
        """Quantize ``linear``'s weight and copy its bias."""
        check_mode(mode)
        ql = cls.__new__(cls)
        Module.__init__(ql)
        ql.group_size, ql.bits = group_size, bits
        ql.weight, ql.scales, ql.biases = quantize(linear.weight, group_size, bits)
        ql.bias = None if linear.bias is None else np.array(linear.bias, copy=True)
        return ql
