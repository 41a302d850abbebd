"""Python objects between ranks (``all_gather_object``, ``broadcast_object``): pickled,
sealed with the job secret, and unpickled only when the seal holds.

``pickle.loads`` runs code: whoever can put bytes in front of it runs code as the job's
user. So every object payload carries an HMAC-SHA256 tag, keyed from ``MESHCOMM_JOB_SECRET``
and the job id, over the group, the object call's number in that group, the sender's rank
and the bytes; a rank unpickles nothing whose tag does not hold, whatever the backend and
whatever its links check. Without a secret there is no key, and objects from other ranks
are refused unless ``MESHCOMM_UNSAFE_OBJECTS=1`` says the user accepts the risk, or every
rank is a thread of this one process (``Backend.in_process``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
from collections.abc import Mapping
from typing import Any

from ..protocol.errors import ConfigError, DistributedError, ObjectAuthError

__all__ = ["TAG_BYTES", "UNPICKLABLE", "ObjectSeal", "dumps", "size_code", "loads"]

#: bytes of the tag after each sealed payload
TAG_BYTES = 32
#: the size a rank reports for an object it could not pickle
UNPICKLABLE = -1


def dumps(obj: Any) -> tuple[bytes, BaseException | None]:
    """``obj`` pickled, or the exception that stopped it (reported on every rank later)."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # reported on every rank after the size exchange
        return b"", exc


def size_code(data: bytes, failure: BaseException | None) -> int:
    """What a rank tells the others of its object: its pickled size, or UNPICKLABLE."""
    return UNPICKLABLE if failure is not None else len(data)


def loads(data: bytes, rank: int, op: str, who: str) -> Any:
    """Unpickle ``data`` (already opened by :meth:`ObjectSeal.open`) from ``rank``."""
    try:
        return pickle.loads(data)  # noqa: S301 - only sealed payloads, or the user opted in
    except Exception as exc:
        raise DistributedError(
            f"{who}: {op}: rank {rank}'s object cannot be unpickled here: "
            f"{type(exc).__name__}: {exc} (is its class importable on this rank?)"
        ) from exc


class ObjectSeal:
    """Seals and opens one process's object payloads. ``key`` None: nothing is sealed, and
    :meth:`require` refuses unless ``unsealed_ok``."""

    def __init__(self, key: bytes | None, unsealed_ok: bool) -> None:
        self.key = key
        self.unsealed_ok = unsealed_ok
        #: bytes each payload gains (the same on every rank with the same secret setting)
        self.tag_bytes = TAG_BYTES if key is not None else 0

    @classmethod
    def for_job(
        cls, environ: Mapping[str, str] | None = None, *, in_process: bool = False, local_key: bytes | None = None
    ) -> ObjectSeal:
        """The seal of this job: keyed from MESHCOMM_JOB_SECRET and MESHCOMM_JOB_ID, else from
        ``local_key`` (the per-user key the transport authenticated with, if it did)."""
        env = os.environ if environ is None else environ
        from ..runtime.config import (  # the settings' one source (on the first object call)
            Config,
            load_settings,
        )
        from ..runtime.jobsecret import JobSecretSettings

        secret = load_settings(JobSecretSettings, None, env).secret
        unsafe = Config.load(env).unsafe_objects
        if not secret and not local_key:
            return cls(None, unsafe or in_process)
        job = env.get("MESHCOMM_JOB_ID", "")
        material = secret.encode() if secret else (local_key or b"")
        key = hmac.new(material, b"meshcomm objects\0" + job.encode(), hashlib.sha256).digest()
        return cls(key, True)

    def require(self, who: str, op: str) -> None:
        """Refuse (before any communication) to take objects that nothing authenticates."""
        if self.key is None and not self.unsealed_ok:
            raise ConfigError(
                f"{who}: {op}: refusing to unpickle objects from other ranks without MESHCOMM_JOB_SECRET: "
                "unpickling runs code, and without the job secret nothing shows that the bytes come from a "
                "rank of this job unchanged (arbitrary code execution as the job's user). Give every rank the "
                "same MESHCOMM_JOB_SECRET (meshcomm launch does), or set MESHCOMM_UNSAFE_OBJECTS=1 on every "
                "rank if only trusted processes can reach the job"
            )

    def _tag(self, where: str, seq: int, sender: int, data: bytes) -> bytes:
        assert self.key is not None
        mac = hmac.new(self.key, b"meshcomm-object\0" + where.encode() + b"\0", hashlib.sha256)
        mac.update(seq.to_bytes(8, "little") + sender.to_bytes(4, "little") + len(data).to_bytes(8, "little"))
        mac.update(data)
        return mac.digest()

    def seal(self, where: str, seq: int, sender: int, data: bytes) -> bytes:
        """``data`` and its tag: object call ``seq`` of group ``where`` sent by rank ``sender``."""
        return data + self._tag(where, seq, sender, data) if self.key is not None else data

    def open(self, where: str, seq: int, sender: int, payload: bytes, who: str, op: str) -> bytes:
        """The pickled bytes of ``payload`` once its tag holds; ObjectAuthError otherwise."""
        if self.key is None:
            return payload
        data, tag = payload[: len(payload) - TAG_BYTES], payload[len(payload) - TAG_BYTES :]
        if len(payload) < TAG_BYTES or not hmac.compare_digest(self._tag(where, seq, sender, data), tag):
            raise ObjectAuthError(
                f"{who}: {op}: the object from rank {sender} failed authentication (its tag does not match "
                "its bytes under the job secret): it was changed on the way, or not sent by that rank of this "
                "job, or the ranks were given different MESHCOMM_JOB_SECRET values. Nothing was unpickled."
            )
        return data
