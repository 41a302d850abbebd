"""Survivors continue on gloo: agree through the rendezvous store, then a new process group.

The store (a TCPStore, usually served by world rank 0, every value sealed with the job
secret) is one server that orders every write, so the survivors agree through it instead
of by flooding: each writes that it is here (with its flag) under a key of this
agreement, waits until every other rank wrote too or is known gone (its process is gone
or a zombie on this host, or it left a status record saying its program failed or
ended), for ranks it timed out on only :data:`SUSPECT_GRACE` seconds, for the rest twice
``MLX_TIMEOUT`` (gloo does not tell every rank of a loss at once: a survivor whose peers
are alive learns of it only when its own operation times out), and for a rank still
connecting to this world up to :data:`CONNECTING_TIMEOUTS` times ``MLX_TIMEOUT`` (its
connect may take three); then the first one done
proposes the ranks it saw with one compare-and-set, which every survivor reads back: one
decision for all. A rank not in
it raises (the others went on without it). ``shrink`` then makes a ProcessGroupGloo of
the members under a new store prefix.

When the store's server itself is lost (world rank 0 died), nothing can be agreed:
``agree`` and ``shrink`` raise naming that.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from meshcomm.plugin import CommTimeoutError, DistributedError

__all__ = ["agree_in_store", "SUSPECT_GRACE", "CONNECTING_TIMEOUTS"]

#: seconds the agreement waits for a rank this one timed out on (it may be alive, blamed for
#: a third rank's silence: then it writes within milliseconds)
SUSPECT_GRACE = 0.5
#: how many MLX_TIMEOUTs the agreement waits for a member still connecting to this world:
#: its connect waits for gloo's mesh at most one timeout and a second (:mod:`.meshwait`;
#: gloo alone waits 5 for a member that died after it published its address), then for the
#: exchange of endpoints and the call-check channel, one each; one more for slack
CONNECTING_TIMEOUTS = 4
_POLL = 0.005


def agree_in_store(
    store: Any,
    key: str,
    me: int,
    ranks: list[int],
    flag: int,
    timeout: float,
    gone: Callable[[Iterable[int]], set[int]],
    suspects: set[int],
    connecting: Callable[[int], bool] = lambda q: False,
) -> tuple[int, list[int]]:
    """(AND of the members' flags, the members) agreed under ``key`` by the ranks of
    ``ranks`` (world ranks; ``me`` among them); ``gone(ranks)`` says which are known gone,
    ``connecting(q)`` whether rank ``q`` is still connecting to this world."""
    start = time.monotonic()
    try:
        store.set(f"{key}/here/{me}", str(int(flag)))
        decided = f"{key}/decision"
        while True:
            present = {q for q in ranks if q == me or store.check([f"{key}/here/{q}"])}
            now = time.monotonic()
            missing = [q for q in ranks if q not in present]
            dead = gone(missing) if missing else set()
            waiting = [
                q
                for q in missing
                if q not in dead
                and (
                    now < start + (SUSPECT_GRACE if q in suspects else 2 * timeout)
                    or now < start + CONNECTING_TIMEOUTS * timeout
                    and connecting(q)
                )
            ]
            if not waiting or store.check([decided]):
                break
            time.sleep(_POLL)
        members = json.loads(store.compare_set(decided, "", json.dumps(sorted(present))))
        if me not in members:
            raise CommTimeoutError(
                f"[gloo] world rank {me}: the other survivors gave up on this rank and agreed without it (it "
                f"was stopped, or came later than they could wait: MLX_TIMEOUT={timeout:g} s); they went on "
                "without it",
                peer=me,
            )
        flags = store.multi_get([f"{key}/here/{q}" for q in members])
    except DistributedError:
        raise
    except Exception as exc:  # the store's server is gone (rank 0 lost) or unreachable
        raise DistributedError(
            f"[gloo] world rank {me}: the survivors cannot agree: the rendezvous store does not answer "
            f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); it is "
            "served by world rank 0 (under meshcomm launch), and gloo's survivors go on only while it lives"
        ) from None
    value = 0xFFFFFFFF
    for f in flags:
        value &= int(bytes(f).decode())
    return value, members
