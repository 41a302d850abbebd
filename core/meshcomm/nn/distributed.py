"""Tensor-parallel linear layers (Megatron style) with MLX's names, arguments and shapes.

``AllToShardedLinear`` takes the full input and produces this rank's slice of the
output features; ``ShardedToAllLinear`` takes a slice of the input features and
all-sums the partial products so every rank gets the full output. Chained
(all-to-sharded, element-wise ops, sharded-to-all) they run an MLP with one all_sum
forward and one backward, wherever the group lives.

Communication in ``backward`` mirrors the forward: the input gradient of an
all-to-sharded layer is all-summed (every rank's slice contributed to the loss), the
sharded-to-all layer's is already local. Built from the same seed on every rank, a
layer holds exactly its slice of the ``Linear`` that seed would make, so sharded and
unsharded models can be compared directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..api.group import Group
from ..api.ops import all_sum
from ..api.world import init
from .linear import Cached, Linear, QuantizedLinear, Seed, affine, init_linear
from .module import Module
from .quantize import check_mode, dequantize, quantize

__all__ = [
    "AllToShardedLinear",
    "ShardedToAllLinear",
    "QuantizedAllToShardedLinear",
    "QuantizedShardedToAllLinear",
    "shard_linear",
    "shard_inplace",
    "SHARDINGS",
]

SHARDINGS = ("all-to-sharded", "sharded-to-all")


def _shard(a: np.ndarray, axis: int, group: Group, segments: int = 1) -> np.ndarray:
    """This rank's slice of ``a`` along ``axis``; with ``segments`` > 1 the axis holds that
    many fused blocks (e.g. Q, K, V) and each is sliced separately, then re-joined."""
    n, r = group.size(), group.rank()
    blocks = np.split(a, segments, axis=axis)
    parts = [np.split(block, n, axis=axis)[r] for block in blocks]
    return np.ascontiguousarray(np.concatenate(parts, axis=axis))


def _check_output(output_dims: int, n: int, segments: int = 1) -> None:
    if output_dims % (n * segments):
        raise ValueError(
            f"Cannot shard the output of size {output_dims} across {n} devices"
            + (f" in {segments} segments." if segments > 1 else ".")
        )


def _check_input(input_dims: int, n: int, segments: int = 1, group_size: int | None = None) -> None:
    if input_dims % (n * segments):
        raise ValueError(
            f"The input of size {input_dims} cannot be sharded across {n} devices"
            + (f" in {segments} segments." if segments > 1 else ".")
        )
    shard = input_dims // (n * segments)
    if group_size is not None and shard % group_size:
        raise ValueError(
            f"The input of size {input_dims} cannot be sharded across {n} devices with "
            f"quantization groups of {group_size}: each shard of {shard} must be divisible by {group_size}."
        )


class _TPLayer(Cached):
    """What the four layers share: the group, the cached input, the rank in the repr."""

    def __init__(self, group: Group | None) -> None:
        super().__init__()
        self.group = group if group is not None else init()

    def _shards(self) -> str:
        return f"rank={self.group.rank()}/{self.group.size()}"

    def _sharded_input(self, x: Any, local_dims: int) -> np.ndarray:
        """Check the width of a sharded input before communicating: a rank that raised
        after its peers entered the all_sum would leave them waiting until the timeout."""
        a = self._remember(x)
        if a.ndim == 0 or a.shape[-1] != local_dims:
            n = self.group.size()
            raise ValueError(
                f"{type(self).__name__} on rank {self.group.rank()} expects this rank's "
                f"{local_dims} of the {local_dims * n} input features (the last axis), got shape {a.shape}"
            )
        return a


class AllToShardedLinear(_TPLayer):
    """Each rank computes its slice of the output features from the full input.

    ``weight`` is ``(output_dims / N, input_dims)`` and ``bias`` ``(output_dims / N,)``
    on a group of ``N`` ranks. ``backward`` all-sums the input gradient over the group.

    Args:
        input_dims (int): features of the (replicated) input.
        output_dims (int): features of the whole output; must divide by the group size.
        bias (bool): whether to add a bias. Default: ``True``.
        group (Group, optional): the ranks to shard over. Default: ``None`` (the world).
        rng (Generator | int | None): seed for :class:`Linear`'s initialisation; the same
            seed on every rank gives each rank its slice of one ``Linear``. Default: ``None``.
    """

    _parameters = ("weight", "bias")
    _trainable = ("weight", "bias")

    def __init__(
        self, input_dims: int, output_dims: int, bias: bool = True, group: Group | None = None, *, rng: Seed = None
    ) -> None:
        super().__init__(group)
        _check_output(output_dims, self.group.size())
        weight, b = init_linear(input_dims, output_dims, bias, rng)
        self.weight = _shard(weight, 0, self.group)
        self.bias = None if b is None else _shard(b, 0, self.group)

    @property
    def input_dims(self) -> int:
        return int(self.weight.shape[1])

    @property
    def output_dims(self) -> int:
        return int(self.weight.shape[0]) * self.group.size()

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"bias={self.bias is not None}, {self._shards()}"
        )

    def __call__(self, x: Any) -> np.ndarray:
        return affine(self._remember(x), self.weight, self.bias)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return all_sum(self._affine_vjp(self.weight, grad_output), group=self.group)

    @classmethod
    def from_linear(cls, linear: Linear, *, segments: int = 1, group: Group | None = None) -> AllToShardedLinear:
        """This rank's rows of ``linear`` (``segments`` fused blocks are sliced one by one)."""
        layer = cls.__new__(cls)
        _TPLayer.__init__(layer, group)
        _check_output(linear.output_dims, layer.group.size(), segments)
        layer.weight = _shard(linear.weight, 0, layer.group, segments)
        layer.bias = None if linear.bias is None else _shard(linear.bias, 0, layer.group, segments)
        return layer


