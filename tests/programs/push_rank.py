"""A rank for the push-path tests (large all-reduce results in shared memory, results.py).

Every rank keeps results while making more calls and checks that none it keeps changes;
prints one JSON line: whether each kept result is in shared memory, the addresses that
show a dropped result's buffer being reused, and a digest of every result.

usage: push_rank.py [uneven|die]
(die: rank 1 is killed between calls; uneven: rank 0 keeps more results than the others, so
one of its results is private while theirs are shared: that call mixes pushing and reading)
"""

import hashlib
import json
import os
import signal
import sys

import meshcomm as mc
import numpy as np
from meshcomm_sockets.results import SLOTS
from meshcomm_sockets.shm import _PUSHED

g = mc.init(strict=True)
r, n = g.rank(), g.size()
shm = getattr(g.transport.path, "shm", None)
# all_sum takes the direct path from 16 MiB on any number of ranks (shm.DIRECT_REDUCE_MIN_BYTES)
count = ((16 << 20) + 4 * 12) // 4
digest = hashlib.sha256()


def shared(a: np.ndarray) -> bool:
    """Whether ``a`` is on one of this rank's shared result buffers."""
    return shm is not None and shm.results.find(a.ctypes.data, a.nbytes) is not None


_random: dict[np.dtype, np.ndarray] = {}


def inputs(q: int, k: int, dtype: type = np.float32) -> np.ndarray:
    """Rank ``q``'s input of call ``k`` (q < 16): a window of one random array per dtype, at an
    offset of its own. Generating 16 MiB per call took most of a rank's time (6 s in 60 calls)."""
    dt = np.dtype(dtype)
    if dt not in _random:
        _random[dt] = (np.random.default_rng(1000).standard_normal(count + 256) * 100).astype(dt)
    at = 1 + q + 16 * k
    return _random[dt][at : at + count].copy()


def expect(k: int, dtype: type = np.float32) -> np.ndarray:
    xs = [inputs(q, k, dtype) for q in range(n)]
    out = xs[0] + xs[1]  # the rank order every path sums in
    for x in xs[2:]:
        out += x
    return out


if sys.argv[1:] == ["die"]:  # rank 1 is killed between large calls; rank 0 must hear of it
    for k in range(3):
        g.all_sum(inputs(r, k))
    if r == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        g.all_sum(inputs(r, 3))
        print(json.dumps({"rank": r, "error": None}), flush=True)
    except mc.DistributedError as exc:
        print(json.dumps({"rank": r, "error": type(exc).__name__, "peer": getattr(exc, "peer", None)}), flush=True)
    sys.exit(0)

kept = {}
uneven = sys.argv[1:] == ["uneven"]
# even: every rank keeps its first SLOTS results, so call SLOTS's results are all private;
# uneven: rank 0 keeps every one up to call SLOTS (that one private), the others only the
# first, so in call SLOTS rank 0 reads while the others are written into
for k in range(SLOTS + 1):
    got = g.all_sum(inputs(r, k))
    if (k < SLOTS and not uneven) or (uneven and (r == 0 or k == 0)):
        kept[k] = got
    del got  # not held during the next call
# whose results each local rank wrote its block into, in call SLOTS
pushed_2 = [int(m) for m in shm.ctrl[:, _PUSHED]] if shm is not None else None
first_address = kept[0].ctypes.data
for k in range(3, 7):  # more calls while those are held (results dropped at once)
    got = g.all_sum(inputs(r, k))
    if not np.array_equal(got, expect(k)):
        raise SystemExit(f"rank {r}: all_sum {k} differs from NumPy")
    digest.update(got.tobytes())
for k, a in kept.items():
    if not np.array_equal(a, expect(k)):
        raise SystemExit(f"rank {r}: kept result {k} was changed by a later call")
    digest.update(a.tobytes())
shared_kept = [shared(a) for a in kept.values()]
del a, got  # the loops' names hold results too
views = kept[0][1:].reshape(-1)  # a view keeps the buffer in use too
del kept[0]
still = g.all_sum(inputs(r, 7))
reused_while_viewed = still.ctypes.data == first_address
del views, still
again = g.all_sum(inputs(r, 8))
reused_after_drop = again.ctypes.data == first_address and shared(again)
if not np.array_equal(again, expect(8)):
    raise SystemExit(f"rank {r}: all_sum 8 differs from NumPy")
# ... and in call 8 (every result shared)
pushed = [int(m) for m in shm.ctrl[:, _PUSHED]] if shm is not None else None
for dtype in (np.float64, np.int64):  # other dtypes, and all_max (NumPy's reduction on every path)
    x = inputs(r, 9, dtype)
    if not np.array_equal(g.all_sum(x), expect(9, dtype)):
        raise SystemExit(f"rank {r}: all_sum of {np.dtype(dtype).name} differs from NumPy")
    want = np.max([inputs(q, 9, dtype) for q in range(n)], axis=0)
    if not np.array_equal(g.all_max(x), want):
        raise SystemExit(f"rank {r}: all_max of {np.dtype(dtype).name} differs from NumPy")
y = g.all_sum(inputs(r, 10))
g.all_sum(y, out=y)  # in place on a shared result: peers read it and write into it
if not np.array_equal(y, expect(10) * n):
    raise SystemExit(f"rank {r}: in-place all_sum on a shared result differs")
last = g.all_sum(inputs(r, 11))
g.close()
survives = bool(np.array_equal(last, expect(11)))  # the caller's array outlives the group
print(
    json.dumps(
        {
            "rank": r,
            "direct": getattr(shm, "direct", None),
            "shared_kept": shared_kept,
            "reused_while_viewed": reused_while_viewed,
            "reused_after_drop": reused_after_drop,
            "survives_close": survives,
            "pushed_2": pushed_2,
            "pushed": pushed,
            "digest": digest.hexdigest(),
        }
    ),
    flush=True,
)
