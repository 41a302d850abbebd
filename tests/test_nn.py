"""Tests of meshcomm.nn: quantization (against MLX where installed), layers, gradients
(finite differences and the unsharded model), sharding on 1, 2 and 4 threaded ranks,
gradient averaging, and the examples (directly and under ``meshcomm launch``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import meshcomm as mc
import numpy as np
import pytest
from meshcomm import nn
from meshcomm.testing.threaded import run_threaded
from numerics import assert_within, gamma, matmul_bound, mlp_bounds, sum_bound

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SIZES = [1, 2, 4]

try:
    import mlx.core as mx
except Exception:  # pragma: no cover - depends on the platform
    mx = None
needs_mlx = pytest.mark.skipif(mx is None, reason="mlx is not installed (pip install 'mlx[cpu]' on Linux)")


def rand(*shape: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def unpack_reference(w_q: np.ndarray, bits: int) -> np.ndarray:
    """Slow, obviously-correct unpacking: element i is bits [i*bits, (i+1)*bits) of the row."""
    rows = w_q.reshape(-1, w_q.shape[-1])
    out = []
    for row in rows:
        big = sum(int(word) << (32 * j) for j, word in enumerate(row))
        n = row.size * 32 // bits
        out.append([(big >> (i * bits)) & ((1 << bits) - 1) for i in range(n)])
    return np.array(out).reshape(*w_q.shape[:-1], -1)


# --------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("bits", nn.SUPPORTED_BITS)
def test_pack_bits_layout(bits):
    q = np.random.default_rng(bits).integers(0, 2**bits, size=(3, 64)).astype(np.uint8)
    packed = nn.pack_bits(q, bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 64 * bits // 32)
    np.testing.assert_array_equal(unpack_reference(packed, bits), q)
    np.testing.assert_array_equal(nn.unpack_bits(packed, bits), q)


def test_pack_bits_known_words():
    # 4 bits: the first element in the lowest nibble.
    assert nn.pack_bits(np.arange(8, dtype=np.uint8)[None], 4)[0, 0] == 0x76543210
    assert nn.pack_bits(np.array([[1, 2, 3, 255]], np.uint8), 8)[0, 0] == 0xFF030201
    # 3 bits: element 10 straddles words 0 and 1 (bits 30..32).
    q = np.zeros((1, 32), np.uint8)
    q[0, 10] = 0b111
    assert list(nn.pack_bits(q, 3)[0, :2]) == [0xC0000000, 0x1]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_round_trip_within_half_a_step(bits, group_size):
    w = rand(8, 256, seed=bits) * np.linspace(0.1, 3, 8, dtype=np.float32)[:, None]
    w_q, scales, biases = nn.quantize(w, group_size, bits)
    assert w_q.dtype == np.uint32 and w_q.shape == (8, 256 * bits // 32)
    assert scales.shape == biases.shape == (8, 256 // group_size)
    assert scales.dtype == biases.dtype == np.float32
    back = nn.dequantize(w_q, scales, biases, group_size, bits)
    err = np.abs(back - w).reshape(8, -1, group_size).max(axis=-1)
    step = (w.reshape(8, -1, group_size).max(-1) - w.reshape(8, -1, group_size).min(-1)) / (2**bits - 1)
    np.testing.assert_allclose(scales, step, rtol=1e-6)
    assert np.all(err <= 0.5 * step * (1 + 1e-5) + 1e-6), (err / step).max()


def test_round_trip_half_precision_and_constant_groups():
    import ml_dtypes

    for dtype in (np.float16, ml_dtypes.bfloat16):
        w = rand(4, 128, dtype=dtype)
        w_q, s, b = nn.quantize(w, 64, 4)
        assert s.dtype == b.dtype == np.dtype(dtype)
        back = nn.dequantize(w_q, s, b, 64, 4)
        assert back.dtype == np.dtype(dtype)
        err = np.abs(back.astype(np.float32) - w.astype(np.float32)).max()
        assert err <= 0.5 * float(s.astype(np.float32).max()) + 0.02
    const = np.full((2, 64), 0.75, np.float32)
    np.testing.assert_array_equal(nn.dequantize(*nn.quantize(const, 64, 4), 64, 4), const)


def test_quantize_errors():
    with pytest.raises(ValueError, match="100 .* not divisible by 64"):
        nn.quantize(np.zeros((2, 100), np.float32), 64, 4)
    with pytest.raises(ValueError, match="bits=7"):
        nn.quantize(np.zeros((2, 64), np.float32), 64, 7)
    with pytest.raises(ValueError, match="group_size=10"):
        nn.quantize(np.zeros((2, 40), np.float32), 10, 4)
    with pytest.raises(ValueError, match="mxfp4"):
        nn.quantize(np.zeros((2, 64), np.float32), 32, 4, mode="mxfp4")
    w_q, s, b = nn.quantize(np.zeros((2, 128), np.float32), 64, 4)
    with pytest.raises(ValueError, match="do not match"):
        nn.dequantize(w_q, s[:, :1], b[:, :1], 64, 4)


@needs_mlx
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_mlx_quantized_weights_dequantize_identically(bits, dtype):
    """MLX's packed weights, scales and biases give bit-identical values here."""
    w = mx.array(rand(16, 256, seed=bits)).astype(getattr(mx, dtype))
    for group_size in (32, 64, 128):
        w_q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        expect = np.array(mx.dequantize(w_q, scales, biases, group_size=group_size, bits=bits).astype(mx.float32))
        ours = nn.dequantize(np.array(w_q), _to_np(scales), _to_np(biases), group_size, bits)
        np.testing.assert_array_equal(ours.astype(np.float32), expect)


