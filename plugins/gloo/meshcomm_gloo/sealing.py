"""Tags on rendezvous-store values: a value is used only if it was written with the job secret
for this very start-up of the job.

Every value a rank writes to the rendezvous store is stored as::

    b"mcg2" | flags (1 byte) | nonce length (1 byte) | nonce | HMAC-SHA256 tag (32 bytes) | value

The tag's key is derived from ``MESHCOMM_JOB_SECRET`` (an empty secret when there is
none, so the format is the same with and without one); its message binds the job id,
the start-up's nonce (:mod:`.session`), the full store key and the value, so a tagged
value cannot be moved to another key, another job or another start-up, nor changed.
``flags`` bit 0 says whether the writer had a secret; it is not protected and only makes
error messages more precise. The nonce is carried in the clear (the tag covers it) so that
a value of another start-up is recognised as such: its tag holds for the nonce it carries,
so it was written with this secret for another start-up and replayed from there.

Pure Python (no torch), so it is testable without processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct
from dataclasses import dataclass, field

__all__ = ["MAGIC", "TAG_BYTES", "BadSeal", "Sealer", "short"]

MAGIC = b"mcg2"
_OLD_MAGIC = b"mcg1"  # meshcomm gloo before start-up nonces: no nonce field
TAG_BYTES = 32
_LABEL = b"meshcomm gloo rendezvous store v2"


class BadSeal(Exception):
    """A stored value whose tag does not verify; ``reason`` says how it is wrong.

    ``replayed`` is true when the tag holds for the nonce the value carries but that nonce is
    not this start-up's: the value was written with this job's secret and id for another
    start-up (an earlier job, or one running beside this one, with the same secret).
    """

    def __init__(self, reason: str, writer_had_secret: bool | None, *, replayed: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.writer_had_secret = writer_had_secret
        self.replayed = replayed


def _part(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def short(nonce: bytes) -> str:
    """A nonce as it appears in messages: its first 6 bytes in hex (or "none")."""
    return nonce[:6].hex() + ("…" if len(nonce) > 6 else "") if nonce else "none"


@dataclass(frozen=True)
class Sealer:
    """Tags and checks values for one job (``job``: the job id every rank shares, may be empty)
    and one start-up of it (``nonce``: empty until :mod:`.session` agreed one)."""

    secret: bytes = field(repr=False)
    job: str
    nonce: bytes = b""
    key: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.nonce) > 255:
            raise ValueError("a start-up nonce has at most 255 bytes")
        object.__setattr__(self, "key", hmac.new(self.secret, _LABEL, hashlib.sha256).digest())

    @property
    def has_secret(self) -> bool:
        return bool(self.secret)

    def bound(self, nonce: bytes) -> Sealer:
        """The same secret and job id over another start-up nonce."""
        return dataclasses.replace(self, nonce=nonce)

    def tag(self, full_key: str, value: bytes, nonce: bytes | None = None) -> bytes:
        """HMAC-SHA256 over the job id, the nonce (default: this sealer's), the full store key and
        the value (length-prefixed)."""
        nonce = self.nonce if nonce is None else nonce
        msg = _part(self.job.encode()) + _part(nonce) + _part(full_key.encode()) + value
        return hmac.new(self.key, msg, hashlib.sha256).digest()

    def seal(self, full_key: str, value: bytes) -> bytes:
        """What to store under ``full_key`` for ``value``."""
        head = MAGIC + bytes([1 if self.has_secret else 0, len(self.nonce)]) + self.nonce
        return head + self.tag(full_key, value) + value

    def unseal(self, full_key: str, raw: bytes) -> bytes:
        """The value stored as ``raw`` under ``full_key``; BadSeal when its tag does not verify."""
        if raw.startswith(_OLD_MAGIC):
            raise BadSeal(
                "it was written by an older meshcomm gloo backend (store format mcg1, without start-up "
                "nonces): give every rank the same meshcomm version",
                None,
            )
        size = len(MAGIC) + 2
        if len(raw) < size or not raw.startswith(MAGIC) or len(raw) < size + raw[size - 1] + TAG_BYTES:
            raise BadSeal(
                "it carries no meshcomm tag at all (written by something that is not a meshcomm rank, "
                "e.g. a plain TCPStore client)",
                None,
            )
        had = bool(raw[len(MAGIC)] & 1)
        end = size + raw[size - 1]
        nonce, tag, value = raw[size:end], raw[end : end + TAG_BYTES], raw[end + TAG_BYTES :]
        if nonce == self.nonce and hmac.compare_digest(tag, self.tag(full_key, value)):
            return value
        if had and not self.has_secret:
            why = "its writer had a job secret and this rank has none (MESHCOMM_JOB_SECRET is not set here)"
        elif not had and self.has_secret:
            why = "its writer had no job secret (MESHCOMM_JOB_SECRET unset) and this rank has one"
        elif nonce != self.nonce and hmac.compare_digest(tag, self.tag(full_key, value, nonce)):
            raise BadSeal(
                f"it was written with this job secret and job id (this rank's is {self.job!r}) but for another "
                f"start-up (its nonce is {short(nonce)}, this start-up's is {short(self.nonce)}): a value recorded "
                "from an earlier job that used the same MESHCOMM_JOB_SECRET (or from a job running beside this one "
                "with it) and replayed here, or the record of a rank of this job that refused this start-up's "
                "nonce",
                had,
                replayed=True,
            )
        else:
            why = (
                "its tag is wrong: it was written with another job secret, for another key, for another job "
                f"id (this rank's is {self.job!r}), or changed after it was written"
            )
        raise BadSeal(why, had)
