"""Control notices between MPI ranks as bytes that cannot carry code.

The control channel's notices are small dicts, lists, tuples, numbers and strings. mpi4py's
lower-case ``isend``/``recv`` would pickle them, and an unrestricted ``pickle.loads`` of what
arrives runs code chosen by whoever could write into MPI's traffic (MPI's TCP links are not
authenticated). Here they are pickled, and unpickled by an unpickler that refuses every global
(class or function) name: plain data loads, anything that could call code is an error.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["encode", "decode", "NoticeError"]


class NoticeError(ValueError):
    """A control notice that is not plain data."""


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise NoticeError(f"a control notice names {module}.{name}: notices carry plain data only")


def encode(obj: Any) -> bytes:
    """``obj`` (plain data) as the bytes of one notice."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes | bytearray) -> Any:
    """The plain data of one notice; NoticeError for anything else (nothing is called)."""
    try:
        return _DataOnly(io.BytesIO(bytes(data))).load()
    except NoticeError:
        raise
    except Exception as exc:
        raise NoticeError(f"a control notice could not be read: {type(exc).__name__}: {exc}") from None
