"""A torch.distributed Store that proves the job secret on every value (wraps a TCPStore/FileStore).

torch lets Python subclass :class:`torch.distributed.Store` (a pybind11 trampoline), and
``ProcessGroupGloo`` accepts such a store under a ``PrefixStore``: gloo's rendezvous
(``set`` of each rank's address, ``wait`` and ``get`` of the others') then runs through
:meth:`AuthStore.set` / :meth:`AuthStore.get`. So does everything meshcomm writes (host
and pid records, failure and status records). Each value is sealed with an HMAC-SHA256
tag (:mod:`.sealing`) over the job id and, once :meth:`AuthStore.begin` was called, the
start-up's nonce (:mod:`.session`; only the session's own keys, under ``meshcomm/session/``,
are sealed without one); a value whose tag does not verify raises :class:`StoreAuthError`
naming the key and is never returned.

Counters (``add``) and ``compare_set`` are sealed too (a compare-and-set loop on the
sealed bytes). Not protected, because the store itself is open: anyone who can reach it
can delete keys, overwrite them with garbage, or write before a rank does; all of that
makes start-up fail with this error or time out (denial of service), never use wrong data.
A value recorded in an earlier start-up (another job with the same secret) carries another
nonce and is refused. Within one start-up a sealed value can be copied back to the same
key (replay); meshcomm writes each key once per start-up except failure records and signs of
life (:mod:`.heartbeat`), where a replay could at most change an error message. Imports
torch; imported only by the factory.
"""

from __future__ import annotations

import atexit
import datetime
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from .errors import StoreAuthError
from .sealing import BadSeal, Sealer

__all__ = ["AuthStore", "StoreAuthError", "SESSION"]

#: keys of the start-up handshake (:mod:`.session`): sealed over the job id only, never over a nonce
SESSION = "meshcomm/session/"
_OWNER = re.compile(r"(?:^|/)(?:proc|status|rejected|session/hello)/(\d+)$")
_ANSWER = re.compile(r"(?:^|/)session/nonce/\d+$")  # written by rank 0


#: twins given up on (:meth:`AuthStore.abandon`) with a wait still in progress: the process's
#: exit lets those waits end; a twin leaves the list when its last wait has ended
_ABANDONED: list[AuthStore] = []


