"""Which rank ended the job: the first one that failed for its own reason.

When one rank fails, its peers fail too, with ``PeerLostError`` or ``CommTimeoutError``
naming it, often before the failed rank's process has finished exiting. The launcher
therefore blames from the ranks' failure records (:mod:`meshcomm.runtime.exits`): records that are
a consequence of a peer are skipped; a rank that exited non-zero without a record, or was
killed by a signal, failed for its own reason. Only when no rank did (a rank that stopped
answering, or exited 0 while its peers still needed it) is the peer the records name blamed,
or else the first rank that was still running without a record.
Without any record, the old rule applies: the first failure seen that is not status 1.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Failure", "Verdict", "blame", "exit_code", "describe_status"]


@dataclass(frozen=True)
class Failure:
    """A rank's process ended with a non-zero status (negative: killed by that signal)."""

    rank: int
    status: int
    seen: float  #: ``time.time()`` when the launcher noticed


@dataclass(frozen=True)
class Verdict:
    rank: int
    code: int  #: the exit code ``meshcomm launch`` returns
    text: str  #: what happened to ``rank``, e.g. ``exited with code 3``
    #: True when ``rank`` left no record of its own and its peers' records say it was lost
    #: (killed): ``code`` is then only a survivor's, and the MPI launcher's status tells more
    lost: bool = False


def exit_code(status: int) -> int:
    """A shell's exit code for a process status (``-9`` -> 137)."""
    return 128 - status if status < 0 else status


def describe_status(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with code {status}"


def _record_text(rec: dict[str, Any]) -> str:
    code = int(rec.get("code", 1))
    if rec.get("type") == "SystemExit":
        return f"exited with code {code}"
    return f"exited with code {code} ({rec.get('reason') or rec.get('type')})"


def blame(failures: list[Failure], records: list[dict[str, Any]], running: Sequence[int] = ()) -> Verdict | None:
    """The rank to name in the summary and the job's exit code, or None if nothing failed.

    ``running``: ranks still running when the launcher stopped the job; when every record
    is a consequence and none names a peer, the first of them without a record is blamed.
    """
    recorded = {r.get("rank") for r in records}
    own: list[tuple[float, int, Verdict]] = []
    for rec in records:
        if not rec.get("consequence") and isinstance(rec.get("rank"), int):
            code = int(rec.get("code", 1)) or 1
            own.append((float(rec.get("time", 0.0)), 0, Verdict(rec["rank"], code, _record_text(rec))))
    for f in failures:
        if f.rank not in recorded:
            own.append((f.seen, 1, Verdict(f.rank, exit_code(f.status), describe_status(f.status))))
    if own:
        return min(own, key=lambda t: (t[0], t[1]))[2]
    peers = [r for r in records if isinstance(r.get("peer"), int)]
    if peers:
        first = peers[0]
        verb = "did not answer in time" if first.get("type") == "CommTimeoutError" else "was lost"
        text = f"{verb} (rank {first.get('rank')} raised {first.get('type')}: {first.get('message')})"
        return Verdict(
            int(first["peer"]), int(first.get("code", 1)) or 1, text, lost=first.get("type") == "PeerLostError"
        )
    silent = [r for r in running if r not in recorded]
    if records and silent:
        first = records[0]
        text = (
            f"did not answer in time (still running when rank {first.get('rank')} raised "
            f"{first.get('type')}: {first.get('message')})"
        )
        return Verdict(silent[0], int(first.get("code", 1)) or 1, text)
    for f in failures:  # no records at all: status 1 is how ranks that lost a peer end
        if f.status != 1:
            return Verdict(f.rank, exit_code(f.status), describe_status(f.status))
    if failures:
        f = failures[0]
        return Verdict(f.rank, exit_code(f.status), describe_status(f.status))
    return None
