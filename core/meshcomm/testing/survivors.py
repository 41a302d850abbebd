"""The survivors' contract (``Group.agree``, ``Group.shrink``) as one real job.

    meshcomm launch --keep-going -n 4 --backend NAME -- python -m meshcomm.testing.survivors

A backend that sets ``survives_failures`` must pass: ``agree`` ANDs flags (bools and
32-bit integers) the same on every rank; then the last rank is killed (SIGKILL) inside an
``all_sum``, every survivor raises a meshcomm error, ``shrink()`` gives each the world of
the others in their old order, whose ``all_sum`` and ``agree`` are right. Each survivor
prints ``MESHCOMM-SURVIVORS ok`` (``... failed: why`` otherwise, and exits 1). A backend
that does not offer it must raise NotSupportedError from ``agree`` and ``shrink``: each
rank prints ``MESHCOMM-SURVIVORS not offered: <what the backend says is missing>``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import meshcomm as mc

__all__ = ["MARK", "main"]

MARK = "MESHCOMM-SURVIVORS"


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def _run(world: mc.Group) -> str:
    rank, size = world.rank(), world.size()
    if not world.transport.survives_failures:
        for call in (lambda: world.agree(True), world.shrink):
            try:
                call()
            except mc.NotSupportedError as exc:
                why = str(exc)
            else:
                raise AssertionError("agree/shrink returned on a backend without survives_failures")
        world.barrier()
        return f"not offered: {why}"
    _check(size >= 3, f"run it on 3 ranks or more (got {size})")
    _check(world.agree(True) is True, "agree(True) on every rank is not True")
    _check(world.agree(rank != size - 1) is False, "agree with one False is not False")
    _check(world.agree(0b1110 if rank else 0b0111) == 0b0110, "agree(ints) is not their bitwise AND")
    x = np.full(5, rank + 1, np.float64)
    _check(bool(np.all(world.all_sum(x) == size * (size + 1) / 2)), "all_sum before the loss")
    lost = size - 1
    try:
        if rank == lost:
            # a peer may still be completing the sum above when this rank has returned from it
            # (MPI: this rank's part was in flight); a death right away can fail that sum, not this one
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        world.all_sum(x)
        raise AssertionError("all_sum returned although a rank was killed inside it")
    except mc.DistributedError:
        pass
    world = world.shrink()
    _check(world.size() == size - 1 and world.rank() == rank, f"shrink gave rank {world.rank()} of {world.size()}")
    total = world.all_sum(np.full(5, rank + 1, np.float64))
    _check(bool(np.all(total == (size - 1) * size / 2)), f"all_sum after shrink gave {total}")
    _check(world.agree(True) is True, "agree after shrink")
    return "ok"


def main() -> int:
    world = mc.init(strict=True)
    try:
        verdict = _run(world)
    except (AssertionError, mc.DistributedError) as exc:
        print(f"{MARK} rank {world.rank()} failed: {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(f"{MARK} rank {world.rank()} {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