@atexit.register
def _let_abandoned_waits_end() -> None:
    end = time.monotonic() + 1.0
    while any(store._calls for store in _ABANDONED) and time.monotonic() < end:
        time.sleep(0.005)


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class AuthStore(dist.Store):
    """Seals values written to ``inner`` and checks values read from it.

    ``namespace`` is put before every key (a shared store, e.g. torchrun's agent store,
    holds other jobs' and torch's keys); ``rank`` and ``where`` only go into messages;
    ``reopen(timeout)`` makes another client of the same store (:meth:`twin`).
    """

    def __init__(
        self,
        inner: Any,
        sealer: Sealer,
        *,
        namespace: str = "",
        rank: int = 0,
        where: str = "rendezvous store",
        reopen: Callable[[float], Any] | None = None,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._given = sealer
        self._reopen = reopen
        self._twin_of: AuthStore | None = None  # the store a twin was made from: it learns what the twin refused
        self._abandoned = False
        self._calls, self._calls_lock = 0, threading.Lock()  # waits in progress (a twin's)
        self._base = sealer.bound(b"")  # the session's own keys
        self._sealer = sealer  # every other key: over the start-up's nonce once begin() was called
        self._ns = namespace
        self._rank = rank
        self._where = where
        #: the first value this store (or a twin of it) refused (kept so that a caller can report
        #: it even if an error crossed C++ code on its way out)
        self.rejected: StoreAuthError | None = None
        self.nonce = b""

    # -- sealing ------------------------------------------------------------------------
    def begin(self, nonce: bytes) -> None:
        """Seal and check every key outside ``meshcomm/session/`` over ``nonce`` from now on."""
        self._sealer = self._base.bound(nonce)
        #: the start-up's nonce (rank 0 hands it to newcomers that prove the secret: :mod:`.joining`)
        self.nonce = nonce

    def twin(self, timeout: float) -> AuthStore | None:
        """Another connection to the same store with the same seals, for a thread that must not
        wait behind this connection's blocking calls (gloo's rendezvous holds it while it waits for
        a key); None for a store that cannot be opened twice (a FileStore counts its users)."""
        if self._reopen is None:
            return None
        other = AuthStore(self._reopen(timeout), self._given, namespace=self._ns, rank=self._rank, where=self._where)
        other._twin_of = self
        if self.nonce:
            other.begin(self.nonce)
        return other

    def use_connection_of(self, other: AuthStore) -> None:
        """Go on over ``other``'s connection and let go of this one's own (it closes once no call
        holds it): a group keeps the store it was built with, one connection per group would add up."""
        self._inner = other._inner

    def _full(self, key: str) -> str:
        return self._ns + key

    def _sealer_of(self, key: str) -> Sealer:
        return self._base if key.startswith(SESSION) else self._sealer

    def _seal(self, key: str, value: Any) -> bytes:
        return self._sealer_of(key).seal(self._full(key), _bytes(value))

    def _open(self, key: str, raw: Any, sealer: Sealer | None = None) -> bytes:
        try:
            return (sealer or self._sealer_of(key)).unseal(self._full(key), _bytes(raw))
        except BadSeal as bad:
            err = self._error(key, bad)
            if sealer is None:
                for store in (self, self._twin_of):
                    if store is not None and store.rejected is None:
                        store.rejected = err
            raise err from None

    def derive(self, label: str) -> bytes:
        """A key for ``label`` (one group's call-check channel, :mod:`.checkline`) from the job
        secret, bound to this job and this start-up."""
        return self._sealer.tag(self._full(label), b"meshcomm gloo derived key")

    def get_over(self, key: str, nonce: bytes) -> bytes:
        """The value of ``key`` if it was sealed over ``nonce`` (not this start-up's); StoreAuthError
        otherwise. Rank 0 reads a refusal this way: a rank that did not take rank 0's nonce seals
        its start-up record over its own challenge (:mod:`.session`)."""
        return self._open(key, self._inner.get(self._full(key)), self._base.bound(nonce))

    def _error(self, key: str, bad: BadSeal) -> StoreAuthError:
        m = _OWNER.search(key)
        owner = int(m.group(1)) if m else 0 if _ANSWER.search(key) else None
        whose = f" (rank {owner}'s record)" if owner is not None else ""
        where = f"[gloo] rank {self._rank}: the value of key {self._full(key)!r}{whose} in the {self._where}"
        if bad.replayed:
            return StoreAuthError(
                f"{where} belongs to another start-up: {bad.reason}. The value was not used. Fix: give every job "
                "its own MESHCOMM_JOB_SECRET (meshcomm launch makes a fresh one per job) and let only the job's "
                "hosts reach the store's port.",
                key=self._full(key),
                peer=owner,
                replayed=True,
            )
        return StoreAuthError(
            f"{where} failed the job secret check, so a process without the job secret wrote to the rendezvous "
            "store (a stranger that can reach the store, or a rank started with another MESHCOMM_JOB_SECRET or "
            f"none): {bad.reason}. The value was not used. Fix: give every rank the same MESHCOMM_JOB_SECRET "
            "(meshcomm launch makes one) and let only the job's hosts reach the store's port.",
            key=self._full(key),
            peer=owner,
        )

    # -- the Store interface --------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._inner.set(self._full(key), self._seal(key, value))

    def get(self, key: str) -> bytes:
        if self._twin_of is not None:  # gloo's own client: a wait it can be called out of
            self._wait_unless_abandoned([self._full(key)], None)
        return self._open(key, self._inner.get(self._full(key)))

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        self._inner.multi_set(
            [self._full(k) for k in keys], [self._seal(k, v) for k, v in zip(keys, values, strict=True)]
        )

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        raws = self._inner.multi_get([self._full(k) for k in keys])
        return [self._open(k, raw) for k, raw in zip(keys, raws, strict=True)]

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        full = [self._full(k) for k in keys]
        if self._twin_of is not None:
            self._wait_unless_abandoned(full, timeout)
        elif timeout is None:
            self._inner.wait(full)
        else:
            self._inner.wait(full, timeout)

    def abandon(self) -> None:
        """meshcomm gave up on the connection this twin serves: a wait in it (gloo's rendezvous,
        in a thread left behind) ends within a few milliseconds instead of at its timeout, and
        the process's exit waits (at most a second) until it has, because a thread that comes
        back into Python while the interpreter shuts down aborts the process."""
        with self._calls_lock:
            self._abandoned = True
            if self._calls:
                _ABANDONED.append(self)

    def _wait_unless_abandoned(self, full: list[str], timeout: datetime.timedelta | None) -> None:
        """``inner.wait(full, timeout)`` by looking (``check``: torch warns on every timed-out
        wait), so that :meth:`abandon` can end it."""
        limit = (timeout if timeout is not None else self._inner.timeout).total_seconds()
        deadline, pause = time.monotonic() + limit, 0.001
        with self._calls_lock:
            self._calls += 1
        try:
            while not self._inner.check(full):
                if self._abandoned:
                    raise RuntimeError("meshcomm stopped waiting: the connection of this group was given up")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"wait timeout after {limit * 1000:.0f}ms, keys: {full}")
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
        finally:
            with self._calls_lock:
                self._calls -= 1
                if self._abandoned and not self._calls and self in _ABANDONED:
                    _ABANDONED.remove(self)  # nothing left to wait for at exit: not kept alive

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._inner.check([self._full(k) for k in keys]))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(self._full(key)))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def where(self) -> str:
        """What the store is, for messages ("TCPStore 10.0.0.1:29500 (hosted by rank 0 ...)")."""
        return self._where

    @property
    def timeout(self) -> datetime.timedelta:
        return self._inner.timeout

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """Set ``desired`` if the (verified) current value is ``expected`` (or the key is missing and
        ``expected`` is empty); returns what TCPStore's compare_set returns: the value now stored
        (``expected`` itself when the key is missing and ``expected`` is not empty)."""
        want, full = _bytes(expected), self._full(key)
        while True:
            raw = _bytes(self._inner.get(full)) if self._inner.check([full]) else None
            current = None if raw is None else self._open(key, raw)
            if current is None and want or current is not None and current != want:
                return want if current is None else current
            sealed = self._seal(key, desired)
            got = _bytes(self._inner.compare_set(full, raw if raw is not None else b"", sealed))
            if got == sealed:
                return _bytes(desired)
            # someone changed the value between our read and the swap: look again

    def add(self, key: str, amount: int) -> int:
        """A sealed integer counter (decimal text); raises StoreAuthError if its value was forged."""
        full = self._full(key)
        while True:
            raw = _bytes(self._inner.get(full)) if self._inner.check([full]) else None
            current = 0 if raw is None else int(self._open(key, raw))
            new = current + int(amount)
            sealed = self._seal(key, str(new))
            got = _bytes(self._inner.compare_set(full, raw if raw is not None else b"", sealed))
            if got == sealed:
                return new

    def append(self, key: str, value: Any) -> None:
        raise NotImplementedError(
            "gloo backend: the authenticated rendezvous store does not support append (a sealed value cannot "
            "be extended in place); use set/get"
        )
