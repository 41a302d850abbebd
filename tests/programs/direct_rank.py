"""A rank for the direct-read tests: report whether this job reads peers' arrays in place,
then run every collective around the size where the direct path starts, check each result
against NumPy, and print a digest of every result (the same bytes on either path).

usage: direct_rank.py [mismatch]   (MESHCOMM_TEST_UNSHARE=1: run this rank in a new PID namespace)
"""

import hashlib
import json
import os
import sys

if os.environ.pop("MESHCOMM_TEST_UNSHARE", "") == "1":  # a container's view: other pids mean nothing
    os.execvp("unshare", ["unshare", "--pid", "--fork", sys.executable, *sys.argv])

import meshcomm as mc
import numpy as np

g = mc.init(strict=True)
path = g.transport.path
r, n = g.rank(), g.size()
print(
    json.dumps({"rank": r, "path": path.name, "direct": getattr(getattr(path, "shm", None), "direct", None)}),
    flush=True,
)

if sys.argv[1:] == ["mismatch"]:
    try:  # rank 0 takes the direct path (16 MiB), the others the slots (8 B)
        mc.all_sum(np.ones((1 << 22) if r == 0 else 2, np.float32))
        print(json.dumps({"error": None}), flush=True)
    except mc.DistributedError as exc:
        print(json.dumps({"error": type(exc).__name__}), flush=True)
    sys.exit(0)

digest = hashlib.sha256()


def inputs(q: int, count: int, dtype: type) -> np.ndarray:
    rng = np.random.default_rng(1000 + q)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(count).astype(dtype)
    return rng.integers(-1000, 1000, count).astype(dtype)


def same(a: np.ndarray, b: np.ndarray, what: str) -> None:
    ok = np.array_equal(a, b) if a.dtype.kind != "f" else np.allclose(a, b, rtol=1e-5 * n, atol=1e-5 * n)
    if not ok:
        raise SystemExit(f"rank {r}: {what} differs from NumPy")


limit = 256 * 1024
for count_bytes in (limit - 4, limit, 3 * limit + 12, (4 << 20) + 8):
    for dtype in (np.float32, np.float64, np.int64):
        count = count_bytes // np.dtype(dtype).itemsize
        count -= count % n
        xs = [inputs(q, count, dtype) for q in range(n)]
        x = xs[r].copy()
        total = sum(xs[1:], xs[0].copy()) if np.dtype(dtype).kind != "f" else np.sum(xs, axis=0)
        got = mc.all_sum(x)
        same(got, total, f"all_sum {count} x {dtype.__name__}")
        digest.update(got.tobytes())
        y = x.copy()
        mc.all_sum(y, out=y)  # in place: peers read this rank's input while it writes
        assert np.array_equal(y, got), f"rank {r}: in-place all_sum differs from all_sum"
        same(mc.all_max(x), np.max(xs, axis=0), "all_max")
        part = mc.sum_scatter(x)
        m = count // n
        same(part, total[r * m : (r + 1) * m], "sum_scatter")
        gathered = mc.all_gather(x)
        assert np.array_equal(gathered, np.concatenate(xs)), f"rank {r}: all_gather"
        b = mc.broadcast(x, root=n - 1)
        assert np.array_equal(b, xs[n - 1]), f"rank {r}: broadcast"
        blocks = mc.all_to_all(x)  # block j of rank q's x goes to rank j
        want = np.concatenate([xs[q][r * m : (r + 1) * m] for q in range(n)])
        assert np.array_equal(blocks, want), f"rank {r}: all_to_all"
        for root in range(n):
            got = mc.gather(x, root=root)
            assert (got is None) == (r != root), f"rank {r}: gather returned {type(got)}"
            if r == root:
                assert np.array_equal(got, np.concatenate(xs)), f"rank {r}: gather"
            part = mc.scatter(x, root=root)
            assert np.array_equal(part, xs[root][r * m : (r + 1) * m]), f"rank {r}: scatter from {root}"
# all-reduces read peers directly from 16 MiB (shm.DIRECT_REDUCE_MIN_BYTES; 2 MiB on 2 ranks; below it
# the slots win); blocks of unequal size, every dtype, in place and all_max
for dtype in (np.float32, np.float64, np.int64):
    count = (16 << 20) // np.dtype(dtype).itemsize + 3  # not a multiple of 2, 3 or 4 ranks
    xs = [inputs(q, count, dtype) for q in range(n)]
    total = sum(xs[1:], xs[0].copy()) if np.dtype(dtype).kind != "f" else np.sum(xs, axis=0)
    got = mc.all_sum(xs[r])
    same(got, total, f"all_sum {count} x {dtype.__name__}")
    digest.update(got.tobytes())
    y = xs[r].copy()
    mc.all_sum(y, out=y)
    assert np.array_equal(y, got), f"rank {r}: in-place all_sum differs from all_sum"
    same(mc.all_max(xs[r]), np.max(xs, axis=0), "all_max")
    del xs, total, got, y
print(json.dumps({"digest": digest.hexdigest()}), flush=True)
