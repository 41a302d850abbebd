"""Which dtypes meshcomm moves and how each is reduced, so that every backend agrees."""

from __future__ import annotations

import numpy as np

from .operations import REDUCTIONS

__all__ = ["SUPPORTED", "check_dtype", "reducer", "dtype_code", "dtype_from_code", "bfloat16", "REDUCTIONS", "UFUNCS"]

try:  # optional: bfloat16 as NumPy sees it
    from ml_dtypes import bfloat16 as _bf16

    bfloat16: np.dtype | None = np.dtype(_bf16)
except ImportError:  # pragma: no cover - depends on the environment
    bfloat16 = None

_BASE = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
]
SUPPORTED: tuple[np.dtype, ...] = tuple(np.dtype(t) for t in _BASE) + (
    (bfloat16,) if bfloat16 is not None else ()
)
_CODES = {dt: i + 1 for i, dt in enumerate(SUPPORTED)}

#: the NumPy function of each reduction (what every backend's result must equal)
UFUNCS: dict[str, np.ufunc] = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def check_dtype(dtype: np.dtype, *, what: str = "array") -> np.dtype:
    """Return ``dtype`` if meshcomm can move it, else raise a ValueError listing what it can."""
    dt = np.dtype(dtype)
    if dt in _CODES:  # the common case first: one dict lookup
        return dt
    if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
        raise ValueError(f"{what} has byte-swapped dtype {dt}; convert it with .astype({dt.newbyteorder('=')})")
    names = ", ".join(str(d) for d in SUPPORTED)
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
    return code if code is not None else _CODES[np.dtype(dtype)]


def dtype_from_code(code: int) -> np.dtype | None:
    """Inverse of :func:`dtype_code`; None for an unknown code."""
    for dt, c in _CODES.items():
        if c == code:
            return dt
    return None
