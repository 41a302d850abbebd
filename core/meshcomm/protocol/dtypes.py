"""Which dtypes meshcomm moves and how each is reduced, so that every backend agrees."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .operations import REDUCTIONS

__all__ = [
    "SUPPORTED",
    "BASE_SUPPORTED",
    "check_dtype",
    "reducer",
    "dtype_code",
    "dtype_from_code",
    "bfloat16",
    "REDUCTIONS",
    "UFUNCS",
]

_BASE = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]
_CODES: dict[np.dtype, int] = {np.dtype(t): i + 1 for i, t in enumerate(_BASE)}
#: the wire code of ``ml_dtypes.bfloat16`` (after the base dtypes, whether or not it is installed)
BFLOAT16_CODE = len(_BASE) + 1
#: every dtype meshcomm moves without importing anything (bfloat16 is admitted on first sight)
BASE_SUPPORTED: tuple[np.dtype, ...] = tuple(_CODES)

# ml_dtypes is optional and slow to import (its ufunc registrations: 0.15 s for 0.6, 0.9 s for
# 0.7 with NumPy 2.4): it is imported only when ``bfloat16``/``SUPPORTED`` is read or a
# bfloat16 code arrives. A user's bfloat16 array exists only once ml_dtypes is imported anyway,
# so check_dtype admits that dtype when it first sees it, without importing anything.
_UNLOADED = object()
_bf16: object = _UNLOADED


def _load_bfloat16() -> np.dtype | None:
    """``np.dtype(ml_dtypes.bfloat16)`` (importing ml_dtypes), or None when not installed."""
    global _bf16
    if _bf16 is _UNLOADED:
        try:
            from ml_dtypes import bfloat16 as bf16
        except ImportError:
            _bf16 = None
        else:
            dt = np.dtype(bf16)
            _CODES[dt] = BFLOAT16_CODE
            _bf16 = dt
    return _bf16  # type: ignore[return-value]


def _is_bfloat16(dt: np.dtype) -> bool:
    """``dt`` is ml_dtypes' bfloat16 (told without importing ml_dtypes)."""
    return dt.name == "bfloat16" and dt.type.__module__.split(".")[0] == "ml_dtypes"


if TYPE_CHECKING:  # resolved by __getattr__ at run time
    SUPPORTED: tuple[np.dtype, ...]
    bfloat16: np.dtype | None


def __getattr__(name: str) -> Any:
    """``bfloat16`` (None without ml_dtypes) and ``SUPPORTED`` (every dtype meshcomm moves,
    bfloat16 included when installed), resolved on first use."""
    if name == "bfloat16":
        return _load_bfloat16()
    if name == "SUPPORTED":
        bf16 = _load_bfloat16()
        return BASE_SUPPORTED + ((bf16,) if bf16 is not None else ())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the NumPy function of each reduction (what every backend's result must equal)
UFUNCS: dict[str, np.ufunc] = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def check_dtype(dtype: np.dtype, *, what: str = "array") -> np.dtype:
    """Return ``dtype`` if meshcomm can move it, else raise a ValueError listing what it can."""
    dt = np.dtype(dtype)
    if dt in _CODES:  # the common case first: one dict lookup
        return dt
    if _is_bfloat16(dt) and dt.isnative:
        _CODES[dt] = BFLOAT16_CODE
        return dt
    if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
        raise ValueError(f"{what} has byte-swapped dtype {dt}; convert it with .astype({dt.newbyteorder('=')})")
    names = ", ".join(str(d) for d in BASE_SUPPORTED) + ", bfloat16 (with ml_dtypes installed)"
    raise ValueError(f"{what} has unsupported dtype {dt}; supported dtypes are: {names}")


def reducer(op: str) -> np.ufunc:
    """The NumPy ufunc for reduction ``op`` (sum of bool is logical or, integers wrap)."""
    try:
        return UFUNCS[op]
    except KeyError:
        raise ValueError(f"unknown reduction {op!r}; expected one of {REDUCTIONS}") from None


def dtype_code(dtype: np.dtype) -> int:
    """A small integer naming ``dtype`` on the wire (same on every rank)."""
    code = _CODES.get(dtype)  # an array's dtype: no conversion (the latency path)
    return code if code is not None else _CODES[check_dtype(dtype)]


def dtype_from_code(code: int) -> np.dtype | None:
    """Inverse of :func:`dtype_code`; None for an unknown code."""
    if code == BFLOAT16_CODE:
        return _load_bfloat16()
    for dt, c in _CODES.items():
        if c == code:
            return dt
    return None
