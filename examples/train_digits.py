"""Data- and tensor-parallel training of a small MLP on scikit-learn's digits.

The world is split into a grid: ``tp`` consecutive ranks share one model, each holding
a shard of every weight (tensor parallelism), and the ``dp = size / tp`` copies of the
model each see a different part of every batch (data parallelism, gradients averaged
with ``average_gradients``). With 4 ranks the default is 2 x 2. The loss curve is the
same as on one process (up to float rounding), and a checksum of the parameters,
gathered from every rank, shows the replicas stay identical.

    python examples/train_digits.py
    meshcomm launch -n 4 -- python examples/train_digits.py

Needs scikit-learn (the data set ships with it); writes a PNG of the loss curve when
matplotlib is installed. Exits non-zero if the loss does not fall or replicas differ.
"""

from __future__ import annotations

import argparse
import sys
import zlib

import meshcomm as mc
import numpy as np
from meshcomm import nn


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean softmax cross-entropy and its gradient with respect to ``logits``."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(labels)
    loss = float(-np.log(p[np.arange(n), labels] + 1e-12).mean())
    p[np.arange(n), labels] -= 1.0
    return loss, (p / n).astype(logits.dtype)


def checksum(model: nn.Module) -> int:
    """CRC32 of every parameter's bytes: equal only if the parameters are bit-identical."""
    crc = 0
    for _, value in nn.tree_flatten(model.parameters()):
        crc = zlib.crc32(np.ascontiguousarray(value).tobytes(), crc)
    return crc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=0, help="ranks per model (default: 2 if the size is even)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the data-parallel ranks")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="train_digits_loss.png", help="PNG to write ('' for none)")
    args = p.parse_args()

    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("this example needs scikit-learn: pip install 'meshcomm[nn]'", file=sys.stderr)
        return 2

    world = mc.init()
    rank, size = world.rank(), world.size()
    tp = args.tp or (2 if size % 2 == 0 else 1)
    if size % tp or args.batch % (size // tp):
        raise SystemExit(
            f"--tp {tp} must divide the world size {size}, "
            f"and the data-parallel size {size // tp} must divide --batch {args.batch}"
        )
    dp = size // tp
    tp_group = world.split(rank // tp, key=rank)  # ranks holding shards of one model
    dp_group = world.split(rank % tp, key=rank)  # ranks holding the same shard

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    order = np.random.default_rng(args.seed).permutation(len(x))
    test, train = order[:360], order[360:]

    h = args.hidden
    model = nn.Sequential(
        nn.Linear(64, h, rng=args.seed),
        nn.ReLU(),
        nn.Linear(h, h, rng=args.seed + 1),
        nn.ReLU(),
        nn.Linear(h, h, rng=args.seed + 2),
        nn.ReLU(),
        nn.Linear(h, 10, rng=args.seed + 3),
    )
    nn.shard_inplace(model, group=tp_group)
    if rank == 0:
        print(
            f"{size} rank(s): {dp} data-parallel x {tp} tensor-parallel; "
            f"{len(train)} training and {len(test)} test images"
        )
        print(model)

    steps = len(train) // args.batch
    curve: list[float] = []
    for epoch in range(args.epochs):
        perm = train[np.random.default_rng(args.seed + 1000 + epoch).permutation(len(train))]
        total = 0.0
        for step in range(steps):
            batch = perm[step * args.batch : (step + 1) * args.batch]
            mine = batch.reshape(dp, -1)[dp_group.rank()]  # this replica's share
            loss, grad = cross_entropy(model(x[mine]), y[mine])
            model.backward(grad)
            grads = nn.average_gradients(model.grads, group=dp_group)
            model.update(nn.tree_map(lambda w, g: w - args.lr * g, model.trainable_parameters(), grads))
            total += loss
        # One all_sum per epoch for the loss: the mean over replicas of their mean losses.
        curve.append(float(mc.all_sum(np.float64(total), group=dp_group)) / (dp * steps))
        accuracy = float((model(x[test]).argmax(axis=1) == y[test]).mean())
        if rank == 0:
            print(f"epoch {epoch + 1:3d}  loss {curve[-1]:.4f}  test accuracy {accuracy:.3f}")

    sums = mc.all_gather(np.array([checksum(model)], dtype=np.int64), group=world)
    replicas_equal = all(sums[r] == sums[r % tp] for r in range(size))
    if rank == 0:
        print("parameter checksums (crc32) by rank:", " ".join(f"{int(s):08x}" for s in sums))
        print(f"data-parallel replicas identical: {'yes' if replicas_equal else 'NO'}")
        print("loss curve:", " ".join(f"{v:.3f}" for v in curve))
        if args.plot:
            _plot(curve, args.plot, f"digits MLP, {dp} DP x {tp} TP")
    falls = len(curve) < 2 or curve[-1] < 0.9 * curve[0]
    return 0 if replicas_equal and falls else 1


def _plot(curve: list[float], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot written")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(curve) + 1), curve, marker="o")
    ax.set(xlabel="epoch", ylabel="training loss", title=title, yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curve written to {path}")


if __name__ == "__main__":
    sys.exit(main())
