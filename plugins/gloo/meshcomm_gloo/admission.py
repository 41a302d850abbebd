"""Before the group forms: every rank proves the job secret and learns where the others run.

Each rank writes ``meshcomm/proc/<rank>`` (``host pid``, sealed with the job secret by
the :class:`.authstore.AuthStore`) and reads every other rank's. A record whose tag does
not verify names its rank: with three or more ranks, a rank that cannot verify anyone
has the wrong secret itself, and the others name it. A rank that rejects a record
leaves ``meshcomm/rejected/<rank>`` (sealed) so that ranks stuck further on can say why
the job stopped (:func:`rejection_of_others`).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from meshcomm.plugin import DistributedError

from .errors import StoreAuthError
from .liveness import RankProcess

__all__ = ["admit", "rejection_of_others", "note_rejection"]

_PROC = "meshcomm/proc/"
_REJECTED = "meshcomm/rejected/"


def admit(store: Any, rank: int, size: int) -> list[RankProcess]:
    """Publish this rank's host and pid and return every world rank's (index = rank).

    Raises StoreAuthError (naming the ranks whose records failed the job secret check and
    the fix) instead of returning anything a stranger could have written.
    """
    store.set(f"{_PROC}{rank}", f"{socket.gethostname()} {os.getpid()}")
    peers: list[RankProcess | None] = []
    bad: dict[int, StoreAuthError] = {}
    for q in range(size):
        try:
            host, _, pid = store.get(f"{_PROC}{q}").decode().rpartition(" ")
            peers.append(RankProcess(host, int(pid)))
        except StoreAuthError as exc:
            bad[q] = exc
            peers.append(None)
        except (UnicodeDecodeError, ValueError) as exc:  # sealed by a rank, so a bug, not an attack
            raise DistributedError(f"[gloo] rank {rank}: rank {q}'s start-up record is malformed: {exc}") from exc
    if bad:
        raise _verdict(store, rank, size, bad)
    return [p for p in peers if p is not None]


def _verdict(store: Any, rank: int, size: int, bad: dict[int, StoreAuthError]) -> StoreAuthError:
    others = [q for q in range(size) if q != rank]
    first = next(iter(bad.values()))
    if rank in bad:
        why = (f"this rank's own record (rank {rank}) was overwritten by a process without the job secret after "
               "this rank wrote it: a stranger is writing to the rendezvous store")
    elif size >= 3 and sorted(bad) == others:
        why = (f"no other rank's record passes this rank's check: this rank (rank {rank}) has a different "
               "MESHCOMM_JOB_SECRET (or job id) than all the others")
    else:
        names = ", ".join(f"rank {q}" for q in sorted(bad))
        why = (f"the records of {names} failed the check: {names} {'was' if len(bad) == 1 else 'were'} started "
               "with another MESHCOMM_JOB_SECRET (or none, or another MESHCOMM_JOB_ID), or a stranger wrote "
               "in their place")
    err = StoreAuthError(f"[gloo] rank {rank}: start-up refused: {why}. First refusal: {first}",
                         key=first.key, peer=None if rank in bad else min(bad))
    note_rejection(store, rank, str(err))
    return err


def note_rejection(store: Any, rank: int, text: str) -> None:
    """Leave why this rank stopped start-up, for the ranks still waiting (best effort)."""
    try:
        store.set_timeout(datetime.timedelta(seconds=1))
        store.set(f"{_REJECTED}{rank}", text[:2000])
    except Exception:  # noqa: BLE001 - the store may be gone; the error is raised anyway
        pass


def rejection_of_others(store: Any, rank: int, size: int) -> tuple[int, str] | None:
    """(rank, what it said) of another rank that refused start-up, if one did (None otherwise)."""
    try:
        store.set_timeout(datetime.timedelta(seconds=1))
        for q in range(size):
            if q != rank and store.check([f"{_REJECTED}{q}"]):
                return q, bytes(store.get(f"{_REJECTED}{q}")).decode()
    except Exception:  # noqa: BLE001 - store unreachable or its value forged: nothing to add
        return None
    return None
