"""Ranks lose some of their number and go on: run under ``meshcomm launch --keep-going``.

``--kind`` says how the ranks in ``--lose`` (comma-separated world ranks) fail inside the
second all_sum: ``sigkill``, ``raise``, ``exit`` (sys.exit(3)), ``sigstop`` (the first
survivor resumes them once the survivors finished; they must then raise, not go on) or
``split`` (half the survivors see the loss of one rank, half of another: the lost ranks
wait for different peers before they die), ``during`` (the first lost rank is killed, the
last one dies ``--delay`` seconds into the survivors' shrink: they shrink until a barrier
passes), ``absent`` (the same, but the last one never calls shrink: it dies ``--delay``
seconds after the loss while the others wait for it inside theirs) or ``external`` (every rank sums in a loop until
the test takes the lost ranks away, e.g. their host's network and processes). Every survivor catches the error, calls
``world.shrink()``, checks the new world (its size, its rank in the old order) and prints
``RESULT ok`` when the next all_sum gives the right sum, ``RESULT WRONG`` otherwise; then
``AGREE True False 5`` from three ``world.agree`` calls (all true; false on one rank;
bitwise AND of 0b0111 and 0b1101). Ranks the others gave up on print
``EXCLUDED <error>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import meshcomm as mc
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--kind", required=True)
p.add_argument("--lose", default="1")
p.add_argument("--elements", type=int, default=16)
p.add_argument("--marker", default="", help="ignored: names the job's processes for the test")
p.add_argument("--grow", action="store_true", help="then wait for the launcher's replacements and grow back")
p.add_argument("--stranger", action="store_true", help="then a process with another secret tries to join")
p.add_argument("--delay", type=float, default=0.03, help="--kind during: seconds into shrink the last lost rank dies")
args = p.parse_args()
lose = sorted(int(r) for r in args.lose.split(","))


def grown(world: mc.Group) -> None:
    """The whole world again: a sum over every rank, state from rank 0, an agreement."""
    total = world.all_sum(np.full(args.elements, world.rank() + 1, np.float32))
    state = world.broadcast(np.arange(4, dtype=np.int64) * 7, root=0)
    good = bool(np.all(total == sum(range(1, world.size() + 1)))) and state.tolist() == [0, 7, 14, 21]
    print(f"GROWN {'ok' if good else 'WRONG'} size={world.size()} rank={world.rank()} agree={world.agree(True)}")
    sys.stdout.flush()


def stranger_phase(world: mc.Group) -> None:
    """Rank 0 starts a process with the job's addresses but not its secret; the world calls
    grow() past the stranger's MLX_TIMEOUT and must stay as it is."""
    stranger = None
    if world.rank() == 0:
        env = {k: v for k, v in os.environ.items() if k != "MESHCOMM_SOCKETS_LISTEN_FD"}
        env.update(MESHCOMM_JOIN="1", MESHCOMM_JOB_SECRET="not-the-job-secret", MLX_TIMEOUT="2")
        argv = [sys.executable, __file__, "--kind", args.kind, "--marker", args.marker]
        stranger = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(60):  # a count, not a clock: every rank must make the same number of calls
        world = world.grow()  # 60 x 0.05 s: past the stranger's MLX_TIMEOUT of 2 s
        time.sleep(0.05)
    if stranger is not None:
        out = stranger.communicate(timeout=30)[0]
        print(
            f"STRANGER rc={stranger.returncode} joined={'JOINED' in out} timeout={'CommTimeoutError' in out} "
            f"secret-check={'failed the job secret check' in out}"
        )
    print(f"AFTER-STRANGER size={world.size()} agree={world.agree(True)}", flush=True)


if os.environ.get("MESHCOMM_JOIN") == "1":  # a replacement the launcher started: it joins when the others grow
    world = mc.init(strict=True)
    print(f"JOINED as rank {world.rank()} of {world.size()}", flush=True)
    grown(world)
    if args.stranger:
        stranger_phase(world)
    sys.exit(0)

