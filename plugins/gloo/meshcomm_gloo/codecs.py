"""How each (dtype, reduction) travels through gloo, which reduces only some dtypes.

gloo (inside torch 2.13) reduces int8, uint8, int32, int64, float16, bfloat16, float32
and float64 with sum/max/min, and complex only with sum. Every other case is mapped
onto those exactly, so results match NumPy bit for bit:

* bool: as uint8; sum (logical or) is max.
* uint32/uint64 sum: reinterpreted as int32/int64 (two's complement wrap is the same).
* uint32/uint64 max/min: the sign bit flipped, which maps unsigned order onto signed order.
* int16/uint16: widened to int32 (sum mod 2**16 survives the wider wrap; max/min exact).
* float max/min: a sortable integer key, because gloo's max/min drops a NaN that NumPy
  propagates; a NaN becomes the extreme key so it wins, as in NumPy.
* complex sum: the real and imaginary parts as a float array of twice the length.
* complex max/min (NumPy's lexicographic order): no gloo path; the backend runs the
  core's generic algorithm over gloo send/recv instead (``Plan.generic``).

This module is pure NumPy so it can be tested without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from meshcomm.plugin import check_dtype

__all__ = ["Plan", "plan_for", "GLOO_WIRE"]

#: NumPy dtypes gloo reduces, and the torch dtype name of each (bfloat16 rides as int16 bits)
GLOO_WIRE = ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")

Encode = Callable[[np.ndarray], np.ndarray]
Decode = Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class Plan:
    """One way to reduce a dtype with one op on gloo.

    ``wire`` is the NumPy dtype of the buffer gloo sees, ``torch`` the torch dtype name it is
    viewed as, ``op`` gloo's reduction. With ``codec`` None the user's buffers are viewed in
    place (zero copy); otherwise ``codec = (encode, decode)``: ``encode`` makes a fresh wire
    array and ``decode`` writes the wire result into the output. ``generic`` means: no gloo reduction fits.
    """

    wire: np.dtype
    torch: str
    op: str
    codec: tuple[Encode, Decode] | None = None
    generic: bool = False


def _view(dt: str, torch_name: str | None = None, op: str | None = None) -> Callable[[str], Plan]:
    return lambda o: Plan(np.dtype(dt), torch_name or dt, op or o)


def _widen(o: str) -> Plan:
    def enc(x: np.ndarray) -> np.ndarray:
        return x.astype(np.int32)

    def dec(w: np.ndarray, out: np.ndarray) -> None:
        out[...] = w.astype(out.dtype)  # C-style narrowing keeps the low bits: NumPy's wrap

    return Plan(np.dtype(np.int32), "int32", o, (enc, dec))


def _flip(bits: int) -> Callable[[str], Plan]:
    signed = np.dtype(f"int{bits}")
    sign = signed.type(np.iinfo(signed).min)

    def enc(x: np.ndarray) -> np.ndarray:
        return x.view(signed) ^ sign

    def dec(w: np.ndarray, out: np.ndarray) -> None:
        np.bitwise_xor(w, sign, out=out.view(signed))

    return lambda o: Plan(signed, signed.name, o, (enc, dec))


def _float_key(bits: int) -> Callable[[str], Plan]:
    """Max/min of floats as integers: ``key = b ^ ((b >> (bits-1)) & MAX)`` is monotone in
    the float's value (-0.0 sorts below +0.0); NaN gets the key that wins the reduction."""
    signed = np.dtype(f"int{bits}")
    info = np.iinfo(signed)
    mag = signed.type(info.max)
    shift = signed.type(bits - 1)
    wire = np.dtype(np.int32) if bits == 16 else signed  # gloo has no int16

    def make(o: str) -> Plan:
        nan_key = signed.type(info.max if o == "max" else info.min)

        def enc(x: np.ndarray) -> np.ndarray:
            b = x.view(signed)
            key = b ^ ((b >> shift) & mag)
            key[np.isnan(x)] = nan_key
            return key.astype(wire, copy=False)

        def dec(w: np.ndarray, out: np.ndarray) -> None:
            key = w.astype(signed, copy=False)
            np.bitwise_xor(key, (key >> shift) & mag, out=out.view(signed))

        return Plan(wire, wire.name, o, (enc, dec))

    return make


def _generic(o: str) -> Plan:
    return Plan(np.dtype(np.uint8), "uint8", o, generic=True)


#: how each dtype (by name) travels per op; a dtype not named here is gloo's own (a view)
_RULES: dict[str, dict[str, Callable[[str], Plan]]] = {
    "bool": {"sum": _view("uint8", op="max"), "max": _view("uint8"), "min": _view("uint8")},
    "int16": dict.fromkeys(("sum", "max", "min"), _widen),
    "uint16": dict.fromkeys(("sum", "max", "min"), _widen),
    "uint32": {"sum": _view("int32"), "max": _flip(32), "min": _flip(32)},
    "uint64": {"sum": _view("int64"), "max": _flip(64), "min": _flip(64)},
    "float16": {"sum": _view("float16"), "max": _float_key(16), "min": _float_key(16)},
    "bfloat16": {"sum": _view("int16", "bfloat16"), "max": _float_key(16), "min": _float_key(16)},
    "float32": {"sum": _view("float32"), "max": _float_key(32), "min": _float_key(32)},
    "float64": {"sum": _view("float64"), "max": _float_key(64), "min": _float_key(64)},
    "complex64": {"sum": _view("float32"), "max": _generic, "min": _generic},
    "complex128": {"sum": _view("float64"), "max": _generic, "min": _generic},
}
#: the plans made so far: built on first use, so that bfloat16 (a dtype only once the user's
#: program has imported ml_dtypes) costs nothing to a program without it
_PLANS: dict[tuple[np.dtype, str], Plan] = {}


def plan_for(dtype: np.dtype, op: str) -> Plan:
    """The plan reducing ``dtype`` with ``op``; ValueError for a dtype or op meshcomm lacks."""
    key = (np.dtype(dtype), op)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    try:
        dt = check_dtype(key[0])
        make = _RULES.get(dt.name, dict.fromkeys(("sum", "max", "min"), _view(dt.name)))[op]
    except (ValueError, KeyError):
        raise ValueError(
            f"gloo backend: no way to reduce dtype {np.dtype(dtype)} with op {op!r}; "
            "ops are 'sum', 'max', 'min' and dtypes those of meshcomm.protocol.dtypes.SUPPORTED"
        ) from None
    plan = _PLANS[key] = make(op)
    return plan
