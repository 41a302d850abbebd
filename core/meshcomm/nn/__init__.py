"""``meshcomm.nn``: NumPy layers for tensor- and data-parallel models, in MLX's shapes.

    import meshcomm as mc
    from meshcomm import nn

    group = mc.init()
    model = nn.Sequential(nn.Linear(64, 256, rng=0), nn.ReLU(), nn.Linear(256, 10, rng=1))
    nn.shard_inplace(model, group=group)       # all-to-sharded, then sharded-to-all
    y = model(x)                               # the same y on every rank
    model.backward(dy)                         # gradients in model.grads

See docs/nn.md.
"""

from __future__ import annotations

from .distributed import (
    SHARDINGS,
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
    shard_inplace,
    shard_linear,
)
from .grads import average_gradients
from .linear import Linear, QuantizedLinear
from .module import Module, tree_flatten, tree_map
from .quantize import SUPPORTED_BITS, dequantize, pack_bits, quantize, unpack_bits
from .sequential import ReLU, Sequential

__all__ = [
    "Module",
    "Linear",
    "QuantizedLinear",
    "Sequential",
    "ReLU",
    "AllToShardedLinear",
    "ShardedToAllLinear",
    "QuantizedAllToShardedLinear",
    "QuantizedShardedToAllLinear",
    "shard_linear",
    "shard_inplace",
    "SHARDINGS",
    "average_gradients",
    "quantize",
    "dequantize",
    "pack_bits",
    "unpack_bits",
    "SUPPORTED_BITS",
    "tree_flatten",
    "tree_map",
]
