"""Failure records in the rendezvous store: what each rank was doing and why it stopped.

Two kinds of key, written only when something goes wrong (or at exit), never on the
fast path:

* ``meshcomm/status/<world rank>``: this process left the job: it closed its groups
  (program ended, ``meshcomm.shutdown()``) or aborted (``Backend.abort``: an uncaught
  exception or a non-zero exit). Peers that lose the connection read it to name the
  rank and say why, also when that rank ran on another host.
* ``<group prefix>/meshcomm-failed/<group rank>``: the call this rank failed in and the
  error it raised (class, blamed peer). A rank whose operation timed out publishes
  its own record and reads the others' for a short while, which tells a mismatch (the
  others called something else) from a stopped or slow rank (it published nothing).

The store lives in rank 0; when rank 0 is gone or stopped every access fails or times
out, so each one runs under a short store timeout and failures are ignored.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .calls import Call

__all__ = ["Record", "Records", "STATUS"]

STATUS = "meshcomm/status/"
#: seconds a single store access may take while handling a failure
_STORE_WAIT = 1.0


@dataclass(frozen=True)
class Record:
    """What a group rank published when its operation failed."""

    call: Call
    error: str  # error class name
    peer: int | None  # group rank it blamed
    why: str


class Records:
    """Reading and writing failure records of one group in ``store`` (a base store, keys prefixed here)."""

    def __init__(self, store: Any, prefix: str, timeout: float) -> None:
        self._store = store
        self._prefix = prefix
        self._timeout = timeout

    def _short(self) -> None:
        self._store.set_timeout(datetime.timedelta(seconds=min(_STORE_WAIT, self._timeout)))

    def _restore(self) -> None:
        try:
            self._store.set_timeout(datetime.timedelta(seconds=self._timeout))
        except Exception:  # noqa: BLE001 - the store is gone; nothing to restore
            pass

    def _get(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key)).decode()

    # -- process status (world ranks) ---------------------------------------------------
    def set_status(self, world_rank: int, text: str) -> bool:
        """Publish why this process leaves; False if the store could not be reached."""
        try:
            self._short()
            self._store.set(f"{STATUS}{world_rank}", text)
            return True
        except Exception:  # noqa: BLE001 - best effort: the job is ending anyway
            return False
        finally:
            self._restore()

    def statuses(self, world_ranks: Iterable[int]) -> dict[int, str]:
        """Status text of those of ``world_ranks`` that published one."""
        out: dict[int, str] = {}
        try:
            self._short()
            for w in world_ranks:
                text = self._get(f"{STATUS}{w}")
                if text is not None:
                    out[w] = text
        except Exception:  # noqa: BLE001 - store unreachable: nothing more to learn
            pass
        finally:
            self._restore()
        return out

    # -- failed calls (group ranks) -------------------------------------------------------
    def publish(self, rank: int, call: Call, error: str, peer: int | None, why: str) -> None:
        body = json.dumps({"call": call.text(), "error": error, "peer": peer, "why": why[:300]})
        try:
            self._short()
            self._store.set(f"{self._prefix}/meshcomm-failed/{rank}", body)
        except Exception:  # noqa: BLE001 - best effort
            pass
        finally:
            self._restore()

    def collect(
        self, ranks: Iterable[int], wait: float, skip: Callable[[int], bool] = lambda q: False
    ) -> dict[int, Record]:
        """Records of ``ranks``, polling up to ``wait`` seconds for the missing ones
        (ranks for which ``skip(q)`` is true are not waited for)."""
        pending = set(ranks)
        found: dict[int, Record] = {}
        deadline = time.monotonic() + wait
        try:
            self._short()
            while True:
                for q in sorted(pending):
                    text = self._get(f"{self._prefix}/meshcomm-failed/{q}")
                    if text is not None:
                        d = json.loads(text)
                        found[q] = Record(Call.parse(d["call"]), d["error"], d["peer"], d["why"])
                        pending.discard(q)
                pending = {q for q in pending if not skip(q)}
                if not pending or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - store unreachable: use what was found
            pass
        finally:
            self._restore()
        return found
