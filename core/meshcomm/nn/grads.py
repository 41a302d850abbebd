"""``average_gradients``: data-parallel gradient averaging in a few large all_sums.

One all_sum per parameter costs a round of latency per parameter; small gradients are
therefore concatenated (per dtype, since an all_sum has one dtype) into buckets of at
least ``all_reduce_size`` bytes, each bucket is all-summed once, and the result is
split back into the original tree.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..api.group import Group
from ..api.ops import all_sum
from ..api.world import init
from .module import tree_flatten, tree_map

__all__ = ["average_gradients"]


def _buckets(arrays: list[np.ndarray], all_reduce_size: int) -> list[list[int]]:
    """Indices of ``arrays`` grouped by dtype (first-seen order), cut once a bucket reaches
    ``all_reduce_size`` bytes; ``all_reduce_size <= 0`` gives one array per bucket."""
    if all_reduce_size <= 0:
        return [[i] for i in range(len(arrays))]
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    buckets: list[list[int]] = []
    for indices in by_dtype.values():
        current: list[int] = []
        nbytes = 0
        for i in indices:
            current.append(i)
            nbytes += arrays[i].nbytes
            if nbytes >= all_reduce_size:
                buckets.append(current)
                current, nbytes = [], 0
        if current:
            buckets.append(current)
    return buckets


def average_gradients(gradients: Any, group: Group | None = None, all_reduce_size: int = 32 * 1024**2) -> Any:
    """The mean of ``gradients`` over the ranks of ``group``, as a tree of the same shape.

    Args:
        gradients: a tree (nested dicts and lists) of arrays, identical in structure,
            shapes and dtypes on every rank (for example ``model.grads``).
        group (Group, optional): the data-parallel ranks. Default: ``None`` (the world).
        all_reduce_size (int): bytes from which a bucket is sent; ``0`` or less sends
            every array on its own. Default: 32 MiB.

    On a size-1 group the input is returned unchanged. Every rank gets bit-identical
    results, so replicas that start equal stay equal.
    """
    group = group if group is not None else init()
    n = group.size()
    if n == 1:
        return gradients
    arrays = [np.asarray(leaf) for _, leaf in tree_flatten(gradients)]
    averaged: list[np.ndarray] = list(arrays)
    for bucket in _buckets(arrays, all_reduce_size):
        dtype = arrays[bucket[0]].dtype
        flat = np.concatenate([arrays[i].reshape(-1) for i in bucket])
        total = all_sum(flat, group=group)
        mean = (total / n).astype(dtype, copy=False)
        offset = 0
        for i in bucket:
            size = arrays[i].size
            averaged[i] = mean[offset : offset + size].reshape(arrays[i].shape)
            offset += size
    leaves = iter(averaged)
    return tree_map(lambda _: next(leaves), gradients)
