"""Tags on rendezvous-store values: a value is used only if it was written with the job secret.

Every value a rank writes to the rendezvous store is stored as::

    b"mcg1" | flags (1 byte) | HMAC-SHA256 tag (32 bytes) | value

The tag's key is derived from ``MESHCOMM_JOB_SECRET`` (an empty secret when there is
none, so the format is the same with and without one); its message binds the job id,
the full store key and the value, so a tagged value cannot be moved to another key or
another job, nor changed. ``flags`` bit 0 says whether the writer had a secret; it is
not protected and only makes error messages more precise.

Pure Python (no torch), so it is testable without processes.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field

__all__ = ["MAGIC", "TAG_BYTES", "BadSeal", "Sealer"]

MAGIC = b"mcg1"
TAG_BYTES = 32
_HEAD = len(MAGIC) + 1 + TAG_BYTES
_LABEL = b"meshcomm gloo rendezvous store v1"


class BadSeal(Exception):
    """A stored value whose tag does not verify; ``reason`` says how it is wrong."""

    def __init__(self, reason: str, writer_had_secret: bool | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.writer_had_secret = writer_had_secret


def _part(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


@dataclass(frozen=True)
class Sealer:
    """Tags and checks values for one job (``job``: the job id every rank shares, may be empty)."""

    secret: bytes = field(repr=False)
    job: str
    key: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", hmac.new(self.secret, _LABEL, hashlib.sha256).digest())

    @property
    def has_secret(self) -> bool:
        return bool(self.secret)

    def tag(self, full_key: str, value: bytes) -> bytes:
        """HMAC-SHA256 over the job id, the full store key and the value (length-prefixed)."""
        msg = _part(self.job.encode()) + _part(full_key.encode()) + value
        return hmac.new(self.key, msg, hashlib.sha256).digest()

    def seal(self, full_key: str, value: bytes) -> bytes:
        """What to store under ``full_key`` for ``value``."""
        return MAGIC + bytes([1 if self.has_secret else 0]) + self.tag(full_key, value) + value

    def unseal(self, full_key: str, raw: bytes) -> bytes:
        """The value stored as ``raw`` under ``full_key``; BadSeal when its tag does not verify."""
        if len(raw) < _HEAD or not raw.startswith(MAGIC):
            raise BadSeal("it carries no meshcomm tag at all (written by something that is not a meshcomm rank, "
                          "e.g. a plain TCPStore client)", None)
        had = bool(raw[len(MAGIC)] & 1)
        tag, value = raw[len(MAGIC) + 1:_HEAD], raw[_HEAD:]
        if hmac.compare_digest(tag, self.tag(full_key, value)):
            return value
        if had and not self.has_secret:
            why = ("its writer had a job secret and this rank has none (MESHCOMM_JOB_SECRET is not set here)")
        elif not had and self.has_secret:
            why = "its writer had no job secret (MESHCOMM_JOB_SECRET unset) and this rank has one"
        else:
            why = ("its tag is wrong: it was written with another job secret, for another key, for another job "
                   f"id (this rank's is {self.job!r}), or changed after it was written")
        raise BadSeal(why, had)
