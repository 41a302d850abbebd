"""Which MPI datatype and MPI reduction op carry each NumPy dtype and meshcomm op.

Native MPI ops are used where they compute exactly what NumPy computes. Everything
else runs a user-defined MPI op whose body is the NumPy ufunc, still inside MPI's own
reduction algorithms and still on the caller's buffers (no pickling, no copies):

* float16 and bfloat16: MPI has no (portable) half types;
* max/min of floats and complex: MPI's MAX/MIN do not propagate NaN the way
  ``np.maximum`` does (and may then differ between ranks), and MPI has no complex
  MAX/MIN at all (NumPy orders complex numbers lexicographically);
* 8/16-bit integer sums when the MPI library saturates instead of wrapping: Open MPI's
  AVX op component (4.1.x up to at least 5.0.11) uses saturating vector adds, so
  ``100 + 100`` gives ``127`` in int8 on arrays longer than one vector. A local probe
  (:func:`saturating_sum_dtypes`) finds this at start-up.

bool uses MPI's logical ops (sum and max are logical or, min is logical and), which
is what NumPy's add/maximum/minimum do on bool.

This module imports ``mpi4py.MPI``; only the backend factory imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from meshcomm.plugin import UFUNCS as _UFUNCS
from mpi4py import MPI

from .compiled import Carried

__all__ = ["OpTable", "saturating_sum_dtypes", "INTS"]

#: integer dtypes whose sums are probed (Open MPI's AVX kernels saturate 8/16-bit ones)
INTS: tuple[np.dtype, ...] = tuple(
    np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)
)

_NATIVE_TYPES: dict[np.dtype, Any] = {
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}


class _Carriers(dict[np.dtype, Any]):
    """The MPI datatype moving each dtype, made on first use: bfloat16 exists only once a
    user's program has imported ml_dtypes, and reading it here would import ml_dtypes
    (~0.9 s) into every rank."""

    def __missing__(self, dt: np.dtype) -> Any:
        made = self[dt] = _carrier(np.dtype(dt))
        return made


def _carrier(dt: np.dtype) -> Any:
    """A predefined MPI datatype with ``dt``'s size, to move ``dt`` under a user-defined op."""
    if dt in _NATIVE_TYPES:
        return _NATIVE_TYPES[dt]
    return {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}[dt.itemsize]


#: user-defined ops made so far, shared by every table of the process: mpi4py allows only
#: 32 live user-defined ops per process, so each (dtype, ufunc) gets one, made on first use
_USER_OPS: dict[tuple[np.dtype, str], Any] = {}


def _ufunc_op(dt: np.dtype, ufunc: np.ufunc) -> Any:
    """The commutative user-defined MPI op computing ``inout = ufunc(in, inout)`` in ``dt``."""
    key = (dt, ufunc.__name__)
    made = _USER_OPS.get(key)
    if made is None:

        def apply(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            a = np.frombuffer(inbuf, dtype=dt)
            b = np.frombuffer(inoutbuf, dtype=dt)
            ufunc(a, b, out=b)

        made = _USER_OPS[key] = MPI.Op.Create(apply, commute=True)
    return made


def saturating_sum_dtypes(dtypes: Iterable[np.dtype] = INTS) -> list[np.dtype]:
    """The dtypes among ``dtypes`` whose MPI.SUM does not wrap like NumPy, probed locally.

    ``MPI.Op.Reduce_local`` runs the same op kernels as the collectives, so a saturating
    vector kernel shows up here without any communication. The probe is long enough
    (4099 elements) to reach the vector loop and the scalar tail.
    """
    bad = []
    for dt in dtypes:
        info = np.iinfo(dt)
        v = info.max // 2 + 17  # 2 * v overflows
        x = np.full(4099, v, dtype=dt)
        y = x.copy()
        MPI.SUM.Reduce_local([x, _NATIVE_TYPES[dt]], [y, _NATIVE_TYPES[dt]])
        if not np.array_equal(y, np.add(x, x)):
            bad.append(dt)
    return bad


class OpTable:
    """``(MPI datatype, MPI op)`` for every (dtype, op) meshcomm may ask for.

    Native entries are filled in at once; user-defined ops are made on first use
    (:meth:`resolve`), so a program that never reduces float16 never creates that op.

    Args:
        numpy_sums: integer dtypes whose sum must use the NumPy-ufunc op (the probe's finding).
        carried: the carried sum (``compiled.carried``) when every rank of the world has it:
            call checks and small all_sums then travel as its records.
    """

    def __init__(self, numpy_sums: Iterable[np.dtype] = (), carried: Carried | None = None) -> None:
        self.numpy_sums = frozenset(np.dtype(d) for d in numpy_sums)
        self.carried = carried
        #: (dtype, op) -> (MPI datatype, MPI op); the backend reads it on every reduction
        self.table: dict[tuple[np.dtype, str], tuple[Any, Any]] = {}
        #: datatype used to move (not reduce) each dtype
        self.move: dict[np.dtype, Any] = _Carriers()
        for dt in _NATIVE_TYPES:
            for op in _UFUNCS:
                native = self._native_op(dt, op)
                if native is not None:
                    self.table[(dt, op)] = (_carrier(dt), native)

    def _native_op(self, dt: np.dtype, op: str) -> Any:
        """MPI's predefined op when it computes exactly NumPy's result, else None."""
        if dt == np.bool_:
            return MPI.LAND if op == "min" else MPI.LOR
        if dt not in _NATIVE_TYPES:
            return None  # float16, bfloat16
        if dt.kind in "iu" and not (op == "sum" and dt in self.numpy_sums):
            return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        if dt.kind in "fc" and op == "sum":
            return MPI.SUM
        return None

    def resolve(self, dt: np.dtype, op: str) -> tuple[Any, Any]:
        """The entry for (dt, op), making its user-defined op if needed."""
        key = (np.dtype(dt), op)
        entry = self.table.get(key)
        if entry is None:
            if op not in _UFUNCS:
                raise ValueError(f"unknown reduction {op!r}; expected one of {tuple(_UFUNCS)}")
            entry = self.table[key] = (_carrier(key[0]), _ufunc_op(key[0], _UFUNCS[op]))
        return entry
