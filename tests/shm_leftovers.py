"""MPI libraries' shared-memory files that a job ended by MPI_Abort or a kill leaves in /dev/shm.

Open MPI names them ``sm_segment.*`` (``vader_segment.*`` in 4.x), MPICH ``mpich_shm_*``;
they are unlinked at MPI_Finalize only. The suite ends many MPI jobs by failure on purpose,
so it removes those it created: present now but not at the start, owned by this user, and
mapped by no live process (a running job of someone else keeps its files).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

__all__ = ["snapshot", "remove_new", "main"]

SHM = Path("/dev/shm")
PATTERN = re.compile(r"^(sm_segment\.|vader_segment\.|mpich_shm_)")


def _candidates() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if PATTERN.match(n)}
    except OSError:
        return set()


def snapshot() -> set[str]:
    """The MPI shared-memory files present now."""
    return _candidates()


def _mapped() -> set[str]:
    names: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        names.add(line[i + 9 :].split(" (deleted)")[0].strip())
        except OSError:
            continue
    return names


def remove_new(before: set[str]) -> list[str]:
    """Remove MPI shared-memory files created since ``before`` that nobody maps; their names."""
    new = _candidates() - before
    if not new:
        return []
    busy = _mapped()
    removed = []
    for name in sorted(new - busy):
        path = SHM / name
        try:
            if path.stat().st_uid == os.getuid():
                path.unlink()
                removed.append(name)
        except OSError:
            pass
    return removed


def main(argv: list[str]) -> int:
    """``mark FILE``: note the files present now in FILE; ``remove FILE``: remove those made
    since that nobody maps (the test scripts' last sweep, after every pytest run ended)."""
    if len(argv) != 2 or argv[0] not in ("mark", "remove"):
        print("usage: shm_leftovers.py mark|remove FILE", file=sys.stderr)
        return 2
    path = Path(argv[1])
    if argv[0] == "mark":
        path.write_text("".join(f"{n}\n" for n in sorted(snapshot())))
        return 0
    before = set(path.read_text().split()) if path.exists() else snapshot()
    for name in remove_new(before):
        print(f"removed /dev/shm/{name} (an MPI job's shared memory that outlived it)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