world = mc.init(strict=True)
rank, size = world.rank(), world.size()
pids = world.all_gather(np.array([os.getpid()], np.int64))
x = np.full(args.elements, rank + 1, np.float32)
first = world.all_sum(x)
assert float(first[0]) == size * (size + 1) / 2
print("READY", flush=True)

try:
    if rank in lose:
        # MPI may still be sending this rank's part of the first sum when it returned: a death
        # right away can fail that sum on its peers (the data was in flight), not the next one
        time.sleep(0.2)
        print(f"DYING at {time.time():.6f}", flush=True)
        if args.kind == "sigkill" or args.kind in ("during", "absent") and rank == lose[0]:
            os.kill(os.getpid(), signal.SIGKILL)
        elif args.kind == "raise":
            raise RuntimeError(f"rank {rank} fails on purpose")
        elif args.kind == "exit":
            sys.exit(3)
        elif args.kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif args.kind == "split":
            time.sleep(0.3)
            os._exit(9)
    if args.kind == "external":  # the test takes the lost ranks' host away while every rank sums
        while True:
            world.all_sum(x)
            time.sleep(0.01)
    if args.kind == "split":  # half the survivors wait on one lost rank, half on the other
        alive = [r for r in range(size) if r not in lose]
        world.recv((1,), np.float32, lose[alive.index(rank) % 2])
    else:
        world.all_sum(x)
    print("RESULT NO-FAILURE", flush=True)
except mc.DistributedError as exc:
    print(f"CAUGHT {type(exc).__name__} peer={getattr(exc, 'peer', None)}", flush=True)

if args.kind == "during" and rank == lose[-1]:  # the last lost rank dies inside the survivors' shrink
    threading.Timer(args.delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
if args.kind == "absent" and rank == lose[-1]:  # it never comes to the shrink, and dies while the others wait in it
    time.sleep(args.delay)
    os.kill(os.getpid(), signal.SIGKILL)
t0 = time.monotonic()
shrinks = 0
while True:  # a rank may die during the shrink or right after it: shrink again until a barrier passes
    shrinks += 1
    try:
        world = world.shrink()
    except mc.DistributedError as exc:
        if "gave up on this rank" in str(exc):
            print(f"EXCLUDED {exc}", flush=True)
            sys.exit(1)
        if shrinks < 3 and not isinstance(exc, mc.NotSupportedError):
            print(f"SHRINK AGAIN {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"SHRINK-FAILED {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    try:
        world.barrier()
        break
    except mc.DistributedError as exc:
        print(f"LOST AGAIN {type(exc).__name__} peer={getattr(exc, 'peer', None)}", flush=True)
print(f"SHRUNK in {time.monotonic() - t0:.3f} s ({shrinks} shrink(s))", flush=True)
survivors = [r for r in range(size) if r not in lose]
ok = world.size() == len(survivors) and world.rank() == survivors.index(rank)
total = world.all_sum(np.full(args.elements, rank + 1, np.float32))
want = sum(r + 1 for r in survivors)
ok = ok and bool(np.all(total == want))
print(f"FIRST-COLLECTIVE {time.monotonic() - t0:.3f} s, at {time.time():.6f}", flush=True)
print(f"RESULT {'ok' if ok else 'WRONG'} size={world.size()} rank={world.rank()} sum={float(total[0])}", flush=True)
agreed = (world.agree(True), world.agree(world.rank() != 0), world.agree(0b1101 if world.rank() else 0b0111))
print("AGREE", *agreed, flush=True)
world.barrier()
if args.grow:
    t0 = time.monotonic()
    while world.size() < size and time.monotonic() - t0 < 60:
        world = world.grow()  # admits whoever waits now; nobody: the same world, at once
        time.sleep(0.02)
    print(f"GREW to {world.size()} in {time.monotonic() - t0:.3f} s", flush=True)
    grown(world)
if args.stranger:
    stranger_phase(world)
if args.kind == "sigstop" and world.rank() == 0:  # resume the stopped ranks: they must raise, not go on
    for r in lose:
        try:
            os.kill(int(pids[r]), signal.SIGCONT)
        except ProcessLookupError:  # mpi: the survivors ended it (MPI sees only ended processes as failed)
            print(f"ENDED BY THE SURVIVORS rank {r}", flush=True)
