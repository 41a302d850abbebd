"""A rank of tests/test_frameworks.py: every array operation with torch tensors and MLX
arrays as inputs; each result must be of the caller's framework and hold the right values.
Prints ``CHECKED n`` (the number of checks) or raises."""

from __future__ import annotations

import meshcomm as mc
import numpy as np


def main() -> None:
    g = mc.init()  # size 1 when started alone
    r, n = g.rank(), g.size()
    checked = 0

    def same(got: object, want: np.ndarray, kind: type, what: str) -> None:
        nonlocal checked
        assert type(got) is kind, f"rank {r}: {what} returned {type(got).__name__}, want {kind.__name__}"
        if "bfloat16" not in str(got.dtype):  # type: ignore[attr-defined]
            arr = np.asarray(got)
        elif kind.__module__.startswith("torch"):  # neither exports bfloat16 to NumPy: compare as float32
            arr = got.float().numpy()  # type: ignore[attr-defined]
        else:
            import mlx.core as mx

            arr = np.asarray(got.astype(mx.float32))  # type: ignore[attr-defined]
        assert arr.shape == want.shape and np.array_equal(arr, want), f"rank {r}: {what}: {arr} != {want}"
        checked += 1

    frameworks = []
    try:
        import torch

        frameworks.append(
            (
                "torch",
                torch.Tensor,
                lambda a: torch.from_numpy(np.ascontiguousarray(a)),
                lambda a: torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16),
            )
        )
    except ImportError:
        pass
    try:
        import mlx.core as mx

        frameworks.append(("mlx", mx.array, mx.array, lambda a: mx.array(a.astype(np.float32)).astype(mx.bfloat16)))
    except ImportError:
        pass
    assert frameworks, "neither torch nor mlx is installed"
    for name, kind, make, make_bf16 in frameworks:
        base = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3)
        mine = base + r
        total = base * n + n * (n - 1) / 2
        same(mc.all_sum(make(mine)), total, kind, f"{name} all_sum")
        same(mc.all_max(make(mine)), base + n - 1, kind, f"{name} all_max")
        same(mc.all_gather(make(mine)), np.concatenate([base + q for q in range(n)]), kind, f"{name} all_gather")
        same(mc.sum_scatter(make(mine)), total[2 * r : 2 * r + 2], kind, f"{name} sum_scatter")
        same(mc.broadcast(make(mine), root=n - 1), base + n - 1, kind, f"{name} broadcast")
        same(
            mc.all_to_all(make(mine)),
            np.concatenate([base[2 * r : 2 * r + 2] + q for q in range(n)]),
            kind,
            f"{name} all_to_all",
        )
        red = mc.reduce(make(mine), 0)
        if r == 0:
            same(red, total, kind, f"{name} reduce")
        else:
            assert red is None
        same(mc.all_sum(make(mine), async_op=True).wait(), total, kind, f"{name} async all_sum")
        same(mc.all_sum(make_bf16(mine)), total, kind, f"{name} bfloat16 all_sum")
        if n > 1:  # a ring of sends; send returns what it was given
            x = make(mine)
            if r % 2 == 0:
                assert mc.send(x, (r + 1) % n) is x
                got = mc.recv_like(make(mine), (r - 1) % n)
            else:
                got = mc.recv_like(make(mine), (r - 1) % n)
                assert mc.send(x, (r + 1) % n) is x
            same(got, base + (r - 1) % n, kind, f"{name} recv_like")
        if name == "torch":  # out= a tensor: written in place, returned as given
            import torch

            out = torch.empty(2 * n, 3)
            assert mc.all_sum(make(mine), out=out) is out
            same(out, total, kind, "torch all_sum out=")
            t = make(mine)  # the same tensor as x and out: in place, as torch's own all_reduce
            assert mc.all_sum(t, out=t) is t
            same(t, total, kind, "torch all_sum(t, out=t)")
    print(f"CHECKED {checked}", flush=True)


if __name__ == "__main__":
    main()