def _to_np(a):
    """An MLX array as NumPy, keeping bfloat16 through ml_dtypes."""
    if a.dtype == mx.bfloat16:
        import ml_dtypes

        return np.array(a.astype(mx.float32)).astype(ml_dtypes.bfloat16)
    return np.array(a)


@needs_mlx
@pytest.mark.parametrize("bits", nn.SUPPORTED_BITS)
def test_snap_zero_reproduces_mlx_quantize(bits):
    """``snap_zero=True`` is MLX's quantize bit for bit; the default is its documented formula."""
    w = rand(16, 256, seed=10 + bits)
    w_q, scales, biases = mx.quantize(mx.array(w), group_size=64, bits=bits)
    ours = nn.quantize(w, 64, bits, snap_zero=True)
    np.testing.assert_array_equal(ours[0], np.array(w_q))
    np.testing.assert_array_equal(ours[1], np.array(scales))
    np.testing.assert_array_equal(ours[2], np.array(biases))
    # MLX dequantizes our default output to exactly what we do.
    d_q, d_s, d_b = nn.quantize(w, 64, bits)
    theirs = np.array(mx.dequantize(mx.array(d_q), mx.array(d_s), mx.array(d_b), group_size=64, bits=bits))
    np.testing.assert_array_equal(nn.dequantize(d_q, d_s, d_b, 64, bits), theirs)


@needs_mlx
def test_quantized_linear_matches_mlx():
    import mlx.nn as mnn

    mx.random.seed(3)
    ref = mnn.QuantizedLinear(128, 32, bias=True, group_size=64, bits=4)
    ref.bias = mx.random.normal((32,))
    ql = nn.QuantizedLinear(128, 32, group_size=64, bits=4, rng=0)
    ql.update({k: np.array(getattr(ref, k)) for k in ("weight", "scales", "biases", "bias")})
    x = rand(5, 128)
    # MLX's CPU kernel forms each weight as scale * q + bias (FMA or not) and accumulates
    # x * w in float32, then adds the bias; we round q * scale, add the bias, use a BLAS dot.
    # Both evaluate sum_j x_j (s q_j + b) + bias in float32 with at most 2 (dequantization)
    # + 128 (dot) + 1 (bias) roundings per term, of magnitude |x| @ (|s| q + |b|).
    q = nn.unpack_bits(ql.weight, 4).astype(np.float64)
    per_weight = np.repeat(np.abs(ql.scales.astype(np.float64)), 64, axis=1) * q + np.repeat(
        np.abs(ql.biases.astype(np.float64)), 64, axis=1
    )
    assert_within(
        ql(x),
        np.array(ref(mx.array(x))),
        matmul_bound(x, per_weight.T, bias=ql.bias, extra=2),
        "QuantizedLinear vs MLX",
    )
    assert ql.weight.shape == ref.weight.shape and ql.scales.shape == ref.scales.shape


