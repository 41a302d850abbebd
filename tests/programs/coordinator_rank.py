"""One rank of a bare rendezvous (no backend): ``coordinator_rank.py HOST:PORT RANK SIZE [TIMEOUT]``.

Prints one JSON line: ``{"rank", "table"}`` on success, ``{"rank", "error", "message",
"peer"}`` on a DistributedError. The secret comes from MESHCOMM_JOB_SECRET.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from meshcomm.protocol.errors import DistributedError
from meshcomm.runtime.placement import parse_coordinator
from meshcomm_sockets.coordinator import exchange


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    coord = parse_coordinator(argv[0])
    rank, size = int(argv[1]), int(argv[2])
    timeout = float(argv[3]) if len(argv) > 3 else 60.0
    secret = os.environ.get("MESHCOMM_JOB_SECRET", "").encode()
    entry = {"rank": rank, "pid": os.getpid(), "note": os.environ.get("NOTE", "")}
    try:
        table = exchange(coord, rank, size, entry, secret=secret, timeout=timeout)
    except DistributedError as exc:
        print(
            json.dumps(
                {"rank": rank, "error": type(exc).__name__, "message": str(exc), "peer": getattr(exc, "peer", None)}
            ),
            flush=True,
        )
        return 1
    print(json.dumps({"rank": rank, "table": table}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
