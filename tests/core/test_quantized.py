"""Quantized keys and values (MLX's affine format, as mx.quantize returns it
and mlx-lm's QuantizedKVCache holds it) read in place by the CPU kernels:
against a float64 reference on the dequantized keys and values (so the
quantization's own error is not the kernel's) over a covering matrix of
sizes, bits, group sizes, masks, dtypes and cache layouts; decode with split
keys; with attention sinks; no full-precision copy of the cache; bad input
refused."""

import math

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import DTYPES, TOLERANCE, sinks_for
from pairwise import pairwise

from flashattn_core import UnsupportedError, flash_attention
from flashattn_core.reference import attention_reference, causal_mask, dequantize, relative_error


@pytest.fixture(autouse=True)
def on_the_cpu():
    with mx.stream(mx.cpu):
        yield


def quantized_inputs(batch, heads, L, S, E, bits, group_size, dtype="float32", scales="float32",
                     layout="contiguous", seed=0):
    """queries, and keys and values as (packed, scales, biases); kv_cache
    slices them from a larger buffer, as mlx-lm's QuantizedKVCache does."""
    rng = np.random.default_rng(seed)
    H_q, H_kv = heads
    q = mx.array(rng.standard_normal((*batch, H_q, L, E))).astype(DTYPES[dtype])
    capacity = 256 * (S // 256 + 1) if layout == "kv_cache" else S

    def quantized():
        x = mx.array(rng.standard_normal((*batch, H_kv, capacity, E))).astype(DTYPES[scales])
        parts = mx.quantize(x, group_size=group_size, bits=bits)
        return tuple(p[..., :S, :] for p in parts)

    return q, quantized(), quantized()


def masks(kind, L, S, rng):
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    if kind == "bool_LS":
        m = rng.random((L, S)) < 0.7
        return mx.array(m)
    return mx.array(rng.standard_normal((L, S)).astype(np.float32))  # additive


SIZES = [1, 7, 33, 100, 257]
MATRIX = [
    row
    for row in pairwise(
        {
            "L": SIZES,
            "S": SIZES + [1100],
            "E": [32, 64, 96, 128, 256],
            "bits": [2, 4, 8],
            "group_size": [32, 64, 128],
            "heads": [(1, 1), (6, 3), (14, 2), (8, 2)],
            "batch": [(), (1,), (2, 2)],
            "mask": ["none", "causal", "bool_LS", "additive"],
            "dtype": ["float32", "float16", "bfloat16"],
            "scales": ["float32", "float16", "bfloat16"],
            "layout": ["contiguous", "kv_cache"],
            "which": ["both", "keys", "values"],
        },
        accept=lambda r: math.prod(r["batch"]) * r["heads"][0] * r["L"] * r["S"] * r["E"] <= 30_000_000,
        candidates=400,
    )
]
for r in MATRIX:  # the largest group size up to the one drawn that divides E
    r["group_size"] = max(g for g in (32, 64, 128) if g <= r["group_size"] and r["E"] % g == 0)


def row_id(r):
    b = "x".join(map(str, r["batch"])) or "-"
    return (f"b{b}_h{r['heads'][0]}-{r['heads'][1]}_L{r['L']}_S{r['S']}_E{r['E']}_{r['bits']}bit_g{r['group_size']}"
            f"_{r['mask']}_{r['dtype']}_{r['scales']}-scales_{r['layout']}_{r['which']}")


@pytest.mark.parametrize("r", MATRIX, ids=map(row_id, MATRIX))
def test_matches_float64_reference_on_the_dequantized_keys_and_values(r):
    q, kq, vq = quantized_inputs(r["batch"], r["heads"], r["L"], r["S"], r["E"], r["bits"], r["group_size"],
                                 r["dtype"], r["scales"], r["layout"])
    mask = masks(r["mask"], r["L"], r["S"], np.random.default_rng(1))
    k_ref, v_ref = dequantize(kq, r["E"]), dequantize(vq, r["E"])
    # A plain key or value array beside a quantized one: the queries' dtype.
    k = kq if r["which"] != "values" else mx.array(k_ref).astype(q.dtype)
    v = vq if r["which"] != "keys" else mx.array(v_ref).astype(q.dtype)
    if r["which"] == "values":
        k_ref = np.array(k.astype(mx.float32), dtype=np.float64)
    if r["which"] == "keys":
        v_ref = np.array(v.astype(mx.float32), dtype=np.float64)
    out = flash_attention(q, k, v, mask=mask)
    wide = flash_attention(q, k, v, mask=mask, dtype=mx.float32)
    assert out.shape == q.shape and out.dtype == q.dtype and wide.dtype == mx.float32
    ref = attention_reference(q, k_ref, v_ref, mask=mask)
    assert relative_error(out, ref) <= TOLERANCE[r["dtype"]]
    assert relative_error(wide, ref) <= 2e-5


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("L, S, window", [(1, 6000, None), (1, 6000, 1000), (300, 3000, None), (64, 4100, 700)])
def test_decode_and_chunks_against_long_caches(bits, L, S, window):
    # Qwen2-0.5B's heads; decode splits the keys across threads.
    q, kq, vq = quantized_inputs((1,), (14, 2), L, S, 64, bits, 64, "bfloat16", "bfloat16", "kv_cache", seed=3)
    out = flash_attention(q, kq, vq, mask="causal", window=window, dtype=mx.float32, group_size=64, bits=bits)
    ref = attention_reference(q, dequantize(kq, 64), dequantize(vq, 64), mask=causal_mask(L, S, window))
    assert relative_error(out, ref) <= 2e-5


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("L, S", [(1, 3000), (2, 1000), (100, 700)])
def test_attention_sinks_over_quantized_keys_and_values(bits, L, S):
    # gpt-oss's sinks with a quantized cache (mlx-lm's own quantized attention
    # refuses them): decode and prefill, native and float32 attention.
    q, kq, vq = quantized_inputs((1,), (8, 2), L, S, 64, bits, 32, "bfloat16", "bfloat16", "kv_cache", seed=5)
    sinks = sinks_for(8)
    ref = attention_reference(q, dequantize(kq, 64), dequantize(vq, 64), mask=causal_mask(L, S), sinks=sinks)
    out = flash_attention(q, kq, vq, mask="causal", sinks=sinks)
    wide = flash_attention(q, kq, vq, mask="causal", sinks=sinks, dtype=mx.float32)
    assert relative_error(out, ref) <= TOLERANCE["bfloat16"]
    assert relative_error(wide, ref) <= 2e-5


DECODE_TILES = [  # every head dim and group size the format allows (the group divides E)
    (bits, E, group_size, scales)
    for bits in (4, 8)
    for E in (32, 64, 96, 128, 256)
    for group_size in (32, 64, 128)
    for scales in ("float32", "float16", "bfloat16")
    if E % group_size == 0
]


@pytest.mark.parametrize("bits, E, group_size, scales", DECODE_TILES)
def test_decode_tiles_of_every_head_dim_and_group(bits, E, group_size, scales):
    # The decode's own dequantization (4-bit rows paired, 8-bit byte by byte;
    # isa/decode.h) over whole and partial key tiles, causal with two rows.
    q, kq, vq = quantized_inputs((2,), (8, 2), 2, 1000, E, bits, group_size, "bfloat16", scales, "kv_cache", seed=7)
    out = flash_attention(q, kq, vq, mask="causal", dtype=mx.float32)
    ref = attention_reference(q, dequantize(kq, E), dequantize(vq, E), mask=causal_mask(2, 1000))
    assert relative_error(out, ref) <= 2e-5


def test_no_full_precision_copy_of_the_keys_and_values():
    # A float32 copy of K and V at S = 8192 (2 KV heads, E = 64) is 8 MiB; the
    # output is 28 MiB; an L x S score matrix per head would be 256 MiB.
    L = S = 8192
    q, kq, vq = quantized_inputs((1,), (14, 2), L, S, 64, 4, 64, seed=5)
    mx.eval(q, kq, vq)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, kq, vq, mask="causal")
    mx.eval(out)
    extra = mx.get_peak_memory() - before - out.nbytes
    assert extra < 1 * 2**20, f"{extra / 2**20:.1f} MiB beyond the output"