# --------------------------------------------------------------------------- layers


def test_linear_init_like_mlx_and_seedable():
    layer = nn.Linear(50, 20, rng=1)
    assert layer.weight.shape == (20, 50) and layer.bias.shape == (20,)
    assert layer.weight.dtype == np.float32
    bound = 1 / np.sqrt(50)
    assert np.abs(layer.weight).max() <= bound and np.abs(layer.bias).max() <= bound
    assert np.abs(layer.weight).max() > 0.9 * bound
    np.testing.assert_array_equal(nn.Linear(50, 20, rng=1).weight, layer.weight)
    assert not np.array_equal(nn.Linear(50, 20, rng=2).weight, layer.weight)
    assert nn.Linear(50, 20, bias=False).bias is None
    assert repr(layer) == "Linear(input_dims=50, output_dims=20, bias=True)"
    with pytest.raises(ValueError, match="input_dims must be positive, got 0"):
        nn.Linear(0, 3)


def test_linear_forward_with_batch_axes_and_settable_parameters():
    layer = nn.Linear(6, 4, rng=0)
    layer.weight = np.arange(24, dtype=np.float32).reshape(4, 6)
    layer.bias = np.ones(4, np.float32)
    x = rand(2, 3, 6)
    assert_within(
        layer(x), x @ layer.weight.T + 1, matmul_bound(x, layer.weight.T, bias=layer.bias), "layer(x) vs x @ W.T + 1"
    )
    assert layer(x[0, 0]).shape == (4,)


