"""Growing a gloo world: newcomers ask through the rendezvous store, the world admits them in ``grow()``.

A newcomer (``mc.init(join=True)``, e.g. a replacement ``meshcomm launch --restart-lost``
started) connects to the store as a client and proves the job secret as a start-up rank
does (:mod:`.session`), under keys of its own:

1. it takes a number from the sealed counter ``meshcomm/session/join/count`` and writes a
   fresh challenge under ``meshcomm/session/join/hello/<n>``;
2. the world's rank 0 (the store's host), in its next ``grow()``, answers with the
   start-up's nonce and that challenge (``.../nonce/<n>``); a hello that fails the secret
   check is never answered;
3. the newcomer takes the nonce only if it carries its own challenge, and writes where it
   runs under ``meshcomm/join/<n>``, sealed over the nonce like every start-up record;
4. rank 0 admits every newcomer whose record is there (waiting up to a second for the ones
   it has just answered), writes the decision for the world under the world's prefix and
   each newcomer's admission (its rank, the new size and prefix) under
   ``meshcomm/join/<n>/admit``; then all of them form a ProcessGroupGloo under the new prefix.

A process without the job secret cannot seal a record that verifies, so it is never
admitted; its own ``init`` raises (the secret check, or MLX_TIMEOUT).
"""

from __future__ import annotations

import datetime
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from meshcomm.plugin import CommTimeoutError, DistributedError

from .errors import StoreAuthError, store_timed_out
from .liveness import RankProcess
from .session import NONCE_BYTES

__all__ = ["Admission", "Joins", "ask_to_join", "admit_waiting", "write_admission", "COUNT"]

COUNT = "meshcomm/session/join/count"
_HELLO = "meshcomm/session/join/hello/"
_ANSWER = "meshcomm/session/join/nonce/"
_RECORD = "meshcomm/join/"
#: seconds rank 0's grow() waits for the records of newcomers it has just answered
RECORD_WAIT = 1.0
_POLL = 0.005


@dataclass(frozen=True)
class Admission:
    """What a newcomer is told: its place in the grown world."""

    prefix: str
    rank: int
    size: int
    epoch: int
    members: list[int]
    peers: list[RankProcess]

    def encode(self) -> str:
        return json.dumps(
            {
                "prefix": self.prefix,
                "rank": self.rank,
                "size": self.size,
                "epoch": self.epoch,
                "members": self.members,
                "peers": [p.encode() for p in self.peers],
            }
        )

    @staticmethod
    def decode(raw: bytes) -> Admission:
        d = json.loads(bytes(raw).decode())
        peers = [RankProcess.decode(p) for p in d["peers"]]
        return Admission(str(d["prefix"]), int(d["rank"]), int(d["size"]), int(d["epoch"]), d["members"], peers)


@dataclass
class Joins:
    """Rank 0's book of the newcomers it has seen (carried from world to world)."""

    answered: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)
    admitted: set[int] = field(default_factory=set)


def _hello_answers(store: Any, joins: Joins) -> list[int]:
    """Answer every verified hello not answered yet; the numbers answered now."""
    count = store.add(COUNT, 0)
    now = []
    for n in range(1, count + 1):
        if n in joins.answered or n in joins.refused or not store.check([f"{_HELLO}{n}"]):
            continue
        try:
            challenge = bytes(store.get(f"{_HELLO}{n}"))
        except StoreAuthError:
            joins.refused.add(n)  # a stranger's: never answered
            continue
        store.set(f"{_ANSWER}{n}", store.nonce + challenge)
        joins.answered.add(n)
        now.append(n)
    return now


def admit_waiting(store: Any, joins: Joins, timeout: float) -> list[tuple[int, RankProcess]]:
    """Rank 0's part of ``grow()``: the newcomers to admit now, (number, where it runs) each."""
    fresh = _hello_answers(store, joins)
    waiting = sorted(joins.answered - joins.admitted - joins.refused)
    end = time.monotonic() + min(RECORD_WAIT, timeout)
    while fresh and time.monotonic() < end and not all(store.check([f"{_RECORD}{n}"]) for n in fresh):
        time.sleep(_POLL)
    ready = []
    for n in waiting:
        if not store.check([f"{_RECORD}{n}"]):
            continue
        try:
            rec = json.loads(bytes(store.get(f"{_RECORD}{n}")).decode())
        except StoreAuthError:
            joins.refused.add(n)
            continue
        ready.append((n, RankProcess.decode(rec)))
    return ready


def ask_to_join(store: Any, timeout: float) -> Admission:
    """The newcomer's side (see the module docstring): its admission, or CommTimeoutError when
    no ``grow()`` admitted it within ``timeout`` seconds (MLX_TIMEOUT)."""
    deadline = time.monotonic() + timeout
    n = store.add(COUNT, 1)
    mine = secrets.token_bytes(NONCE_BYTES)
    store.set(f"{_HELLO}{n}", mine)
    answer = _wait_get(store, f"{_ANSWER}{n}", deadline, timeout, "answered its request to join")
    nonce, echo = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if len(nonce) != NONCE_BYTES or echo != mine:
        raise StoreAuthError(
            f"[gloo] newcomer #{n}: the answer to its request to join carries another challenge: it was written "
            "for another request (replayed); nothing of it was used. Let only the job's hosts reach the store's "
            "port.",
            key=f"{_ANSWER}{n}",
            peer=0,
        )
    store.begin(nonce)
    store.set(f"{_RECORD}{n}", json.dumps(RankProcess.here().encode()))
    raw = _wait_get(store, f"{_RECORD}{n}/admit", deadline, timeout, "admitted it (called grow())")
    return Admission.decode(raw)


def write_admission(store: Any, n: int, admission: Admission) -> None:
    """Tell newcomer ``n`` its place (rank 0, in ``grow()``)."""
    store.set(f"{_RECORD}{n}/admit", admission.encode())


def _wait_get(store: Any, key: str, deadline: float, timeout: float, what: str) -> bytes:
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        store.set_timeout(datetime.timedelta(seconds=left))
        return bytes(store.get(key))
    except StoreAuthError:
        raise
    except (TimeoutError, RuntimeError, DistributedError) as exc:
        if isinstance(exc, RuntimeError) and not store_timed_out(exc):
            raise DistributedError(
                f"[gloo] newcomer: the rendezvous store failed while waiting to join: {str(exc).splitlines()[0]}"
            ) from None
        raise CommTimeoutError(
            f"[gloo] newcomer: no rank of the job {what} within {timeout:g} s (MLX_TIMEOUT): the job's ranks "
            "call world.grow() at points of their choosing; start the newcomer closer to one, or raise MLX_TIMEOUT",
            peer=0,
        ) from None
