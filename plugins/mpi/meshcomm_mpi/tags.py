"""Point-to-point message tags that carry the sender's dtype and element count.

meshcomm's ``send``/``recv`` reach the backend as flat buffers, so what a pair must agree
on is (dtype, count). The sender puts both into the MPI tag; the receiver posts its
receive with ``MPI.ANY_TAG`` and compares the tag of the message it got with the tag it
expects. A mismatch is then found without any extra message or byte. The tag holds a
5-bit dtype code and the count modulo ``2**count_bits`` (the bits the MPI library's
``MPI_TAG_UB`` leaves): counts that differ by a multiple of that are not told apart.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TagCodec"]

#: fixed order, identical on every rank: the code of a dtype is its index + 1 (0: other)
_DTYPE_ORDER = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bfloat16",
)
_CODE = {name: i + 1 for i, name in enumerate(_DTYPE_ORDER)}
_DTYPE_BITS = 5


class TagCodec:
    """Encodes (dtype, count) into a tag no larger than ``tag_ub`` and describes tags.

    Args:
        tag_ub: the communicator's ``MPI.TAG_UB`` attribute (at least 32767 by the standard).
    """

    def __init__(self, tag_ub: int) -> None:
        bits = max(int(tag_ub) + 1, 1 << 15).bit_length() - 1
        self.count_bits = bits - _DTYPE_BITS
        self._mask = (1 << self.count_bits) - 1
        self._cache: dict[tuple[np.dtype, int], int] = {}

    def tag(self, dtype: np.dtype, count: int) -> int:
        """The tag of a message of ``count`` elements of ``dtype``."""
        key = (dtype, count)
        t = self._cache.get(key)
        if t is None:
            t = (_CODE.get(dtype.name, 0) << self.count_bits) | (count & self._mask)
            if len(self._cache) < 4096:
                self._cache[key] = t
        return t

    def describe(self, tag: int) -> str:
        """What a tag says about its message, e.g. ``"4 float64"`` (count modulo 2**bits)."""
        code, count = tag >> self.count_bits, tag & self._mask
        name = _DTYPE_ORDER[code - 1] if 0 < code <= len(_DTYPE_ORDER) else "an unlisted dtype"
        return f"{count} elements of {name}"
