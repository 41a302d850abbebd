"""One rank of a raw peer library's all_sum sweep, timed exactly like ``meshcomm bench``.

``meshcomm bench --compare`` (:mod:`.compare`) runs this file as a script on every rank
of a job (it imports meshcomm absolutely, so it needs no package context)::

    python .../meshcomm/bench/peers.py mpi4py --sizes 8B:64MiB:4 --json out.json   # under mpiexec
    python .../meshcomm/bench/peers.py torch  ...   # MLX_RANK/MLX_WORLD_SIZE/BENCH_TORCH_PORT set
    python .../meshcomm/bench/peers.py mlx    ...   # under mlx.launch --backend ring

Each library gets the same float32 buffers as meshcomm (``rank_input``: ``i % 7 + rank``)
and the same timer (:func:`meshcomm.bench.measure.time_op`: warm-up, a barrier before
every iteration, the slowest rank per iteration, adaptive iteration count), through a
small :class:`~meshcomm.bench.measure.Sync` built on the library's own barrier and max
reduction. The calls are what a user of each library writes for the fastest path:

* mpi4py: ``comm.Allreduce(x, out, MPI.SUM)`` into a preallocated ``out``;
* torch: ``dist.all_reduce(t)`` in place on a tensor (gloo); the buffer's values grow
  from call to call, which costs nothing extra for float32 (no denormals appear);
* mlx: ``mx.eval(mx.distributed.all_sum(a))`` on an ``mx.array`` (ring backend).

Before timing, one call on a fresh copy of the input is checked against the exact
expected sum; a wrong result stops the job with an error, so no figure comes from it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from meshcomm.bench.collectives import describe_mismatch, rank_input
from meshcomm.bench.measure import Sync, time_op
from meshcomm.bench.sizes import parse_sizes

__all__ = ["main"]

Maker = Callable[[np.ndarray], tuple[Callable[[], Any], Callable[[], np.ndarray]]]
#: (rank, size, sync, make, close): ``make(x)`` gives (timed call, checked call)
Setup = tuple[int, int, Sync, Maker, Callable[[], None]]


def _mpi4py() -> Setup:
    """Raw mpi4py (the MPI it was built for; here the Open MPI wheel)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD

    class _Sync:
        def barrier(self) -> None:
            comm.Barrier()

        def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
            out = np.empty_like(values)
            comm.Allreduce(np.ascontiguousarray(values), out, MPI.MAX)
            return out

    def make(x: np.ndarray) -> tuple[Callable[[], Any], Callable[[], np.ndarray]]:
        out = np.empty_like(x)

        def call() -> None:
            comm.Allreduce(x, out, MPI.SUM)

        def checked() -> np.ndarray:
            res = np.empty_like(x)
            comm.Allreduce(x, res, MPI.SUM)
            return res

        return call, checked

    return comm.Get_rank(), comm.Get_size(), _Sync(), make, lambda: None


def _torch() -> Setup:
    """torch.distributed with the gloo backend."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, size = int(os.environ["MLX_RANK"]), int(os.environ["MLX_WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['BENCH_TORCH_PORT']}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=300),
    )

    class _Sync:
        def barrier(self) -> None:
            dist.barrier()

        def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
            t = torch.from_numpy(np.array(values, dtype=np.float64))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.numpy()

    def make(x: np.ndarray) -> tuple[Callable[[], Any], Callable[[], np.ndarray]]:
        t = torch.from_numpy(x.copy())

        def call() -> None:
            dist.all_reduce(t)

        def checked() -> np.ndarray:
            c = torch.from_numpy(x.copy())
            dist.all_reduce(c)
            return c.numpy()

        return call, checked

    # gloo aborts the process at exit if the group is still alive
    return rank, size, _Sync(), make, dist.destroy_process_group


def _mlx() -> Setup:
    """mx.distributed (the ring backend under mlx.launch)."""
    import mlx.core as mx

    g = mx.distributed.init(strict=True)
    one = mx.array(np.ones(1, dtype=np.float32))

    class _Sync:
        def barrier(self) -> None:  # MLX has no barrier; a tiny all_sum is the usual stand-in
            mx.eval(mx.distributed.all_sum(one, group=g))

        def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
            # float32 on the wire (MLX CPU has no float64 reductions); microseconds survive it
            r = mx.distributed.all_max(mx.array(np.asarray(values, dtype=np.float32)), group=g)
            return np.array(r, dtype=np.float64)

    def make(x: np.ndarray) -> tuple[Callable[[], Any], Callable[[], np.ndarray]]:
        a = mx.array(x)
        mx.eval(a)

        def call() -> None:
            mx.eval(mx.distributed.all_sum(a, group=g))

        def checked() -> np.ndarray:
            return np.array(mx.distributed.all_sum(a, group=g))

        return call, checked

    return g.rank(), g.size(), _Sync(), make, lambda: None


LIBS: dict[str, Callable[[], Setup]] = {"mpi4py": _mpi4py, "torch": _torch, "mlx": _mlx}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of a raw peer's all_sum sweep")
    p.add_argument("lib", choices=sorted(LIBS))
    p.add_argument("--sizes", default="8B:64MiB:4")
    p.add_argument("--min-time", type=float, default=0.3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    rank, size, sync, make, close = LIBS[args.lib]()
    try:
        return _sweep(args, rank, size, sync, make)
    finally:
        close()


def _sweep(args: argparse.Namespace, rank: int, size: int, sync: Sync, make: Maker) -> int:
    """Check then time every size; rank 0 writes the JSON."""
    rows = []
    for nbytes in parse_sizes(args.sizes):
        count = max(1, nbytes // 4)
        x = rank_input(count, np.dtype(np.float32), rank)
        expected = sum(rank_input(count, np.dtype(np.float32), k) for k in range(size))
        call, checked = make(x)
        wrong = describe_mismatch(checked(), np.asarray(expected, dtype=np.float32))
        if wrong:
            sys.stderr.write(f"{args.lib} rank {rank}: all_sum at {nbytes} B is wrong: {wrong}\n")
            return 1
        timing = time_op(call, sync, warmup=args.warmup, min_time=args.min_time)
        rows.append({"bytes": count * 4, "ok": True, "time": timing.stats.as_dict()})
        if rank == 0:
            sys.stderr.write(
                f"{args.lib} {size} ranks {count * 4:>10} B  median "
                f"{timing.stats.median * 1e6:10.1f} us ({timing.stats.iters} iters)\n"
            )
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump({"lib": args.lib, "ranks": size, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
