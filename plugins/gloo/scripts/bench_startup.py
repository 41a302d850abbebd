"""Start-up cost of the sealed rendezvous store: gloo's world group with and without AuthStore.

Each round starts N fresh processes per variant; every process imports torch first, says so,
and waits for the word to start (sent to all at once when all are ready), so imports are not timed.
Timed per rank: opening the TCPStore (rank 0 hosts it), the start-up nonce handshake (sealed variant only, as in the
backend), the start-up records (set own, get every rank's) and the ProcessGroupGloo
connecting to every rank. A round's figure is the slowest rank's time;
the script prints the median over rounds for each variant. Variants alternate round by round.

    python plugins/gloo/scripts/bench_startup.py --ranks 2 --ranks 4 --rounds 7
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time


def _rank(variant: str, rank: int, size: int, port: int) -> None:
    import torch.distributed as dist
    from meshcomm_gloo.authstore import AuthStore
    from meshcomm_gloo.sealing import Sealer
    from meshcomm_gloo.session import open_session

    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    inner = dist.TCPStore(
        "127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=60), wait_for_workers=True
    )
    store = inner if variant == "plain" else AuthStore(inner, Sealer(b"bench-secret", "bench"), rank=rank)
    if variant != "plain":
        open_session(store, rank, size)
    store.set(f"meshcomm/proc/{rank}", f"{socket.gethostname()} {os.getpid()}")
    for q in range(size):
        store.get(f"meshcomm/proc/{q}")
    pg = dist.ProcessGroupGloo(dist.PrefixStore("meshcomm/world", store), rank, size, datetime.timedelta(seconds=60))
    elapsed = time.perf_counter() - t0
    pg.barrier().wait()
    print(f"{elapsed:.6f}", flush=True)
    del pg


def _round(variant: str, size: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", variant, str(r), str(size), str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(size)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    times = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        if p.returncode != 0:
            raise SystemExit(f"a {variant} rank failed (exit {p.returncode})")
        times.append(float(out.split()[-1]))
    return max(times)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        variant, rank, size, port = sys.argv[2:6]
        _rank(variant, int(rank), int(size), int(port))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, action="append", help="job sizes (repeatable; default 2 and 4)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for size in args.ranks or [2, 4]:
        got: dict[str, list[float]] = {"plain": [], "sealed": []}
        for _ in range(args.rounds):
            for variant in got:
                got[variant].append(_round(variant, size))
        med = {v: statistics.median(t) * 1000 for v, t in got.items()}
        print(
            f"{size} ranks: plain TCPStore {med['plain']:.1f} ms, sealed AuthStore {med['sealed']:.1f} ms "
            f"(+{med['sealed'] - med['plain']:.1f} ms); median of {args.rounds} rounds of the slowest rank"
        )


if __name__ == "__main__":
    main()
