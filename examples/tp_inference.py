"""Tensor-parallel inference of an MLP, in float32 and 4-bit, checked against one process.

Every rank builds the same model from the same seed, keeps only its shards
(all-to-sharded, sharded-to-all, ...) and runs the batch; the output must match the
unsharded model's on every rank. Run it alone or under the launcher:

    python examples/tp_inference.py
    meshcomm launch -n 4 -- python examples/tp_inference.py

It exits non-zero if the difference exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import sys

import meshcomm as mc
import numpy as np
from meshcomm import nn


def build_mlp(dims: list[int], seed: int) -> nn.Sequential:
    """Linear layers of ``dims`` with ReLUs between them, each seeded from ``seed``."""
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(d_in, d_out, rng=seed + i))
    return nn.Sequential(*layers)


def quantized(model: nn.Sequential, group_size: int, bits: int) -> nn.Sequential:
    """A copy of ``model`` with every Linear replaced by its QuantizedLinear."""
    return nn.Sequential(
        *(layer.to_quantized(group_size, bits) if isinstance(layer, nn.Linear) else layer for layer in model.layers)
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="128,512,128,512,64", help="layer widths (even count of layers)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=1e-4)
    args = p.parse_args()

    world = mc.init()
    rank, size = world.rank(), world.size()
    dims = [int(d) for d in args.dims.split(",")]
    x = np.random.default_rng(args.seed).normal(size=(args.batch, dims[0])).astype(np.float32)

    # The reference: the whole model in this process.
    full = build_mlp(dims, args.seed)
    y_ref = full(x)
    q_full = quantized(full, args.group_size, args.bits)
    yq_ref = q_full(x)

    # The same models, sharded over the world: each rank keeps 1/size of every weight.
    tp = nn.shard_inplace(build_mlp(dims, args.seed), group=world)
    q_tp = nn.shard_inplace(nn.Sequential(*q_full.layers), group=world)
    diff = float(np.abs(tp(x) - y_ref).max())
    q_diff = float(np.abs(q_tp(x) - yq_ref).max())
    q_err = float(np.abs(yq_ref - y_ref).max())

    # The worst rank decides.
    diff, q_diff = (float(v) for v in mc.all_max(np.array([diff, q_diff]), group=world))
    if rank == 0:
        print(f"tensor-parallel MLP {'-'.join(map(str, dims))} over {size} rank(s), batch {args.batch}")
        print(tp)
        print(f"float32: max |y_tp - y_single| = {diff:.3g}")
        print(
            f"{args.bits}-bit (group size {args.group_size}): max |y_tp - y_single| = {q_diff:.3g} "
            f"(quantization itself changes the output by up to {q_err:.3g})"
        )
    ok = diff <= args.tolerance and q_diff <= args.tolerance
    if not ok and rank == 0:
        print(f"FAILED: difference above tolerance {args.tolerance}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
