"""Before the group forms: every rank proves the job secret and learns where the others run.

Each rank writes ``meshcomm/proc/<rank>`` (host, pid and host key, sealed with the job secret over
this start-up's nonce by the :class:`.authstore.AuthStore`, see :mod:`.session`) and reads every
other rank's. A record whose tag does not verify names its rank: with three or more ranks, a
rank that cannot verify anyone has the wrong secret itself, and the others name it. A rank
that refused rank 0's nonce writes its refusal in its record instead, sealed over its own
challenge; rank 0 reads it as such and stops with it. A rank that rejects a record leaves
``meshcomm/rejected/<rank>`` (sealed) so that ranks stuck further on can say why the job
stopped (:func:`rejection_of_others`).
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from meshcomm.plugin import DistributedError

from .errors import StoreAuthError
from .liveness import RankProcess
from .session import Session

__all__ = ["admit", "rejection_of_others", "note_rejection"]

_PROC = "meshcomm/proc/"
_REJECTED = "meshcomm/rejected/"


def admit(store: Any, rank: int, size: int, session: Session) -> list[RankProcess]:
    """Publish where this rank runs (:class:`.liveness.RankProcess`); return every world rank's
    (index = rank).

    Raises StoreAuthError (naming the ranks whose records failed the job secret check, or the
    rank that refused this start-up's nonce, and the fix) instead of returning anything a
    stranger could have written or replayed.
    """
    if session.refused is not None:  # the others must not wait for this rank's record: it says why
        store.set(f"{_PROC}{rank}", str(session.refused)[:2000])
        raise session.refused
    store.set(f"{_PROC}{rank}", json.dumps(RankProcess.here().encode()))
    peers: list[RankProcess | None] = []
    bad: dict[int, StoreAuthError] = {}
    refusals: dict[int, str] = {}
    for q in range(size):
        try:
            peers.append(RankProcess.decode(json.loads(store.get(f"{_PROC}{q}").decode())))
        except StoreAuthError as exc:
            said = _refusal(store, q, session)
            if said is not None:
                refusals[q] = said
            else:  # a forged challenge says more than the refusal it caused
                bad[q] = session.unanswered.get(q, exc)
            peers.append(None)
        except (UnicodeDecodeError, ValueError, TypeError) as exc:  # sealed by a rank, so a bug, not an attack
            raise DistributedError(f"[gloo] rank {rank}: rank {q}'s start-up record is malformed: {exc}") from exc
    if refusals:
        q = min(refusals)
        err = StoreAuthError(
            f"[gloo] rank {rank}: start-up refused: rank {q} did not take this start-up's nonce, "
            f"so the job cannot start. Rank {q} said: {refusals[q]}",
            key=f"{_PROC}{q}",
            peer=q,
        )
        note_rejection(store, rank, str(err))
        raise err
    if bad:
        raise _verdict(store, rank, size, bad, session.doubt)
    return [p for p in peers if p is not None]


def _refusal(store: Any, q: int, session: Session) -> str | None:
    """What rank ``q`` said when it refused the nonce, if its record is its refusal (rank 0 only:
    the refusal is sealed over q's challenge, which only rank 0 read)."""
    if q not in session.challenges:
        return None
    try:
        return bytes(store.get_over(f"{_PROC}{q}", session.challenges[q])).decode(errors="replace")
    except StoreAuthError:
        return None


def _verdict(
    store: Any, rank: int, size: int, bad: dict[int, StoreAuthError], doubt: StoreAuthError | None = None
) -> StoreAuthError:
    others = [q for q in range(size) if q != rank]
    first = next(iter(bad.values()))
    replayed = all(e.replayed for e in bad.values())  # sealed with this secret for another start-up
    if doubt is not None and not (size >= 3 and sorted(bad) == others):
        why = (
            "this rank could not verify rank 0's answer with this start-up's nonce, so no record of this "
            f"start-up can pass here: {doubt}"
        )
        first = doubt
    elif rank in bad:
        how = (
            "with a record of another start-up (replayed from an earlier job with the same secret)"
            if bad[rank].replayed
            else "by a process without the job secret"
        )
        why = (
            f"this rank's own record (rank {rank}) was overwritten {how} after this rank wrote it: a stranger is "
            "writing to the rendezvous store"
        )
    elif size >= 3 and sorted(bad) == others and not replayed:
        why = (
            f"no other rank's record passes this rank's check: this rank (rank {rank}) has a different "
            "MESHCOMM_JOB_SECRET (or job id) than all the others"
        )
    else:
        names = ", ".join(f"rank {q}" for q in sorted(bad))
        one = len(bad) == 1
        if replayed:
            why = (
                f"the records of {names} belong to another start-up: a process without the job secret wrote "
                "records of an earlier job with the same MESHCOMM_JOB_SECRET in their place (a replay), or "
                f"{names} refused this start-up's nonce ({'its' if one else 'their'} own error then says why)"
            )
        else:
            why = (
                f"the records of {names} failed the check: {names} {'was' if one else 'were'} started with "
                "another MESHCOMM_JOB_SECRET (or none, or another job id), or a stranger wrote in their place"
            )
    err = StoreAuthError(
        f"[gloo] rank {rank}: start-up refused: {why}. First refusal: {first}",
        key=first.key,
        peer=None if rank in bad else min(bad),
        replayed=replayed and doubt is None,
    )
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
