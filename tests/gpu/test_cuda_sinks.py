"""Attention sinks on CUDA: every kernel family (tensor-core prefill, on
wgmma on Hopper with its key splits and scheduled row tiles; the
tensor-core, scalar and generic decodes with their fused and separate
merges; float32 attention over 16-bit inputs) against a float64 reference with the same
sinks; with masks, windows and quantized keys; and their gradients through both
fused backwards."""

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import TOLERANCE, Case, make_inputs, sinks_for

from flashattn_core import flash_attention, gradient_stats, reset_gradient_stats
from flashattn_core.reference import attention_gradients_reference, attention_reference, causal_mask, relative_error

pytestmark = pytest.mark.skipif(
    not (mx.is_available(mx.gpu) and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend and an NVIDIA GPU",
)


def sampled_error(q, k, v, out, mask, sinks, rows=24):
    """Relative error on a few query rows (the full reference would not fit);
    mask: None, "causal" or an (L, S) array."""
    L, S = q.shape[-2], k.shape[-2]
    idx = np.unique(np.linspace(0, L - 1, rows).astype(int))
    if isinstance(mask, mx.array):
        m = np.array(mask if mask.dtype == mx.bool_ else mask.astype(mx.float32))[idx]
    else:
        m = causal_mask(L, S)[idx] if mask == "causal" else None
    ref = attention_reference(q[..., mx.array(idx), :], k, v, mask=m, sinks=sinks)
    return relative_error(np.array(out.astype(mx.float32))[..., idx, :], ref)


@pytest.mark.parametrize("E", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["causal", "none", "bool_LS", "additive_full"])
def test_every_prefill_kernel(E, dtype, mask):
    case = Case(batch=(2,), heads=(8, 2), L=300, S=333, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    q, k, v, m = make_inputs(case)
    sinks = sinks_for(8)
    out = flash_attention(q, k, v, mask=m, sinks=sinks)
    assert out.dtype == q.dtype
    assert relative_error(out, attention_reference(q, k, v, mask=m, sinks=sinks)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "heads,L,S,E",
    [
        ((14, 2), 2048, 6000, 64),  # mlx-lm's prefill chunk: the last row tiles' keys split (Hopper)
        ((17, 1), 4096, 4096, 128),  # scheduled row tiles, one block per SM (Hopper)
        ((14, 2), 8192, 8192, 64),  # the sinks target's shape
    ],
)
def test_long_prefill(heads, L, S, E, dtype):
    case = Case(batch=(1,), heads=heads, L=L, S=S, E=E, mask="causal", dtype=dtype)
    q, k, v, _ = make_inputs(case)
    sinks = sinks_for(heads[0])
    out = flash_attention(q, k, v, mask="causal", sinks=sinks)
    assert not mx.isnan(out).any().item()
    assert sampled_error(q, k, v, out, "causal", sinks) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("L,S", [(300, 333), (2048, 4096), (1, 4096), (4, 32768)])
def test_float32_attention_over_16_bit_inputs(dtype, L, S):
    # The wgmma prefill's float32 variant (Hopper), the prefill on cast
    # inputs, and decode's generic split form on the 16-bit cache.
    case = Case(batch=(1,), heads=(14, 2), L=L, S=S, E=64, mask="causal", dtype=dtype)
    q, k, v, _ = make_inputs(case)
    sinks = sinks_for(14)
    out = flash_attention(q, k, v, mask="causal", sinks=sinks, dtype=mx.float32)
    assert out.dtype == mx.float32
    assert sampled_error(q, k, v, out, "causal", sinks) <= 2e-5


@pytest.mark.parametrize("S", [200, 4096, 32768])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("heads,E", [((14, 2), 64), ((32, 8), 128), ((12, 4), 96), ((8, 8), 80), ((8, 4), 256)])
@pytest.mark.parametrize("L,mask", [(1, "none"), (1, "causal"), (3, "causal"), (1, "bool_full")])
def test_decode(S, dtype, heads, E, L, mask):
    # The tensor-core decodes' sinks kernels and decode.cu (one block per
    # group, and fused splits merged in the same launch), and the generic
    # kernel's splits with their separate merge.
    case = Case(batch=(1,), heads=heads, L=L, S=S, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    q, k, v, m = make_inputs(case)
    sinks = sinks_for(heads[0])
    out = flash_attention(q, k, v, mask=m, sinks=sinks)
    assert relative_error(out, attention_reference(q, k, v, mask=m, sinks=sinks)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("L,S,window", [(300, 300, 64), (1, 5000, 700), (200, 3000, 1000)])
def test_sliding_windows(dtype, L, S, window):
    # gpt-oss's sliding layers: a window and sinks.
    case = Case(batch=(1,), heads=(8, 2), L=L, S=S, E=64, mask="causal", dtype=dtype)
    q, k, v, _ = make_inputs(case)
    sinks = sinks_for(8)
    out = flash_attention(q, k, v, mask="causal", window=window, sinks=sinks)
    rows = np.arange(L)[:, None] + (S - L)
    band = (np.arange(S)[None, :] <= rows) & (np.arange(S)[None, :] > rows - window)
    ref = attention_reference(q, k, v, mask=band, sinks=sinks)
    assert relative_error(out, ref) <= TOLERANCE[dtype]


def test_quantized_keys_and_values():
    case = Case(batch=(1,), heads=(8, 2), L=1, S=3000, E=64, dtype="bfloat16")
    q, k, v, _ = make_inputs(case)
    kq, vq = mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4)
    sinks = sinks_for(8)
    out = flash_attention(q, kq, vq, sinks=sinks)
    k_deq, v_deq = (mx.dequantize(*x, group_size=64, bits=4) for x in (kq, vq))
    ref = attention_reference(q, k_deq, v_deq, sinks=sinks)
    assert relative_error(out, ref) <= TOLERANCE["bfloat16"]


def test_sinks_of_16_bit_dtype_and_odd_head_counts():
    # An odd count of heads pads the sinks to whole 8-byte words; bfloat16
    # sinks are read as float32.
    case = Case(batch=(2,), heads=(7, 1), L=130, S=130, E=64, mask="bool_LS")
    q, k, v, m = make_inputs(case)
    sinks = sinks_for(7).astype(mx.bfloat16)
    out = flash_attention(q, k, v, mask=m, sinks=sinks)
    assert relative_error(out, attention_reference(q, k, v, mask=m, sinks=sinks)) <= 2e-5


def d_out_for(q, seed=5):
    return mx.array(np.random.default_rng(seed).standard_normal(q.shape)).astype(q.dtype)


@pytest.mark.parametrize("E", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mask,L,S", [("causal", 150, 170), ("causal", 200, 120), ("bool_LS", 90, 140), ("none", 70, 130)])
def test_gradients(E, dtype, mask, L, S):
    # The statistics pass (backward_f16.cu: 16-bit up to E = 128) or the rows
    # pass (backward.cu) counts each head's sink in its rows' log-sum-exp; the
    # sinks' own gradient is -sum p_sink D over the statistics. causal 200 x
    # 120: rows that see no key. Head 0 has no sink (its gradient is 0).
    case = Case(batch=(2,), heads=(8, 2), L=L, S=S, E=E, mask=mask, dtype=dtype)
    q, k, v, m = make_inputs(case)
    sinks = sinks_for(8)
    d_out = d_out_for(q)
    reset_gradient_stats()
    f = lambda q, k, v, s: flash_attention(q, k, v, mask=m, sinks=s)
    grads = mx.vjp(f, [q, k, v, sinks], [d_out])[1]
    refs, sizes = attention_gradients_reference(q, k, v, d_out, mask=m, sinks=sinks, sizes=True)
    for name, g, x, ref, size in zip(("dq", "dk", "dv", "dsinks"), grads, (q, k, v, sinks), refs, sizes):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        got = np.array(g.astype(mx.float32), dtype=np.float64)
        assert np.isfinite(got).all(), name
        error = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), size, 1e-30)
        assert error <= TOLERANCE[dtype], f"{name}: {error:.2e}"
    assert np.array(grads[3])[0] == 0.0
    assert gradient_stats() == {"fused": 1, "recomputed": {}}


def test_gradients_of_float32_attention_over_16_bit_inputs_and_under_compile():
    case = Case(batch=(1,), heads=(14, 2), L=300, S=300, E=64, mask="causal", dtype="bfloat16")
    q, k, v, _ = make_inputs(case)
    sinks = sinks_for(14)
    d_out = mx.array(np.random.default_rng(1).standard_normal(q.shape).astype(np.float32))
    loss = lambda q, k, v, s: (flash_attention(q, k, v, mask="causal", sinks=s, dtype=mx.float32) * d_out).sum()
    grads = mx.compile(mx.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    refs = attention_gradients_reference(q, k, v, d_out, mask="causal", sinks=sinks)
    for name, g, ref in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        assert relative_error(g, ref) <= 1e-2, name


def test_gradients_with_an_additive_masks_own():
    # The mask's gradient (dS, L x S) is recomputed with MLX operations, the
    # sinks in its softmax; MLX's VJP of its own SDPA on the CPU is the reference.
    case = Case(batch=(1,), heads=(4, 2), L=40, S=60, E=64, mask="additive_full")
    q, k, v, m = make_inputs(case)
    sinks = mx.array([0.3, -1.0, 2.0, 0.9])
    d_out = d_out_for(q)
    ours = lambda q, k, v, m, s: flash_attention(q, k, v, mask=m, sinks=s)
    mlx = lambda q, k, v, m, s: mx.fast.scaled_dot_product_attention(q, k, v, scale=case.E**-0.5, mask=m, sinks=s)
    got = mx.vjp(ours, [q, k, v, m, sinks], [d_out])[1]
    with mx.stream(mx.cpu):
        want = mx.vjp(mlx, [q, k, v, m, sinks], [d_out])[1]
    for name, g, w in zip(("dq", "dk", "dv", "dmask", "dsinks"), got, want):
        assert g.shape == w.shape, name
        w = np.array(w, dtype=np.float64)
        keep = np.isfinite(w)  # MLX's dmask is NaN where the mask is -inf
        assert relative_error(np.array(g)[keep], w[keep]) <= 2e-5, name
