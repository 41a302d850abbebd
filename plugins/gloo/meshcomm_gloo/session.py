"""A fresh nonce for every start-up, drawn by rank 0, so that no value of an earlier job passes.

With the same secret and no job id (ranks started by hand, under srun or mpirun), a value
recorded in an earlier job would verify in this one. So every rank q > 0 writes a fresh random
challenge (``meshcomm/session/hello/<q>``), rank 0 answers with its own fresh nonce ‖ that
challenge (``meshcomm/session/nonce/<q>``), and a rank takes the nonce only if the answer
carries its own challenge; from then on every value is sealed over (secret, job id, nonce)
(:meth:`.authstore.AuthStore.begin`), and rank 0 never reads a nonce from the store. A replayed
answer carries an earlier job's challenge, so the rank refuses it (:class:`StoreAuthError`) and
seals its start-up record over its own challenge, which rank 0 read and so recognises the
record as a refusal: both stop at once; any other value of an earlier job
carries that job's nonce and fails (:mod:`.admission`). Rank 0 answers only once every
challenge is there; when some never come within the timeout, it answers the ranks that wrote
theirs with the numbers of the missing ones, so that every rank that started names them.

Not protected: two jobs running at the same time with the same secret, whose start-ups a relay
between their stores can cross; give every job its own secret. Imports nothing of torch.
"""

from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass, field
from typing import Any

from meshcomm.plugin import CommTimeoutError

from .errors import StoreAuthError, store_timed_out
from .sealing import short

__all__ = ["Session", "open_session", "NONCE_BYTES"]

NONCE_BYTES = 16
_HELLO = "meshcomm/session/hello/"
_ANSWER = "meshcomm/session/nonce/"
#: rank 0's answer when ranks never wrote their challenge: this, then their numbers (never 32 bytes)
_MISSING = b"meshcomm: never reached the store: "
#: how much longer than the store's timeout a rank waits for rank 0's answer
_ANSWER_GRACE = datetime.timedelta(seconds=2)
_FIX = (
    "not started, crashed before init(), or started with another store address or world size: check "
    "MLX_WORLD_SIZE (or the scheduler's) and MESHCOMM_GLOO_ADDR/PORT (or MLX_COORDINATOR) on every rank"
)


@dataclass(frozen=True)
class Session:
    """What this rank agreed on at start-up.

    ``challenges`` (rank 0 only): the challenge rank 0 answered for each rank, so that it can
    read a refusal sealed over it; ``unanswered`` (rank 0 only): why a rank's challenge could
    not be read (it failed the secret check; that rank will refuse). ``refused``: this rank did
    not take the nonce it was given (replayed or changed); its start-up record is then a
    refusal. ``doubt``: the answer failed the secret check (another secret or job id on this
    rank, or a stranger's value); no value of this start-up can pass on this rank then, and
    admission names the ranks.
    """

    nonce: bytes
    challenges: dict[int, bytes] = field(default_factory=dict)
    unanswered: dict[int, StoreAuthError] = field(default_factory=dict)
    refused: StoreAuthError | None = None
    doubt: StoreAuthError | None = None