def test_mx_quantize_layouts_from_mlx_lm_cache():
    # The cache's own update: packed triples sliced from its step-256 buffer.
    from mlx_lm.models.cache import QuantizedKVCache

    cache = QuantizedKVCache(group_size=32, bits=8)
    rng = np.random.default_rng(4)
    for steps in (5, 1, 1, 300):
        k = mx.array(rng.standard_normal((1, 2, steps, 64)).astype(np.float32))
        keys, values = cache.update_and_fetch(k, -k)
        q = mx.array(rng.standard_normal((1, 4, steps, 64)).astype(np.float32))
        out = flash_attention(q, keys, values, mask="causal", group_size=32, bits=8)
        ref = attention_reference(q, dequantize(keys, 64), dequantize(values, 64), mask="causal")
        assert relative_error(out, ref) <= 2e-5


def test_no_gradient_through_quantized_keys():
    q, kq, vq = quantized_inputs((1,), (2, 1), 8, 8, 32, 4, 32)
    with pytest.raises(ValueError, match="no gradient through quantized keys or values"):
        mx.grad(lambda q: flash_attention(q, kq, vq).sum())(q)


def bad(E=64, bits=4, group_size=32, S=8):
    q, kq, vq = quantized_inputs((1,), (2, 1), 4, S, E, bits, group_size)
    return q, kq, vq