class ShardedToAllLinear(_TPLayer):
    """Each rank multiplies its slice of the input features; an all_sum gives everyone the output.

    ``weight`` is ``(output_dims, input_dims / N)``; ``bias`` ``(output_dims,)`` is
    replicated and added once, after the sum. ``backward`` needs no communication.

    Args:
        input_dims (int): features of the whole input; must divide by the group size.
        output_dims (int): features of the (replicated) output.
        bias (bool): whether to add a bias. Default: ``True``.
        group (Group, optional): the ranks to shard over. Default: ``None`` (the world).
        rng (Generator | int | None): seed, as for :class:`AllToShardedLinear`. Default: ``None``.
    """

    _parameters = ("weight", "bias")
    _trainable = ("weight", "bias")

    def __init__(
        self, input_dims: int, output_dims: int, bias: bool = True, group: Group | None = None, *, rng: Seed = None
    ) -> None:
        super().__init__(group)
        _check_input(input_dims, self.group.size())
        weight, self.bias = init_linear(input_dims, output_dims, bias, rng)
        self.weight = _shard(weight, 1, self.group)

    @property
    def input_dims(self) -> int:
        return int(self.weight.shape[1]) * self.group.size()

    @property
    def output_dims(self) -> int:
        return int(self.weight.shape[0])

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"bias={self.bias is not None}, {self._shards()}"
        )

    def __call__(self, x: Any) -> np.ndarray:
        a = self._sharded_input(x, int(self.weight.shape[1]))
        y = all_sum(affine(a, self.weight, None), group=self.group)
        return y + self.bias if self.bias is not None else y

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return self._affine_vjp(self.weight, grad_output)

    @classmethod
    def from_linear(cls, linear: Linear, *, segments: int = 1, group: Group | None = None) -> ShardedToAllLinear:
        """This rank's columns of ``linear``; the bias is copied whole."""
        layer = cls.__new__(cls)
        _TPLayer.__init__(layer, group)
        _check_input(linear.input_dims, layer.group.size(), segments)
        layer.weight = _shard(linear.weight, 1, layer.group, segments)
        layer.bias = None if linear.bias is None else np.array(linear.bias, copy=True)
        return layer


class _QuantizedTP(_TPLayer):
    """Quantized weights: only ``bias`` trains; the input gradient goes through the
    dequantized weight."""

    _parameters = ("weight", "scales", "biases", "bias")
    _trainable = ("bias",)
    group_size: int
    bits: int
    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bias: np.ndarray | None

    def dequantized_weight(self) -> np.ndarray:
        """This rank's weight shard as floats."""
        return dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)

    def _quantized(self, weight: np.ndarray, axis: int, segments: int = 1) -> None:
        """Quantize a full weight, then keep this rank's slice of every quantized array."""
        w_q, scales, biases = quantize(weight, self.group_size, self.bits)
        self.weight, self.scales, self.biases = (_shard(a, axis, self.group, segments) for a in (w_q, scales, biases))

    def _local_input_dims(self) -> int:
        return int(self.weight.shape[1]) * 32 // self.bits

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"bias={self.bias is not None}, group_size={self.group_size}, bits={self.bits}, "
            f"{self._shards()}"
        )

    @property
    def input_dims(self) -> int:
        raise NotImplementedError

    @property
    def output_dims(self) -> int:
        raise NotImplementedError