def test_quantized_linear_from_linear():
    lin = nn.Linear(128, 16, rng=0)
    ql = lin.to_quantized(group_size=32, bits=8)
    assert isinstance(ql, nn.QuantizedLinear)
    assert ql.weight.shape == (16, 128 * 8 // 32) and ql.scales.shape == (16, 4)
    assert (ql.input_dims, ql.output_dims) == (128, 16)
    np.testing.assert_array_equal(ql.bias, lin.bias)
    x = rand(4, 128)
    # Quantization error, not rounding: 8-bit steps over 32-weight groups are ~7e-4, so a
    # random 128-term sum typically moves by ~2e-3 (worst case sum|x| * step / 2 ~ 0.035);
    # 0.02 is fixed by this seeded data and is ~1e4 times any kernel's rounding here.
    np.testing.assert_allclose(ql(x), lin(x), atol=0.02)
    assert repr(ql) == "QuantizedLinear(input_dims=128, output_dims=16, bias=True, group_size=32, bits=8)"
    fresh = nn.QuantizedLinear(64, 8, rng=0)
    assert np.all(fresh.bias == 0) and fresh.trainable_parameters().keys() == {"bias"}


def numerical_grad(f, a: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of the scalar ``f()`` with respect to ``a`` (changed in place)."""
    g = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        old = a[i]
        a[i] = old + eps
        up = f()
        a[i] = old - eps
        down = f()
        a[i] = old
        g[i] = (up - down) / (2 * eps)
    return g


def to64(model):
    """Cast every float parameter of a layer or Sequential to float64 for finite differences."""
    for layer in getattr(model, "layers", [model]):
        for k, v in layer.parameters().items():
            if v.dtype.kind == "f":
                setattr(layer, k, v.astype(np.float64))
    return model


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Linear(5, 3, rng=0),
        lambda: nn.Linear(5, 3, bias=False, rng=0),
        lambda: nn.Sequential(nn.Linear(5, 8, rng=0), nn.ReLU(), nn.Linear(8, 3, rng=1)),
    ],
)
def test_gradients_match_finite_differences(make):
    model = to64(make())
    x = rand(4, 5, seed=1, dtype=np.float64)
    r = rand(4, 3, seed=2, dtype=np.float64)

    def loss():
        return float((model(x) * r).sum())

    model(x)
    dx = model.backward(r)
    # float64 throughout. The loss is linear in each single input or parameter (piecewise, for
    # the ReLU model, with no kink within eps for this data), so central differences have no
    # truncation error: only rounding, ~|loss| * 2**-52 / eps ~ 1e-9, far below atol=1e-7.
    np.testing.assert_allclose(dx, numerical_grad(loss, x), rtol=1e-5, atol=1e-7)
    flat_params = dict(nn.tree_flatten(model.trainable_parameters()))
    flat_grads = dict(nn.tree_flatten(model.grads))
    assert flat_params.keys() == flat_grads.keys()
    for path, p in flat_params.items():
        np.testing.assert_allclose(flat_grads[path], numerical_grad(loss, p), rtol=1e-5, atol=1e-7, err_msg=path)


def test_quantized_linear_gradients():
    ql = nn.Linear(64, 4, rng=0).to_quantized(group_size=32, bits=4)
    ql.bias = ql.bias.astype(np.float64)
    x = rand(3, 64, dtype=np.float64)
    r = rand(3, 4, seed=1, dtype=np.float64)

    def loss():
        return float((ql(x) * r).sum())

    ql(x)
    dx = ql.backward(r)
    assert set(ql.grads) == {"bias"}
    # float64 and linear in x and in the bias: as above, only ~1e-9 of rounding is expected.
    np.testing.assert_allclose(dx, numerical_grad(loss, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ql.grads["bias"], numerical_grad(loss, ql.bias), rtol=1e-5)


def test_backward_before_forward_is_an_error():
    with pytest.raises(RuntimeError, match="before a forward"):
        nn.Linear(2, 2).backward(np.ones((1, 2)))


# --------------------------------------------------------------------------- sharding


def test_group_none_uses_the_world():
    layer = nn.AllToShardedLinear(4, 4)
    world = mc.init()
    assert (layer.group.backend, layer.group.size()) == (world.backend, world.size()) == ("single", 1)
    assert repr(layer) == "AllToShardedLinear(input_dims=4, output_dims=4, bias=True, rank=0/1)"


@pytest.mark.parametrize("n", SIZES)
def test_all_to_sharded_equals_slice_of_linear(n):
    full = nn.Linear(12, 8, rng=7)
    x = rand(5, 12)
    y = full(x)
    r = rand(5, 8, seed=3)
    dx = full.backward(r)

    def rank(g):
        layer = nn.AllToShardedLinear(12, 8, group=g, rng=7)
        other = nn.AllToShardedLinear.from_linear(full, group=g)
        np.testing.assert_array_equal(layer.weight, other.weight)
        part = slice(g.rank() * 8 // n, (g.rank() + 1) * 8 // n)
        out = layer(x)
        grad_in = layer.backward(r[:, part])
        return part, out, grad_in, layer.grads, repr(layer)

    # The same sums as the whole layer's, in another order (BLAS blocking, the all_sum).
    out_bound = matmul_bound(x, full.weight.T, bias=full.bias)
    dx_bound = matmul_bound(r, full.weight, partials=n)
    dw_bound = matmul_bound(r.T, x)
    db_bound = sum_bound(list(r))
    for part, out, grad_in, grads, text in run_threaded(n, rank):
        assert grads["weight"].shape == (8 // n, 12)
        assert_within(out, y[:, part], out_bound[:, part], f"output {part}")
        assert_within(grad_in, dx, dx_bound, "all-summed input gradient")
        assert_within(grads["weight"], full.grads["weight"][part], dw_bound[part], "weight gradient")
        assert_within(grads["bias"], full.grads["bias"][part], db_bound[part], "bias gradient")
        assert "output_dims=8" in text and f"/{n})" in text


@pytest.mark.parametrize("n", SIZES)
def test_sharded_to_all_equals_linear(n):
    full = nn.Linear(8, 6, rng=4)
    x = rand(3, 8)
    y = full(x)
    r = rand(3, 6, seed=5)
    dx = full.backward(r)

    def rank(g):
        layer = nn.ShardedToAllLinear(8, 6, group=g, rng=4)
        np.testing.assert_array_equal(layer.weight, nn.ShardedToAllLinear.from_linear(full, group=g).weight)
        part = slice(g.rank() * 8 // n, (g.rank() + 1) * 8 // n)
        out = layer(x[:, part])
        return part, out, layer.backward(r), layer.grads

    out_bound = matmul_bound(x, full.weight.T, bias=full.bias, partials=n)
    dx_bound = matmul_bound(r, full.weight)
    dw_bound = matmul_bound(r.T, x)
    db_bound = sum_bound(list(r))
    for part, out, grad_in, grads in run_threaded(n, rank):
        assert_within(out, y, out_bound, "all-summed output")
        assert_within(grad_in, dx[:, part], dx_bound[:, part], f"input gradient {part}")
        assert_within(grads["weight"], full.grads["weight"][:, part], dw_bound[:, part], "weight gradient")
        assert_within(grads["bias"], full.grads["bias"], db_bound, "bias gradient")


@pytest.mark.parametrize("n", SIZES)
def test_quantized_sharded_layers_equal_quantized_linear(n):
    q1 = nn.QuantizedLinear(128, 16, group_size=32, bits=4, rng=1)
    q1.bias = rand(16, seed=9)
    q2 = nn.QuantizedLinear(16 * 8, 8, group_size=32, bits=3, rng=2)  # 128 inputs, 32 per shard at n=4
    x = rand(4, 128)
    y1 = q1(x)
    r = rand(4, 8, seed=1)

    def rank(g):
        a = nn.QuantizedAllToShardedLinear.from_quantized_linear(q1, group=g)
        b = nn.shard_linear(q2, "sharded-to-all", group=g)
        fresh = nn.QuantizedAllToShardedLinear(128, 16, group_size=32, bits=4, group=g, rng=1)
        np.testing.assert_array_equal(fresh.weight, a.weight)
        h = a(x)
        out = b(np.concatenate([h] * (128 // 16), axis=1)[:, : 128 // n] if n > 1 else np.tile(h, 8))
        return h, a, b, out

    w1 = q1.dequantized_weight()
    h_bound = matmul_bound(x, w1.T, bias=q1.bias)
    for k, (h, a, b, _) in enumerate(run_threaded(n, rank)):
        part = slice(k * 16 // n, (k + 1) * 16 // n)
        # Dequantization is element-wise, so a shard's weights are exactly the slice of the
        # whole layer's: only the order of summation differs.
        np.testing.assert_array_equal(a.dequantized_weight(), w1[part])
        assert_within(h, y1[:, part], h_bound[:, part], f"output {part}")
        assert a.weight.shape == (16 // n, 128 * 4 // 32) and a.scales.shape == (16 // n, 4)
        assert b.weight.shape == (8, 128 // n * 3 // 32) and b.bias.shape == (8,)
        assert (a.input_dims, a.output_dims, b.input_dims, b.output_dims) == (128, 16, 128, 8)
        assert "bits=3" in repr(b) and f"rank={k}/{n}" in repr(b)
    # The sharded-to-all side: compare with the whole layer on a common input.
    z = rand(4, 128, seed=6)
    zr = q2(z)
    dz = q2.backward(r)

    def rank2(g):
        b = nn.QuantizedShardedToAllLinear.from_quantized_linear(q2, group=g)
        part = slice(g.rank() * 128 // n, (g.rank() + 1) * 128 // n)
        out = b(z[:, part])
        return part, out, b.backward(r), b.grads, b.dequantized_weight()

    w2 = q2.dequantized_weight()
    out_bound = matmul_bound(z, w2.T, bias=q2.bias, partials=n)
    dz_bound = matmul_bound(r, w2)
    for part, out, grad_in, grads, shard in run_threaded(n, rank2):
        np.testing.assert_array_equal(shard, w2[:, part])
        assert_within(out, zr, out_bound, "all-summed output")
        assert_within(grad_in, dz[:, part], dz_bound[:, part], f"input gradient {part}")
        assert_within(grads["bias"], q2.grads["bias"], sum_bound(list(r)), "bias gradient")


def affine_layers(model: nn.Sequential) -> list:
    """``(weight, bias)`` as each layer multiplies (dequantized if quantized), ``None`` for ReLU:
    the input of :func:`numerics.mlp_bounds`."""
    out = []
    for layer in model.layers:
        if isinstance(layer, nn.ReLU):
            out.append(None)
        elif isinstance(layer, nn.QuantizedLinear):
            out.append((layer.dequantized_weight(), layer.bias))
        else:
            out.append((layer.weight, layer.bias))
    return out


def mlp(seed: int = 0, quantize: bool = False) -> nn.Sequential:
    model = nn.Sequential(
        nn.Linear(16, 64, rng=seed),
        nn.ReLU(),
        nn.Linear(64, 32, rng=seed + 1),
        nn.ReLU(),
        nn.Linear(32, 64, rng=seed + 2),
        nn.ReLU(),
        nn.Linear(64, 8, rng=seed + 3),
    )
    if quantize:
        model.layers = [layer.to_quantized(16, 4) if isinstance(layer, nn.Linear) else layer for layer in model.layers]
    return model


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_sharded_mlp_outputs_and_gradients_equal_unsharded(n, quantize):
    ref = mlp(quantize=quantize)
    x = rand(6, 16)
    y = ref(x)
    r = rand(6, 8, seed=1)
    dx = ref.backward(r)
    ref_grads = dict(nn.tree_flatten(ref.grads))

    def rank(g):
        model = nn.shard_inplace(mlp(quantize=quantize), group=g)  # same seeds on every rank
        out = model(x)
        return out, model.backward(r), dict(nn.tree_flatten(model.grads)), model

    bounds = mlp_bounds(affine_layers(ref), x, r, partials=n)
    results = run_threaded(n, rank)
    for k, (out, grad_in, grads, model) in enumerate(results):
        kinds = [type(layer).__name__ for layer in model.layers if not isinstance(layer, nn.ReLU)]
        prefix = "Quantized" if quantize else ""
        assert kinds == [prefix + "AllToShardedLinear", prefix + "ShardedToAllLinear"] * 2
        assert_within(out, y, bounds.output, "MLP output")
        assert_within(grad_in, dx, bounds.input_grad, "MLP input gradient")
        assert grads.keys() == ref_grads.keys()
        for path, g in grads.items():
            _, index, key = path.split(".")
            layer = ref.layers[int(index)]
            full, bound = ref_grads[path], bounds.grads[int(index)][key]
            if g.shape != full.shape:  # a shard: rows for all-to-sharded, columns otherwise
                axis = 0 if "AllToSharded" in type(model.layers[int(index)]).__name__ else 1
                full, bound = np.split(full, n, axis=axis)[k], np.split(bound, n, axis=axis)[k]
            assert_within(g, full, bound, f"{path} of {layer} on rank {k}")


def test_sharding_errors_name_the_sizes():
    def rank(g):
        errors = []
        for make in (
            lambda: nn.AllToShardedLinear(4, 6, group=g),
            lambda: nn.ShardedToAllLinear(6, 4, group=g),
            lambda: nn.QuantizedShardedToAllLinear(128, 4, group_size=64, group=g),
            lambda: nn.shard_linear(nn.Linear(4, 6), "all-to-sharded", group=g),
            lambda: nn.shard_linear(nn.Linear(4, 8), "diagonal", group=g),
            lambda: nn.shard_linear(nn.ReLU(), "all-to-sharded", group=g),
            lambda: nn.shard_inplace(nn.Linear(4, 8), group=g),
        ):
            try:
                make()
            except (ValueError, TypeError) as exc:
                errors.append(str(exc))
        return errors

    errors = run_threaded(4, rank)[0]
    wrong = run_threaded(2, lambda g: _error(lambda: nn.ShardedToAllLinear(8, 3, group=g)(np.ones((2, 8)))))
    assert (
        wrong[0] == "ShardedToAllLinear on rank 0 expects this rank's 4 of the 8 input features (the last axis), "
        "got shape (2, 8)"
    )
    assert errors[0] == "Cannot shard the output of size 6 across 4 devices."
    assert errors[1] == "The input of size 6 cannot be sharded across 4 devices."
    assert "each shard of 32 must be divisible by 64" in errors[2]
    assert errors[3] == errors[0]
    assert "sharding must be one of" in errors[4] and "'diagonal'" in errors[4]
    assert "got ReLU" in errors[5] and "shard_linear" in errors[6]


def _error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def test_shard_inplace_with_segments_and_callable():
    fused = nn.Linear(4, 6, rng=0)  # e.g. three fused 2-wide blocks
    x = rand(2, 4)
    y = fused(x)

    def rank(g):
        layer = nn.shard_linear(fused, "all-to-sharded", segments=3, group=g)
        model = nn.Sequential(nn.Linear(4, 4, rng=0), nn.ReLU(), nn.Linear(4, 4, rng=1))
        nn.shard_inplace(model, lambda i, layer: "all-to-sharded" if i == 0 else None, group=g)
        return layer(x), [type(layer).__name__ for layer in model.layers]

    (a, kinds), (b, _) = run_threaded(2, rank)
    order = [0, 2, 4, 1, 3, 5]
    assert_within(
        np.concatenate([a, b], axis=1),
        y[:, order],
        matmul_bound(x, fused.weight.T, bias=fused.bias)[:, order],
        "segmented shards",
    )
    assert kinds == ["AllToShardedLinear", "ReLU", "Linear"]


# --------------------------------------------------------------------------- gradients


def grad_tree(rank: int) -> dict:
    rng = np.random.default_rng(rank)
    return {
        "layers": [
            {"weight": rng.normal(size=(3, 4)).astype(np.float32), "bias": rng.normal(size=3).astype(np.float32)},
            {},
            {"weight": rng.normal(size=(5, 2)).astype(np.float16), "bias": np.float32(rank)},
        ]
    }


def counting(g):
    calls = []
    all_sum = g.all_sum

    def wrapped(x, **kw):
        calls.append(("sum", np.asarray(x).dtype, np.asarray(x).size))
        return all_sum(x, **kw)

    g.all_sum = wrapped
    return calls


@pytest.mark.parametrize("size, expected", [(32 * 1024**2, 2), (0, 4), (40, 3)])
def test_average_gradients_batches_all_sums(size, expected):
    """Default: one all_sum per dtype; 0: one per array; 40 bytes: float32 cut after 48 bytes."""

    def rank(g):
        calls = counting(g)
        return nn.average_gradients(grad_tree(g.rank()), group=g, all_reduce_size=size), calls

    results = run_threaded(2, rank)
    want = nn.tree_map(lambda a, b: (np.asarray(a) + np.asarray(b)) / 2, grad_tree(0), grad_tree(1))
    for averaged, calls in results:
        assert len(calls) == expected and all(op == "sum" for op, _, _ in calls)
        flat, flat_want = nn.tree_flatten(averaged), nn.tree_flatten(want)
        assert [p for p, _ in flat] == [p for p, _ in flat_want]
        assert averaged["layers"][1] == {}
        dtypes = [np.asarray(v).dtype for _, v in nn.tree_flatten(grad_tree(0))]
        leaves = zip(nn.tree_flatten(grad_tree(0)), nn.tree_flatten(grad_tree(1)), strict=True)
        for (path, got), (_, exp), dtype, ((_, a), (_, b)) in zip(flat, flat_want, dtypes, leaves, strict=True):
            assert got.shape == np.shape(exp) and got.dtype == dtype, path
            # all_sum then / 2 against a + b then / 2, both in the leaf's dtype.
            assert_within(got, exp, sum_bound([a, b], dtype, divide_by=2), path)
        assert averaged["layers"][2]["weight"].dtype == np.float16
    np.testing.assert_array_equal(results[0][0]["layers"][0]["weight"], results[1][0]["layers"][0]["weight"])


def test_average_gradients_size_one_returns_input():
    tree = grad_tree(0)
    assert nn.average_gradients(tree, group=run_threaded(1, lambda g: g)[0]) is tree


def test_data_and_tensor_parallel_step_equals_single_process():
    """4 ranks = 2 data-parallel x 2 tensor-parallel: one SGD step on a split batch equals
    the step of one process on the whole batch, and replicas stay bit-identical."""
    x = rand(8, 16)
    r = rand(8, 8, seed=3) / 8
    ref = mlp()
    before = affine_layers(ref)
    ref(x)
    ref.backward(r)
    ref.update(nn.tree_map(lambda p, g: p - 0.1 * g, ref.trainable_parameters(), ref.grads))
    after = ref(x)

    def rank(world):
        tp_group = world.split(world.rank() // 2)
        dp_group = world.split(world.rank() % 2)
        model = nn.shard_inplace(mlp(), group=tp_group)
        mine = slice(dp_group.rank() * 4, dp_group.rank() * 4 + 4)
        model(x[mine])
        model.backward(r[mine] * 2)  # each replica's mean over its half of the batch
        grads = nn.average_gradients(model.grads, group=dp_group)
        model.update(nn.tree_map(lambda p, g: p - 0.1 * g, model.trainable_parameters(), grads))
        return model(x), [p.tobytes() for _, p in nn.tree_flatten(model.parameters())]

    results = run_threaded(4, rank)
    for out, _ in results:
        assert_within(out, after, sgd_step_bound(before, x, r, lr=0.1, tp=2, dp=2), "output after the step")
    assert results[0][1] == results[2][1] and results[1][1] == results[3][1]


def sgd_step_bound(layers: list, x: np.ndarray, r: np.ndarray, lr: float, tp: int, dp: int) -> np.ndarray:
    """Bound on two evaluations of ``model(x)`` after ``p -= lr * grad`` (gradients from ``x``
    and ``r``, batch sums split over ``dp`` replicas, contractions over ``tp`` shards): each
    updated parameter is off by ``lr * (its gradient's error)`` plus the two roundings of the
    update (and of its float64 reference), and the second forward pass carries that error."""
    c = float(np.float32(lr))  # NumPy rounds the Python float to the arrays' float32
    step = mlp_bounds(layers, x, r, partials=tp, batch_partials=dp)
    updated, errors = [], []
    for layer, grad, err in zip(layers, step.reference_grads, step.grad_errors, strict=True):
        if layer is None:
            updated.append(None)
            errors.append(None)
            continue
        new, bound = [], []
        for p, key in zip(layer, ("weight", "bias"), strict=True):
            p64, g = p.astype(np.float64), grad[key]
            size = np.abs(p64) + c * (np.abs(g) + err[key])  # >= |p| + |lr * computed grad|
            new.append(p64 - c * g)
            bound.append(c * err[key] + (gamma(2) + gamma(2, np.float64)) * size)
        updated.append(tuple(new))
        errors.append(tuple(bound))
    return mlp_bounds(updated, x, partials=tp, weight_errors=errors).output


# --------------------------------------------------------------------------- examples


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MLX_BACKEND", None)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_tp_inference_example_single_process():
    proc = run([sys.executable, str(EXAMPLES / "tp_inference.py")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "float32: max |y_tp - y_single| = 0" in proc.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("sklearn") is None, reason="scikit-learn is not installed (pip install 'meshcomm[nn]')"
)
def test_train_digits_example_single_process(tmp_path):
    png = tmp_path / "loss.png"
    proc = run([sys.executable, str(EXAMPLES / "train_digits.py"), "--epochs", "6", "--plot", str(png)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data-parallel replicas identical: yes" in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:4] == b"\x89PNG"


def _launcher_missing() -> bool:
    try:
        return importlib.util.find_spec("meshcomm.launch.cli") is None
    except ImportError:
        return True


@pytest.mark.skipif(_launcher_missing(), reason="the launcher (meshcomm.launch.cli) is not installed yet")
@pytest.mark.parametrize("n", [2, 4])
def test_examples_under_the_launcher(n, tmp_path):
    launch = [sys.executable, "-m", "meshcomm", "launch", "-n", str(n), "--"]
    proc = run([*launch, sys.executable, str(EXAMPLES / "tp_inference.py")], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"over {n} rank(s)" in proc.stdout and "max |y_tp - y_single|" in proc.stdout
    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed (pip install 'meshcomm[nn]')")
    proc = run(
        [
            *launch,
            sys.executable,
            str(EXAMPLES / "train_digits.py"),
            "--epochs",
            "4",
            "--plot",
            str(tmp_path / "loss.png"),
        ],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data-parallel replicas identical: yes" in proc.stdout