@pytest.mark.parametrize(
    "change, message, reason",
    [
        (lambda q, k, v: (q, (k[0].astype(mx.int32), k[1], k[2]), v, {}),
         "quantized keys: the packed array must be uint32.*got int32", "unsupported_input"),
        (lambda q, k, v: (q, (k[0], k[1], k[2].astype(mx.float16)), v, {}),
         "scales and biases must share one dtype.*got float32 and float16", "unsupported_input"),
        (lambda q, k, v: (q, k, (v[0], mx.repeat(v[1][..., :1], 3, -1), mx.repeat(v[2][..., :1], 3, -1)), {}),
         "quantized values: scales must hold E / group_size values a row", "unsupported_input"),
        (lambda q, k, v: (q, (k[0][..., :5, :], k[1], k[2]), v, {}),
         r"packed \(B\.\.\., H_kv, S, E \* bits / 32\), scales and biases .* must agree", "unsupported_input"),
        (lambda q, k, v: (q, (k[0][..., :3], k[1], k[2]), v, {}),
         "E \\* bits / 32 words a row must hold E = 64 elements of 2, 4 or 8 bits", "unsupported_input"),
        (lambda q, k, v: (q, k, v, {"bits": 8}),
         "bits=8 does not match the quantized keys, whose rows hold 4-bit elements", "unsupported_input"),
        (lambda q, k, v: (q, k, v, {"group_size": 64}),
         "group_size=64 does not match the quantized keys, whose scales give groups of 32", "unsupported_input"),
        (lambda q, k, v: (q, mx.dequantize(*k, group_size=32, bits=4), mx.dequantize(*v, group_size=32, bits=4),
                          {"bits": 4}),
         "group_size and bits describe quantized keys or values", "unsupported_input"),
        (lambda q, k, v: (q, k, (v[0][..., :5, :], v[1][..., :5, :], v[2][..., :5, :]), {}),
         "keys and values must have the same shape", "unsupported_input"),
    ],
)
def test_bad_quantized_input_is_refused(change, message, reason):
    q, k, v, kwargs = change(*bad())
    with pytest.raises(UnsupportedError, match=message) as info:
        flash_attention(q, k, v, **kwargs)
    assert info.value.reason == reason


def test_unsupported_bits_and_group_sizes_name_their_reason():
    # 6-bit fields, and groups of 16: well-formed, but not what the kernels read.
    q = mx.zeros((1, 2, 4, 64))
    six_bits = (mx.zeros((1, 1, 8, 12), dtype=mx.uint32), mx.zeros((1, 1, 8, 2)), mx.zeros((1, 1, 8, 2)))
    with pytest.raises(UnsupportedError, match="quantized keys of 6 bits: the kernels read 2, 4 and 8 bits") as info:
        flash_attention(q, six_bits, six_bits)
    assert info.value.reason == "quantized_kv_cache"
    groups_of_16 = (mx.zeros((1, 1, 8, 8), dtype=mx.uint32), mx.zeros((1, 1, 8, 4)), mx.zeros((1, 1, 8, 4)))
    with pytest.raises(UnsupportedError, match="in groups of 16") as info:
        flash_attention(q, groups_of_16, groups_of_16)
    assert info.value.reason == "quantized_kv_cache"


def test_a_tuple_of_the_wrong_length_is_a_type_error():
    q, kq, vq = bad()
    with pytest.raises(TypeError):
        flash_attention(q, kq[:2], vq)
