"""Affine group quantization of weights, packed into ``uint32`` words in MLX's layout.

Every ``group_size`` consecutive elements of a row share one ``scale`` and one ``bias``;
each element is stored as an unsigned ``bits``-bit integer ``q`` with
``w ≈ scale * q + bias``. The integers are packed from the lowest bit upwards into a
little-endian stream of ``uint32`` words, one stream per row, so 2-, 4- and 8-bit values
never straddle a word and 3-, 5- and 6-bit values do. This is the layout of
``mlx.core.quantize``: arrays quantized by MLX dequantize here to the same values, and
arrays quantized here load into MLX.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["quantize", "dequantize", "pack_bits", "unpack_bits", "SUPPORTED_BITS"]

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
"""Bit widths MLX's affine mode supports, and so do we."""


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; expected one of {SUPPORTED_BITS}")


def _check_group(cols: int, group_size: int, bits: int) -> None:
    """A row must split into whole groups, and every group must start on a word boundary."""
    _check_bits(bits)
    if group_size < 2 or (group_size * bits) % 32:
        raise ValueError(
            f"group_size={group_size} with bits={bits}: a group of {group_size * bits} bits does not "
            f"fill whole 32-bit words (MLX uses group sizes 32, 64 and 128)"
        )
    if cols % group_size:
        raise ValueError(
            f"the last axis of size {cols} cannot be split into groups of {group_size}: "
            f"{cols} is not divisible by {group_size}"
        )


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned integers ``< 2**bits`` along the last axis into ``uint32`` words.

    Element ``i`` of a row occupies bits ``[i * bits, (i + 1) * bits)`` of the row's
    little-endian bit stream; the last axis shrinks from ``n`` to ``n * bits / 32``.
    """
    _check_bits(bits)
    q = np.asarray(q)
    n = q.shape[-1]
    if (n * bits) % 32:
        raise ValueError(f"cannot pack {n} values of {bits} bits into whole 32-bit words")
    shifts = np.arange(bits, dtype=np.uint8)
    stream = ((q.astype(np.uint8)[..., None] >> shifts) & 1).reshape(*q.shape[:-1], n * bits)
    packed = np.packbits(stream, axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def unpack_bits(w_q: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of :func:`pack_bits`: ``uint32`` words to one ``uint8`` per value."""
    _check_bits(bits)
    words = np.ascontiguousarray(np.asarray(w_q, dtype=np.uint32)).astype("<u4")
    stream = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    n = stream.shape[-1] // bits
    stream = stream.reshape(*words.shape[:-1], n, bits)
    weights = (1 << np.arange(bits, dtype=np.uint8)).astype(np.uint8)
    return (stream * weights).sum(axis=-1, dtype=np.uint8)


def _compute_dtype(dtype: np.dtype) -> Any:
    return np.float64 if dtype == np.float64 else np.float32


def check_mode(mode: str) -> None:
    if mode != "affine":
        raise ValueError(f"mode={mode!r} is not supported; meshcomm.nn implements only 'affine'")


def quantize(
    w: Any, group_size: int = 64, bits: int = 4, mode: str = "affine", *, snap_zero: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``w`` in groups of ``group_size`` along its last axis.

    Args:
        w (array): floating-point array, at least 1-D, last axis divisible by ``group_size``.
        group_size (int): elements sharing a scale and bias. Default: ``64``.
        bits (int): bits per element, one of 1, 2, 3, 4, 5, 6, 8. Default: ``4``.
        mode (str): only ``"affine"`` (MLX's other modes are not implemented). Default: ``"affine"``.
        snap_zero (bool): the default, ``False``, is the formula MLX documents:
            ``scale = (max - min) / (2**bits - 1)``, ``bias = min``, which keeps every
            element within half a step of its original value. ``True`` reproduces what
            ``mlx.core.quantize`` actually computes, bit for bit: the grid is moved so the
            group's end of largest magnitude and zero are exact, which costs up to one
            whole step of error at the other end (for ``bits=1`` MLX, and so this
            function, use the documented formula either way). Default: ``False``.

    Returns:
        ``(w_q, scales, biases)``: ``w_q`` is ``uint32`` with the last axis
        ``n * bits / 32``; ``scales`` and ``biases`` have the last axis ``n / group_size``
        and the dtype of ``w`` (float32 for non-float input).
    """
    check_mode(mode)
    a = np.asarray(w)
    if a.ndim == 0:
        raise ValueError("quantize needs an array with at least one axis, got a 0-d array")
    _check_group(a.shape[-1], group_size, bits)
    out_dtype = a.dtype if np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16" else np.dtype(np.float32)
    ct = _compute_dtype(out_dtype)
    n_bins = ct(2**bits - 1)
    g = a.astype(ct).reshape(*a.shape[:-1], a.shape[-1] // group_size, group_size)
    w_max = g.max(axis=-1, keepdims=True)
    w_min = g.min(axis=-1, keepdims=True)
    if snap_zero and bits > 1:
        # The end of larger magnitude becomes the bias and is exact; the scale is
        # adjusted so that zero lands on a grid point too.
        neg = np.abs(w_min) > np.abs(w_max)
        step = np.maximum((w_max - w_min) / n_bins, ct(1e-7))
        step = np.where(neg, step, -step)
        edge = np.where(neg, w_min, w_max)
        q_edge = np.round(edge / step)
        safe = np.where(q_edge == 0, ct(1), q_edge)
        scale = np.where(q_edge != 0, edge / safe, step)
        bias = np.where(q_edge == 0, ct(0), edge)
    else:
        scale = np.maximum((w_max - w_min) / n_bins, ct(1e-7))
        bias = w_min
        if not snap_zero:
            # Quantize against the stored (rounded) scale and bias so the round trip
            # uses exactly the values dequantize will see (MLX uses the unrounded ones).
            scale = scale.astype(out_dtype).astype(ct)
            bias = bias.astype(out_dtype).astype(ct)
    q = np.clip(np.round((g - bias) / scale), 0, n_bins).astype(np.uint8)
    w_q = pack_bits(q.reshape(a.shape), bits)
    return w_q, scale[..., 0].astype(out_dtype), bias[..., 0].astype(out_dtype)


def dequantize(
    w_q: Any, scales: Any, biases: Any, group_size: int = 64, bits: int = 4, mode: str = "affine"
) -> np.ndarray:
    """``scale * q + bias`` for every packed element; the result has the dtype of ``scales``.

    Accepts the output of :func:`quantize` or of ``mlx.core.quantize`` (converted with
    ``np.array``).
    """
    check_mode(mode)
    s = np.asarray(scales)
    b = np.asarray(biases)
    q = unpack_bits(np.asarray(w_q), bits)
    _check_group(q.shape[-1], group_size, bits)
    groups = q.shape[-1] // group_size
    if s.shape != (*q.shape[:-1], groups) or b.shape != s.shape:
        raise ValueError(
            f"scales {s.shape} and biases {b.shape} do not match packed weights {np.shape(w_q)} "
            f"with group_size={group_size}, bits={bits}: expected {(*q.shape[:-1], groups)}"
        )
    # Multiply and add in the dtype of the scales, rounding after each step as MLX does,
    # so half-precision results match MLX's bit for bit.
    qg = q.reshape(*q.shape[:-1], groups, group_size).astype(s.dtype)
    w = qg * s[..., None] + b.astype(s.dtype)[..., None]
    return w.reshape(q.shape)