def open_session(store: Any, rank: int, size: int) -> Session:
    """Agree on this start-up's nonce and seal ``store`` (an AuthStore) over it.

    Blocks until rank 0 answered (rank q > 0) or every other rank wrote its challenge (rank 0),
    at most the store's timeout. Ranks that never wrote theirs by then are named to every rank
    that did (CommTimeoutError on each): rank 0 answers them with the numbers instead of a nonce.
    """
    if rank == 0:
        _await_challenges(store, size)
        nonce = secrets.token_bytes(NONCE_BYTES)
        challenges: dict[int, bytes] = {}
        unanswered: dict[int, StoreAuthError] = {}
        for q in range(1, size):
            try:
                challenges[q] = bytes(store.get(f"{_HELLO}{q}"))
            except StoreAuthError as exc:  # answered with no challenge: rank q refuses it, admission names q
                unanswered[q] = exc
            store.set(f"{_ANSWER}{q}", nonce + challenges.get(q, b""))
        store.begin(nonce)
        return Session(nonce, challenges, unanswered)
    mine = secrets.token_bytes(NONCE_BYTES)
    store.set(f"{_HELLO}{rank}", mine)
    # rank 0 answers within its timeout, when every rank's challenge is there or it gives up on
    # the missing ones: wait a little longer, so that its answer naming them comes first
    store.wait([f"{_ANSWER}{rank}"], store.timeout + _ANSWER_GRACE)
    try:
        answer = bytes(store.get(f"{_ANSWER}{rank}"))
    except StoreAuthError as exc:
        store.begin(secrets.token_bytes(NONCE_BYTES))  # nothing can pass: admission says who differs
        return Session(b"", doubt=exc)
    if answer.startswith(_MISSING):
        missing = answer[len(_MISSING) :].decode(errors="replace")
        try:
            store.set(f"{_ANSWER}{rank}/read", b"1")  # rank 0 keeps its store up until then
        except Exception:  # noqa: BLE001 - rank 0 left already: the error below says it all
            pass
        raise CommTimeoutError(
            f"[gloo] rank {rank}: start-up stopped: rank 0 says rank(s) {missing} never reached the {store.where} "
            f"within MLX_TIMEOUT: {_FIX}.",
            peer=int(missing.split(",")[0]) if missing.split(",")[0].isdigit() else None,
        )
    nonce, echo = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if len(nonce) == NONCE_BYTES and echo == mine:
        store.begin(nonce)
        return Session(nonce)
    store.begin(mine)  # this rank's refusal can be read by rank 0 only, which read this challenge
    key = f"{_ANSWER}{rank}"
    reach = "let only the job's hosts reach the store's port"
    if len(nonce) == NONCE_BYTES and not echo:
        why = (
            f"rank 0 answered no challenge: this rank's challenge in '{_HELLO}{rank}' failed rank 0's secret "
            "check, so a process without the job secret overwrote it"
        )
        fix = reach
    else:
        why = (
            f"it answers the challenge {short(echo)}, not the challenge {short(mine)} this rank wrote, so it was "
            "written for another start-up: recorded from an earlier job that used the same MESHCOMM_JOB_SECRET "
            "and replayed here (the answer, or the challenge rank 0 read in this rank's place)"
        )
        fix = f"give every job its own MESHCOMM_JOB_SECRET (meshcomm launch makes a fresh one per job) and {reach}"
    return Session(
        b"",
        refused=StoreAuthError(
            f"[gloo] rank {rank}: refused the start-up nonce in {key!r}: {why}. Nothing of it was used. Fix: {fix}.",
            key=key,
            peer=0,
        ),
    )


def _await_challenges(store: Any, size: int) -> None:
    """Rank 0: wait (the store's timeout) until every other rank wrote its challenge; if some
    never did, tell the ones that did and raise CommTimeoutError naming the missing ranks."""
    keys = {q: f"{_HELLO}{q}" for q in range(1, size)}
    try:
        store.wait(list(keys.values()))
        return
    except Exception as exc:  # noqa: BLE001 - sorted out by its text
        if not store_timed_out(exc):
            raise
    missing = [q for q, key in keys.items() if not store.check([key])]
    if not missing:
        return
    note = _MISSING + ",".join(map(str, missing)).encode()
    told = [q for q in keys if q not in missing]
    for q in told:
        store.set(f"{_ANSWER}{q}", note)
    try:  # the store lives in this process: keep it up until they read it (at most 2 s)
        store.wait([f"{_ANSWER}{q}/read" for q in told], datetime.timedelta(seconds=2))
    except Exception:  # noqa: BLE001 - a rank that does not read it times out on its own
        pass
    seconds = store.timeout.total_seconds()
    raise CommTimeoutError(
        f"[gloo] rank 0: start-up stopped after {seconds:g} s (MLX_TIMEOUT): rank(s) "
        f"{', '.join(map(str, missing))} of {size} never reached the {store.where}: {_FIX}.",
        peer=missing[0],
    )
