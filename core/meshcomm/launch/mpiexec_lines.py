"""mpiexec's own lines in ``meshcomm launch``'s output: prefixed ``[mpiexec]``, its failure
banners condensed to one line.

When a rank aborts, Open MPI's ``prterun`` prints 10-15-line banners framed by dashed rules
("MPI_ABORT was invoked on rank 1 ...", "prterun has exited due to process rank 1 ...") and
libevent's ``[warn] Epoll ... Bad file descriptor`` while it tears down; MPICH's Hydra frames
"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" in ``=`` rules. They restate what the
launcher's own last line says (which rank failed, why, its code), so each known banner
becomes one ``[mpiexec]`` line; an unknown banner (e.g. a start-up failure) is kept whole,
every line prefixed, since it may be the only explanation there is.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["MpiexecLines"]

_RULE = re.compile(rb"^\s*(?:-{20,}|={20,})\s*$")
#: banners that restate the launcher's summary: condensed to their first sentence
_KNOWN = (
    b"MPI_ABORT was invoked on rank",
    b"prterun has exited due to process rank",
    b"prterun detected that one or more processes exited",
    b"mpiexec has exited due to process rank",
    b"mpirun has exited due to process rank",
    b"mpiexec noticed that process rank",
    b"prterun noticed that process rank",
    b"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
)
#: libevent's complaint while prterun tears down the connections of aborted ranks
_NOISE = re.compile(rb"^\[warn\] Epoll \w+\(\d+\) on fd \d+ failed\..*Bad file descriptor\s*$")
#: longest condensed line, in bytes
_MAX = 240


class MpiexecLines:
    """Feed mpiexec's untagged lines one by one; ``emit(line)`` gets what should be shown."""

    def __init__(self, emit: Callable[[bytes], None]) -> None:
        self._emit = emit
        self._banner: list[bytes] | None = None
        self._rule = b""

    def feed(self, line: bytes) -> None:
        if self._banner is not None:
            if _RULE.match(line):
                self._close_banner(line)
            else:
                self._banner.append(line)
            return
        if _RULE.match(line):
            self._banner, self._rule = [], line
        elif not _NOISE.match(line):
            self._emit(line)

    def close(self) -> None:
        """The stream ended: an unfinished banner is shown as it came."""
        if self._banner is not None:
            self._emit(self._rule)
            for line in self._banner:
                self._emit(line)
            self._banner = None

    def _close_banner(self, rule: bytes) -> None:
        lines, self._banner = self._banner or [], None
        text = b" ".join(b" ".join(ln.split()) for ln in lines if ln.strip())
        if any(k in text for k in _KNOWN):
            first = text.split(b". ")[0].rstrip(b".")
            self._emit(first[:_MAX] + (b"..." if len(first) > _MAX else b"") + b"\n")
            return
        for line in (self._rule, *lines, rule):
            self._emit(line)
