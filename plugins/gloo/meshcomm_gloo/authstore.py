"""A torch.distributed Store that proves the job secret on every value (wraps a TCPStore/FileStore).

torch lets Python subclass :class:`torch.distributed.Store` (a pybind11 trampoline), and
``ProcessGroupGloo`` accepts such a store under a ``PrefixStore``: gloo's rendezvous
(``set`` of each rank's address, ``wait`` and ``get`` of the others') then runs through
:meth:`AuthStore.set` / :meth:`AuthStore.get`. So does everything meshcomm writes (host
and pid records, failure and status records). Each value is sealed with an HMAC-SHA256
tag (:mod:`.sealing`); a value whose tag does not verify raises :class:`StoreAuthError`
naming the key and is never returned.

Counters (``add``) and ``compare_set`` are sealed too (a compare-and-set loop on the
sealed bytes). Not protected, because the store itself is open: anyone who can reach it
can delete keys, overwrite them with garbage, or write before a rank does; all of that
makes start-up fail with this error or time out (denial of service), never use wrong data.
A sealed value can be copied back to the same key of the same job (replay); meshcomm
writes each key once per job except failure records, where a replay could at most
change an error message. Imports torch; imported only by the factory.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .errors import StoreAuthError
from .sealing import BadSeal, Sealer

__all__ = ["AuthStore", "StoreAuthError"]

_OWNER = re.compile(r"(?:^|/)(?:proc|status|rejected)/(\d+)$")


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class AuthStore(dist.Store):
    """Seals values written to ``inner`` and checks values read from it.

    ``namespace`` is put before every key (a shared store, e.g. torchrun's agent store,
    holds other jobs' and torch's keys); ``rank`` and ``where`` only go into messages.
    """

    def __init__(self, inner: Any, sealer: Sealer, *, namespace: str = "", rank: int = 0,
                 where: str = "rendezvous store") -> None:
        super().__init__()
        self._inner = inner
        self._sealer = sealer
        self._ns = namespace
        self._rank = rank
        self._where = where
        #: the first value this store refused (kept so that a caller can report it even if an
        #: error crossed C++ code on its way out)
        self.rejected: StoreAuthError | None = None

    # -- sealing ------------------------------------------------------------------------
    def _full(self, key: str) -> str:
        return self._ns + key

    def _seal(self, key: str, value: Any) -> bytes:
        return self._sealer.seal(self._full(key), _bytes(value))

    def _open(self, key: str, raw: Any) -> bytes:
        try:
            return self._sealer.unseal(self._full(key), _bytes(raw))
        except BadSeal as bad:
            err = self._error(key, bad)
            if self.rejected is None:
                self.rejected = err
            raise err from None

    def _error(self, key: str, bad: BadSeal) -> StoreAuthError:
        m = _OWNER.search(key)
        owner = int(m.group(1)) if m else None
        whose = f" (rank {owner}'s record)" if owner is not None else ""
        return StoreAuthError(
            f"[gloo] rank {self._rank}: the value of key {self._full(key)!r}{whose} in the {self._where} failed "
            f"the job secret check, so a process without the job secret wrote to the rendezvous store (a "
            "stranger that can reach the store, or a rank started with another MESHCOMM_JOB_SECRET or none): "
            f"{bad.reason}. The value was not used. Fix: give every rank the same MESHCOMM_JOB_SECRET (meshcomm "
            "launch makes one) and let only the job's hosts reach the store's port.",
            key=self._full(key), peer=owner)

    # -- the Store interface --------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._inner.set(self._full(key), self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self._inner.get(self._full(key)))

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        self._inner.multi_set([self._full(k) for k in keys], [self._seal(k, v) for k, v in zip(keys, values, strict=True)])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        raws = self._inner.multi_get([self._full(k) for k in keys])
        return [self._open(k, raw) for k, raw in zip(keys, raws, strict=True)]

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        full = [self._full(k) for k in keys]
        if timeout is None:
            self._inner.wait(full)
        else:
            self._inner.wait(full, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._inner.check([self._full(k) for k in keys]))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(self._full(key)))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

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
            "be extended in place); use set/get")
