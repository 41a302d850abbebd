"""Data-parallel training that loses a rank, goes on, and grows back.

An MLP learns scikit-learn's digits. Every step's global batch (the same images whatever
the world's size) is split over the ranks, and each rank's gradient is weighted by its
share, so the update is the full-batch gradient on any number of ranks: a run that loses
and regains ranks follows the same path as an undisturbed one, up to float rounding.

With ``--kill-rank R --kill-step S`` rank R kills itself (SIGKILL) in the middle of step S.
The survivors' gradient all_sum raises; they call ``world.shrink()``, take rank 0's
parameters and step (a survivor may have finished the step the others lost), split the
batches over the smaller world and go on. Under ``meshcomm launch --restart-lost 1`` the
launcher starts a replacement; the ranks call ``world.grow()`` at the end of every epoch,
and once the replacement is admitted it gets the parameters from rank 0 and trains with
the others.

    meshcomm launch -n 4 --restart-lost 1 -- examples/train_elastic.py --kill-rank 2 --kill-step 40
    python examples/train_elastic.py            # the undisturbed run, on one process

Rank 0 writes ``--curve`` (JSON: the loss of every step, and the steps of the loss, the
shrink and the rejoin) and prints the final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import meshcomm as mc
import numpy as np
from meshcomm import nn
from train_digits import cross_entropy  # the same loss as the digits example (this directory)


class Trainer:
    """The model and where training stands; ``sync`` makes every rank's equal to rank 0's."""

    def __init__(self, args: argparse.Namespace) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        self.x = (digits.data / 16.0).astype(np.float32)
        self.y = digits.target
        self.train = np.random.default_rng(args.seed).permutation(len(self.x))
        self.args = args
        h = args.hidden
        self.model = nn.Sequential(nn.Linear(64, h, rng=args.seed), nn.ReLU(), nn.Linear(h, 10, rng=args.seed + 1))
        self.step = 0
        self.steps_per_epoch = len(self.train) // args.batch

    def flat(self) -> np.ndarray:
        return np.concatenate([np.ravel(v) for _, v in nn.tree_flatten(self.model.trainable_parameters())])

    def load(self, flat: np.ndarray, delta: bool = False) -> None:
        """Parameters from one vector in tree order (``delta``: add it to them instead)."""
        at = 0

        def take(w: np.ndarray) -> np.ndarray:
            nonlocal at
            part = flat[at : at + w.size].reshape(w.shape)
            at += w.size
            return (w + part if delta else part).astype(w.dtype)

        self.model.update(nn.tree_map(take, self.model.trainable_parameters()))

    def sync(self, world: mc.Group) -> None:
        """Rank 0's parameters and step on every rank (after a shrink or a grow)."""
        state = world.broadcast(np.concatenate([[float(self.step)], self.flat().astype(np.float64)]), root=0)
        self.step = int(state[0])
        self.load(state[1:].astype(np.float32))

    def batch(self) -> np.ndarray:
        epoch, i = divmod(self.step, self.steps_per_epoch)
        perm = self.train[np.random.default_rng(self.args.seed + 1000 + epoch).permutation(len(self.train))]
        return perm[i * self.args.batch : (i + 1) * self.args.batch]

    def train_step(self, world: mc.Group) -> float:
        """One step on this rank's share of the global batch; returns the batch's mean loss."""
        batch = self.batch()
        mine = np.array_split(batch, world.size())[world.rank()]
        loss, grad = cross_entropy(self.model(self.x[mine]), self.y[mine])
        self.model.backward(grad)
        share = len(mine) / len(batch)  # the gradient of the mean over the whole batch
        local = np.concatenate([[loss * share], *(np.ravel(g) * share for _, g in nn.tree_flatten(self.model.grads))])
        total = mc.all_sum(local.astype(np.float64), group=world)
        self.load(-self.args.lr * total[1:], delta=True)
        self.step += 1
        return float(total[0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=60, help="global batch, split over however many ranks there are")
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=-1, help="this rank kills itself (SIGKILL) ...")
    p.add_argument("--kill-step", type=int, default=40, help="... in the middle of this step")
    p.add_argument(
        "--wait-for", type=int, default=0, help="at an epoch's end, wait until the world has this many ranks"
    )
    p.add_argument("--curve", default="", help="rank 0 writes the loss of every step here (JSON)")
    p.add_argument("--plot", default="", help="and draws it into this PNG (needs --curve and matplotlib)")
    p.add_argument("--baseline", default="", help="an undisturbed run's --curve, drawn under it")
    args = p.parse_args()

    joined = os.environ.get("MESHCOMM_JOIN") == "1"  # a replacement the launcher started
    world = mc.init()
    first_rank = world.rank()  # ranks are renumbered by shrink and grow
    trainer = Trainer(args)
    losses: list[float] = []  # the loss of every step so far (NaN before a newcomer joined)
    sizes: list[int] = []  # the world's size at every step
    events: dict[str, int] = {}
    if joined:
        trainer.sync(world)  # the others call sync() right after the grow() that admitted it
        losses = sizes = [float("nan")] * trainer.step
        print(f"joined as rank {world.rank()} of {world.size()} at step {trainer.step}", flush=True)
    total_steps = args.epochs * trainer.steps_per_epoch
    while trainer.step < total_steps:
        try:
            if trainer.step == args.kill_step and first_rank == args.kill_rank and not joined:
                os.kill(os.getpid(), signal.SIGKILL)
            losses.append(trainer.train_step(world))
            sizes.append(world.size())
        except (mc.PeerLostError, mc.CommTimeoutError) as exc:
            t0 = time.monotonic()
            world = world.shrink()
            trainer.sync(world)
            del losses[trainer.step :], sizes[trainer.step :]  # a survivor that finished the lost step takes it back
            events.setdefault("lost", trainer.step)
            if world.rank() == 0:
                print(
                    f"step {trainer.step}: lost rank {exc.peer}; {world.size()} ranks go on "
                    f"(shrink and sync took {time.monotonic() - t0:.3f} s)",
                    flush=True,
                )
            continue
        if trainer.step % trainer.steps_per_epoch == 0:  # an epoch ended: admit whoever waits
            size = world.size()
            world = world.grow()
            waited = time.monotonic()
            while world.size() < args.wait_for and time.monotonic() - waited < 60:
                time.sleep(0.05)
                world = world.grow()  # --wait-for N: hold the epoch's end until the world has N ranks again
            if world.size() != size:
                trainer.sync(world)
                events.setdefault("rejoined", trainer.step)
                if world.rank() == 0:
                    print(
                        f"step {trainer.step}: {world.size() - size} rank(s) joined; {world.size()} ranks", flush=True
                    )
            if world.rank() == 0:
                epoch = trainer.step // trainer.steps_per_epoch
                print(f"epoch {epoch:3d}  loss {np.mean(losses[-trainer.steps_per_epoch :]):.4f}", flush=True)
    final = float(np.mean(losses[-trainer.steps_per_epoch :])) if losses else float("nan")
    if world.rank() == 0:
        print(f"final loss {final:.6f} after {trainer.step} steps on {world.size()} ranks; events {events}")
        if args.curve:
            with open(args.curve, "w") as f:
                json.dump({"loss": losses, "size": sizes, "events": events, "per_epoch": trainer.steps_per_epoch}, f)
        if args.plot:
            _plot(args.curve, args.baseline, args.plot)
    return 0 if world.rank() != 0 or final < 0.5 * losses[0] else 1


def _plot(curve: str, baseline: str, path: str) -> None:
    """The loss of every step, the undisturbed run's under it, the loss and the rejoin marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(curve) as f:
        run = json.load(f)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    if baseline:
        with open(baseline) as f:
            ax.plot(json.load(f)["loss"], color="0.7", lw=4, label="undisturbed (1 process)")
    ax.plot(run["loss"], color="C0", lw=1.2, label="4 ranks: one killed, shrink, rejoin")
    for name, color in (("lost", "C3"), ("rejoined", "C2")):
        if name in run["events"]:
            step = run["events"][name]
            ax.axvline(step, color=color, ls="--")
            ax.text(step, 1.2, f" {name} (step {step})", color=color)
    ax.set(xlabel="step", ylabel="training loss", yscale="log", title="examples/train_elastic.py")
    ax2 = ax.twinx()
    ax2.step(range(len(run["size"])), run["size"], where="post", color="C1", alpha=0.6, label="ranks")
    ax2.set(ylabel="ranks", ylim=(0, max(run["size"]) + 1))
    fig.legend(loc="lower left", bbox_to_anchor=(0.09, 0.17), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"loss curve written to {path}")


if __name__ == "__main__":
    sys.exit(main())
