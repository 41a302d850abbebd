"""Element-wise bounds on the difference between two floating-point evaluations of one quantity.

Sharded and unsharded layers compute the same sums in different orders (BLAS blocking that
depends on the CPU kernel, a cross-rank all_sum of partial sums), so their results may differ
by rounding, and by how much depends on the data, not on one tolerance. These helpers turn
standard error analysis (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
ch. 3) into per-element bounds:

* ``u`` is the unit roundoff of the dtype and ``gamma(k) = k*u / (1 - k*u)``.
* If every term of a sum of products reaches the result through at most ``k`` roundings, the
  computed result is within ``gamma(k) * (the same sum of |terms|)`` of the exact one, for
  any order of evaluation (any summation tree, blocked or vectorised, with or without FMA).
  A dot product of length ``k`` has at most ``k`` roundings per term (one product, ``k - 1``
  additions); split into ``n`` rank-local partial sums that are then all-summed it has at
  most ``ceil(k/n) + n - 1``, which is ``<= k`` whenever every rank holds a term.
* Two evaluations of the same exact quantity therefore differ by at most
  ``2 * gamma(k) * sum|terms|``; the magnitudes ``sum|terms|`` are computed here in float64
  and enlarged by float64's own ``gamma``.

Assumed: no overflow and no underflow (all magnitudes in the tests are far from both), and
products such as ``W @ x`` are formed from the same stored operands (e.g. the quantized
layers' dequantized weights are bit-identical on every rank, so only the order of summation
differs). NumPy computes float16 arithmetic in float32 and rounds, so float16 uses
``u = 2**-11 + 2**-24`` to cover that double rounding.

Set ``MESHCOMM_NUMERICS_LOG=<file>`` to append every :func:`assert_within` call's worst
``|diff| / bound`` ratio (with the pytest test id) to that file, to audit how close a BLAS
kernel comes to the bound.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "unit_roundoff",
    "gamma",
    "sum_roundings",
    "dot_roundings",
    "matmul_bound",
    "sum_bound",
    "mlp_bounds",
    "MLPBounds",
    "assert_within",
]

Layer = tuple[np.ndarray, np.ndarray | None] | None


def unit_roundoff(dtype: Any) -> float:
    """``u = eps / 2`` of ``dtype`` (plus float32's for float16, see the module docstring)."""
    dt = np.dtype(dtype)
    u = float(np.finfo(dt).eps) / 2
    if dt.itemsize < 4:
        u += float(np.finfo(np.float32).eps) / 2
    return u


def gamma(k: int, dtype: Any = np.float32) -> float:
    """Higham's ``gamma_k = k*u / (1 - k*u)``: the relative error of ``k`` roundings."""
    ku = k * unit_roundoff(dtype)
    if not 0 <= ku < 1:
        raise ValueError(f"gamma({k}) is undefined for {np.dtype(dtype)}: k*u = {ku} must be in [0, 1)")
    return ku / (1 - ku)


def sum_roundings(m: int, partials: int = 1) -> int:
    """Most roundings a term of an ``m``-term sum goes through, in one process
    (``m - 1``) or as ``partials`` rank-local sums combined by an all_sum
    (``ceil(m / partials) - 1 + partials - 1``), whichever is larger."""
    if m <= 0:
        return 0
    local = math.ceil(m / partials) - 1 + partials - 1
    return max(m - 1, local)


def dot_roundings(k: int, partials: int = 1) -> int:
    """Most roundings a term of a length-``k`` dot product goes through (one more than
    :func:`sum_roundings`: the product itself)."""
    return sum_roundings(k, partials) + 1 if k > 0 else 0


def _abs64(a: Any) -> np.ndarray:
    return np.abs(np.asarray(a, dtype=np.float64))


def matmul_bound(
    a: Any, b: Any, dtype: Any = np.float32, *, bias: Any = None, partials: int = 1, extra: int = 0
) -> np.ndarray:
    """Bound on ``|c1 - c2|`` (element-wise) for two evaluations of ``a @ b (+ bias)`` in ``dtype``.

    Args:
        a, b: the operands as the code multiplies them (``b`` is e.g. ``weight.T``).
        dtype: the arithmetic's dtype.
        bias: added after the product (one more rounding and ``|bias|`` more magnitude).
        partials: the contraction may be split into that many rank-local partial sums
            combined by an all_sum (either evaluation may be the split one).
        extra: roundings already carried by each term's factors (e.g. 2 when a side forms
            its weights as ``q * scale + bias`` itself, with or without FMA).

    Returns ``2 * gamma(d) * (|a| @ |b| + |bias|)`` with ``d`` the most roundings per term.
    """
    a64, b64 = _abs64(a), _abs64(b)
    magnitude = a64 @ b64
    k = int(a64.shape[-1])
    d = dot_roundings(k, partials) + extra
    if bias is not None:
        magnitude = magnitude + _abs64(bias)
        d += 1
    return 2 * gamma(d, dtype) * (1 + gamma(k + 1, np.float64)) * magnitude


def sum_bound(terms: Sequence[Any], dtype: Any = np.float32, *, divide_by: int = 1) -> np.ndarray:
    """Bound on ``|s1 - s2|`` for two evaluations of ``(terms[0] + ... + terms[n-1]) / divide_by``
    in ``dtype`` (any order, e.g. an all_sum across ``n`` ranks against a local sum). Dividing
    by a power of two is exact; any other divisor counts one more rounding."""
    magnitude = sum(_abs64(t) for t in terms)
    d = max(len(terms) - 1, 0) + (0 if divide_by & (divide_by - 1) == 0 else 1)
    return 2 * gamma(d, dtype) * (1 + gamma(len(terms), np.float64)) * np.asarray(magnitude) / divide_by


@dataclass
class MLPBounds:
    """Element-wise bounds on the difference between two evaluations of an MLP.

    ``output`` and ``input_grad`` have the shapes of the output and of ``x``; ``grads`` has
    one dict per layer (``{}`` for ReLU) with ``"weight"`` and ``"bias"`` bounds, like
    ``Sequential.grads["layers"]``. ``reference_grads`` are the float64 parameter gradients
    and ``grad_errors`` bound ``|one float32 evaluation - reference|`` (half of ``grads``
    plus the reference's own float64 error), to compose further steps such as an update.
    """

    output: np.ndarray
    input_grad: np.ndarray | None = None
    grads: list[dict[str, np.ndarray]] = field(default_factory=list)
    reference_grads: list[dict[str, np.ndarray]] = field(default_factory=list)
    grad_errors: list[dict[str, np.ndarray]] = field(default_factory=list)


def mlp_bounds(
    layers: Sequence[Layer],
    x: Any,
    grad_output: Any = None,
    dtype: Any = np.float32,
    *,
    partials: int = 1,
    batch_partials: int = 1,
    weight_errors: Sequence[Layer] | None = None,
) -> MLPBounds:
    """Bounds for two evaluations (e.g. sharded and unsharded) of ``x -> layers`` and of its
    backward pass from ``grad_output``; each layer is ``(weight, bias)``, applying
    ``h @ weight.T + bias`` (bias may be ``None``), or ``None`` for a ReLU.

    Argument (per evaluation, against the exact value): an activation's error e goes through
    the absolute-value network, e_out = |W| e_in + |dW| |h_in| (ReLU is exact, 1-Lipschitz and
    monotone: it passes e through its mask), plus the layer's own rounding gamma_d * (|W| |h_in|
    + |b|) over computed magnitudes, d = its dot-product roundings; the backward pass and the
    parameter gradients (g^T h: two erroneous factors) likewise. This is at most the
    gamma_(sum of d) * |x|-through-|W| bound (Higham's Lemma 3.3), and tighter, since local
    roundings scale with |h|. The masks must agree, so each pre-activation must be farther
    from 0 than its error bound, else ValueError (no rounding bound covers a flipped branch).

    Args:
        partials: the forward and input-gradient contractions may be split across that
            many ranks (tensor parallelism).
        batch_partials: the batch sums of the parameter gradients may be split across
            that many ranks (data parallelism: an all_sum of per-replica gradients).
        weight_errors: per layer, bounds on ``|computed - given|`` of weight and bias when
            the weights used were themselves computed (e.g. by an update); default exact.

    The exact values are approximated in float64; their own error (gamma of float64 times
    the absolute-value network) is added wherever an exact magnitude is needed.
    """
    f64 = np.float64
    x64 = np.asarray(x, dtype=f64)
    errs = list(weight_errors) if weight_errors is not None else [None] * len(layers)
    zero = np.zeros(())
    # Forward: float64 values h, errors e of one evaluation, |.| network a and its
    # float64 roundings dd (for the reference's own error gamma_f64(dd) * a).
    h, e, a, dd = [x64], [np.zeros_like(x64)], [np.abs(x64)], [0]
    masks: list[np.ndarray | None] = []
    for i, layer in enumerate(layers):
        if layer is None:
            z, ez = h[-1], e[-1]
            slack = gamma(dd[-1], f64) * a[-1]
            close = np.abs(z) <= ez + slack
            if close.any():
                idx = tuple(int(j) for j in np.argwhere(close)[0])
                raise ValueError(
                    f"ReLU at layer {i}: pre-activation {z[idx]:.3g} at {idx} is within its "
                    f"rounding bound {ez[idx] + slack[idx]:.3g} of 0, so two evaluations may take "
                    f"different branches and no rounding bound applies; choose other data"
                )
            mask = z > 0
            masks.append(mask)
            h.append(np.where(mask, z, 0.0))
            e.append(np.where(mask, ez, 0.0))
            a.append(np.where(mask, a[-1], 0.0))
            dd.append(dd[-1])
            continue
        w, b = (None if v is None else np.asarray(v, dtype=f64) for v in layer)
        ew, eb = (zero, zero) if errs[i] is None else (_abs64(v) for v in errs[i])
        masks.append(None)
        exact_in = np.abs(h[-1]) + gamma(dd[-1], f64) * a[-1]  # >= |exact input|
        computed_in = exact_in + e[-1]  # >= |computed input|
        d = dot_roundings(w.shape[1], partials) + (b is not None)
        wc = np.abs(w) + ew  # >= |computed weight|
        bc = (np.abs(b) + eb) if b is not None else zero
        err = (
            gamma(d, dtype) * (computed_in @ wc.T + bc)  # this layer's rounding
            + computed_in @ np.broadcast_to(ew, w.shape).T  # the weight's own error
            + e[-1] @ np.abs(w).T
            + (eb if b is not None else zero)
        )  # propagated
        h.append(h[-1] @ w.T + (b if b is not None else 0.0))
        e.append(err)
        a.append(a[-1] @ np.abs(w).T + (np.abs(b) if b is not None else 0.0))
        dd.append(dd[-1] + d)
    out = MLPBounds(output=2 * e[-1])
    if grad_output is None:
        return out
    # Backward: float64 gradient g, its error eg, |.| network bg, float64 roundings dg.
    g = np.asarray(grad_output, dtype=f64)
    eg, bg, dg = np.zeros_like(g), np.abs(g), 0
    batch = int(np.prod(x64.shape[:-1]))
    out.grads = [{} for _ in layers]
    out.reference_grads = [{} for _ in layers]
    out.grad_errors = [{} for _ in layers]

    def rows(v: np.ndarray) -> np.ndarray:
        return v.reshape(-1, v.shape[-1])

    for i in reversed(range(len(layers))):
        layer = layers[i]
        if layer is None:
            mask = masks[i]
            g, eg, bg = np.where(mask, g, 0.0), np.where(mask, eg, 0.0), np.where(mask, bg, 0.0)
            continue
        w, b = (None if v is None else np.asarray(v, dtype=f64) for v in layer)
        ew = zero if errs[i] is None else _abs64(errs[i][0])
        g_exact = np.abs(g) + gamma(dg, f64) * bg
        g_comp = g_exact + eg
        h_exact = np.abs(h[i]) + gamma(dd[i], f64) * a[i]
        h_comp = h_exact + e[i]
        db = dot_roundings(batch, batch_partials)
        refs = {"weight": rows(g).T @ rows(h[i])}
        errors = {
            "weight": gamma(db, dtype) * (rows(g_comp).T @ rows(h_comp))
            + rows(eg).T @ rows(h_comp)
            + rows(g_exact).T @ rows(e[i])
            + gamma(db + dg + dd[i], f64) * (rows(bg).T @ rows(a[i]))
        }
        if b is not None:
            sb = sum_roundings(batch, batch_partials)
            refs["bias"] = rows(g).sum(axis=0)
            errors["bias"] = (
                gamma(sb, dtype) * rows(g_comp).sum(axis=0)
                + rows(eg).sum(axis=0)
                + gamma(sb + dg, f64) * rows(bg).sum(axis=0)
            )
        out.reference_grads[i] = refs
        out.grad_errors[i] = errors
        # Two evaluations: twice the float32 part (the float64 term is counted once each
        # way too, which only adds a negligible amount).
        out.grads[i] = {k: 2 * v for k, v in errors.items()}
        dk = dot_roundings(w.shape[0], partials)
        wc = np.abs(w) + ew
        eg = gamma(dk, dtype) * (g_comp @ wc) + g_comp @ np.broadcast_to(ew, w.shape) + eg @ np.abs(w)
        g, bg, dg = g @ w, bg @ np.abs(w), dg + dk
    out.input_grad = 2 * eg
    return out


def assert_within(got: Any, want: Any, bound: Any, what: str) -> float:
    """Assert ``|got - want| <= bound`` element-wise (compared in float64) and return the
    worst ``|got - want| / bound``; the failure names the worst element, both values, its
    bound and how many elements exceed theirs."""
    g = np.asarray(np.asarray(got).astype(np.float64))
    w = np.asarray(np.asarray(want).astype(np.float64))
    b = np.broadcast_to(np.asarray(bound, dtype=np.float64), w.shape)
    if g.shape != w.shape:
        raise AssertionError(f"{what}: shape {g.shape} differs from the expected {w.shape}")
    diff = np.abs(g - w)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(diff == 0, 0.0, diff / b)
    ratio = np.where(np.isnan(g) | np.isnan(w), np.inf, ratio)
    worst = float(ratio.max()) if ratio.size else 0.0
    _log(what, worst)
    if worst > 1:
        idx = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        over = int((ratio > 1).sum())
        raise AssertionError(
            f"{what}: element {tuple(int(i) for i in idx)} is {float(g[idx])!r}, expected "
            f"{float(w[idx])!r}: |diff| = {diff[idx]:.4g} exceeds the rounding bound "
            f"{b[idx]:.4g} ({worst:.4g} times); {over} of {ratio.size} elements exceed their bound"
        )
    return worst


def _log(what: str, worst: float) -> None:
    path = os.environ.get("MESHCOMM_NUMERICS_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{test}\t{what}\t{worst:.6g}\n")