class QuantizedAllToShardedLinear(_QuantizedTP):
    """:class:`AllToShardedLinear` with the weight quantized (rows of ``weight``,
    ``scales`` and ``biases`` are sharded together).

    Args:
        input_dims (int): features of the (replicated) input.
        output_dims (int): features of the whole output; must divide by the group size.
        bias (bool): whether to add a bias (starts at zero, as in MLX). Default: ``True``.
        group_size (int): weights sharing a scale and bias. Default: ``64``.
        bits (int): bits per weight. Default: ``4``.
        mode (str): only ``"affine"``. Default: ``"affine"``.
        group (Group, optional): the ranks to shard over. Default: ``None`` (the world).
        rng (Generator | int | None): seed for the initial weight. Default: ``None``.
    """

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        bias: bool = True,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
        group: Group | None = None,
        *,
        rng: Seed = None,
    ) -> None:
        super().__init__(group)
        check_mode(mode)
        _check_output(output_dims, self.group.size())
        self.group_size, self.bits = group_size, bits
        weight, _ = init_linear(input_dims, output_dims, False, rng)
        self._quantized(weight, 0)
        self.bias = np.zeros((output_dims // self.group.size(),), np.float32) if bias else None

    @property
    def input_dims(self) -> int:
        return self._local_input_dims()

    @property
    def output_dims(self) -> int:
        return int(self.weight.shape[0]) * self.group.size()

    def __call__(self, x: Any) -> np.ndarray:
        return affine(self._remember(x), self.dequantized_weight(), self.bias)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        grad_input = self._affine_vjp(self.dequantized_weight(), grad_output, train_weight=False)
        return all_sum(grad_input, group=self.group)

    @classmethod
    def from_quantized_linear(
        cls, quantized_linear: QuantizedLinear, *, segments: int = 1, group: Group | None = None
    ) -> QuantizedAllToShardedLinear:
        """This rank's rows of an existing :class:`QuantizedLinear`."""
        layer = cls.__new__(cls)
        _TPLayer.__init__(layer, group)
        ql = quantized_linear
        _check_output(ql.output_dims, layer.group.size(), segments)
        layer.group_size, layer.bits = ql.group_size, ql.bits
        layer.weight, layer.scales, layer.biases = (
            _shard(a, 0, layer.group, segments) for a in (ql.weight, ql.scales, ql.biases)
        )
        layer.bias = None if ql.bias is None else _shard(ql.bias, 0, layer.group, segments)
        return layer


class QuantizedShardedToAllLinear(_QuantizedTP):
    """:class:`ShardedToAllLinear` with the weight quantized (columns of ``weight``,
    ``scales`` and ``biases`` are sharded together, so each shard must hold whole
    quantization groups).

    Args:
        input_dims (int): features of the whole input; ``input_dims / N`` must divide by
            ``group_size``.
        output_dims (int): features of the (replicated) output.
        bias (bool): whether to add a bias (starts at zero, as in MLX). Default: ``True``.
        group_size (int): weights sharing a scale and bias. Default: ``64``.
        bits (int): bits per weight. Default: ``4``.
        mode (str): only ``"affine"``. Default: ``"affine"``.
        group (Group, optional): the ranks to shard over. Default: ``None`` (the world).
        rng (Generator | int | None): seed for the initial weight. Default: ``None``.
    """

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        bias: bool = True,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
        group: Group | None = None,
        *,
        rng: Seed = None,
    ) -> None:
        super().__init__(group)
        check_mode(mode)
        _check_input(input_dims, self.group.size(), 1, group_size)
        self.group_size, self.bits = group_size, bits
        weight, _ = init_linear(input_dims, output_dims, False, rng)
        self._quantized(weight, 1)
        self.bias = np.zeros((output_dims,), np.float32) if bias else None

    @property
    def input_dims(self) -> int:
        return self._local_input_dims() * self.group.size()

    @property
    def output_dims(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: Any) -> np.ndarray:
        a = self._sharded_input(x, self._local_input_dims())
        y = all_sum(affine(a, self.dequantized_weight(), None), group=self.group)
        return y + self.bias if self.bias is not None else y

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return self._affine_vjp(self.dequantized_weight(), grad_output, train_weight=False)

    @classmethod
    def from_quantized_linear(
        cls, quantized_linear: QuantizedLinear, *, segments: int = 1, group: Group | None = None
    ) -> QuantizedShardedToAllLinear:
        """This rank's columns of an existing :class:`QuantizedLinear`; the bias is copied."""
        layer = cls.__new__(cls)
        _TPLayer.__init__(layer, group)
        ql = quantized_linear
        _check_input(ql.input_dims, layer.group.size(), segments, ql.group_size)
        layer.group_size, layer.bits = ql.group_size, ql.bits
        layer.weight, layer.scales, layer.biases = (
            _shard(a, 1, layer.group, segments) for a in (ql.weight, ql.scales, ql.biases)
        )
        layer.bias = None if ql.bias is None else np.array(ql.bias, copy=True)
        return layer


_FROM: dict[tuple[str, bool], Callable[..., Module]] = {
    ("all-to-sharded", False): AllToShardedLinear.from_linear,
    ("all-to-sharded", True): QuantizedAllToShardedLinear.from_quantized_linear,
    ("sharded-to-all", False): ShardedToAllLinear.from_linear,
    ("sharded-to-all", True): QuantizedShardedToAllLinear.from_quantized_linear,
}


def shard_linear(
    module: Linear | QuantizedLinear, sharding: str, *, segments: int = 1, group: Group | None = None
) -> Module:
    """A new tensor-parallel layer holding this rank's shard of ``module``.

    Args:
        module (Linear | QuantizedLinear): the layer to shard; it is not modified.
        sharding (str): ``"all-to-sharded"`` (split the output features) or
            ``"sharded-to-all"`` (split the input features).
        segments (int): fused blocks along the sharded axis (3 for a fused QKV),
            each split separately. Default: ``1``.
        group (Group, optional): the ranks to shard over. Default: ``None`` (the world).
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if not isinstance(module, (Linear, QuantizedLinear)):
        raise TypeError(f"shard_linear shards Linear or QuantizedLinear, got {type(module).__name__}")
    return _FROM[sharding, isinstance(module, QuantizedLinear)](module, segments=segments, group=group)


def shard_inplace(
    model: Module,
    sharding: str | Callable[[int, Module], str | None] = "alternate",
    *,
    segments: int = 1,
    group: Group | None = None,
) -> Module:
    """Replace the linear layers of ``model.layers`` (e.g. a :class:`Sequential`) by shards.

    Args:
        model (Module): a container with a ``layers`` list; changed in place and returned.
        sharding (str | callable): ``"alternate"`` (the default) makes the linear layers
            all-to-sharded, sharded-to-all, all-to-sharded, … so an MLP with an even
            number of them needs one all_sum per pair and returns a replicated output
            (an odd number leaves the output sharded). ``"all-to-sharded"`` or
            ``"sharded-to-all"`` apply to every linear layer; a callable
            ``(index, layer) -> sharding | None`` decides per layer (``None`` keeps it).
        segments (int): as for :func:`shard_linear`. Default: ``1``.
        group (Group, optional): the ranks to shard over. Default: ``None`` (the world).
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        raise TypeError(
            f"shard_inplace needs a model with a 'layers' list (e.g. Sequential), "
            f"got {type(model).__name__}; use shard_linear for a single layer"
        )
    if isinstance(sharding, str) and sharding != "alternate" and sharding not in SHARDINGS:
        raise ValueError(f"sharding must be 'alternate', one of {SHARDINGS} or a callable, got {sharding!r}")
    group = group if group is not None else init()
    count = 0
    for i, layer in enumerate(layers):
        if not isinstance(layer, (Linear, QuantizedLinear)):
            continue
        if callable(sharding):
            how = sharding(i, layer)
        elif sharding == "alternate":
            how = SHARDINGS[count % 2]
        else:
            how = sharding
        count += 1
        if how is not None:
            layers[i] = shard_linear(layer, how, segments=segments, group=group)
    return model
