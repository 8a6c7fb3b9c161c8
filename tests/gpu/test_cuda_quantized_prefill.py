"""The quantized prefill on CUDA: float32 attention (dtype=float32 over
16-bit queries, as the patch asks by default, or float32 inputs) over keys
and values in MLX's affine format (as mlx-lm's QuantizedKVCache holds them),
read in place by the 3xTF32 prefill, against float64 attention on their
float64 dequantization, over a covering matrix of head layouts, query rows,
cache lengths (prefill, chunks, fewer keys than rows), head dims, bits,
group sizes, dtypes, masks (causal, windows, boolean arrays, sinks), batch
and memory layouts; no full-precision copy of the cache. bfloat16 queries
from 64 rows at E = 64 and 128 take the cache as two bfloat16 terms a row
instead (cuda/quantized.cpp's split_terms): the same checks on a matrix of
their own, and a transient copy of O(S), never L x S. Attention in the
queries' 16-bit dtype (a dequantized copy a call) over the same matrix."""

import math
import os

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import TOLERANCE
from pairwise import pairwise
from quantized_cases import dividing_group_size, quantized_case

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, causal_mask, dequantize, relative_error

pytestmark = pytest.mark.skipif(
    not (mx.is_available(mx.gpu) and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend and an NVIDIA GPU",
)


def keys_for(L, span):
    return {"same": L, "chunk": L + 1500, "fewer": max(1, L // 4)}[span]


MATRIX = [
    row
    for row in pairwise(
        {
            # (14, 2) Qwen2-0.5B, (32, 8) 7B-class, (8, 1) one KV head, (4, 4) multi-head
            "heads": [(14, 2), (32, 8), (8, 1), (4, 4)],
            "L": [9, 64, 65, 200, 600],
            "span": ["same", "chunk", "fewer"],
            "E": [64, 96, 128, 256],
            "bits": [4, 8],
            "group_size": [32, 64, 128],
            "dtype": ["bfloat16", "float16", "float32"],
            "mask": ["none", "causal", "window", "bool", "sinks"],
            "batch": [(), (1,), (2,)],
            "layout": ["contiguous", "kv_cache", "transposed"],
        },
        accept=lambda r: math.prod(r["batch"]) * r["heads"][0] * r["L"] * keys_for(r["L"], r["span"]) <= 25_000_000,
        candidates=300,
    )
]
for r in MATRIX:
    r["group_size"] = dividing_group_size(r["E"], r["group_size"])


def row_id(r):
    b = "x".join(map(str, r["batch"])) or "-"
    return (f"b{b}_h{r['heads'][0]}-{r['heads'][1]}_L{r['L']}_{r['span']}_E{r['E']}_{r['bits']}bit"
            f"_g{r['group_size']}_{r['mask']}_{r['dtype']}_{r['layout']}")


def mask_and_sinks(kind, H_q, L, S, seed=3):
    """The call's mask, window and sinks, and the reference's mask and sinks."""
    rng = np.random.default_rng(seed)
    if kind == "bool":
        m = rng.random((L, S)) < 0.7
        return {"mask": mx.array(m)}, m, None
    if kind == "window":
        return {"mask": "causal", "window": 100}, causal_mask(L, S, 100), None
    if kind == "sinks":
        s = rng.normal(0.5, 1.5, H_q).astype(np.float32)
        return {"mask": "causal", "sinks": mx.array(s)}, causal_mask(L, S), s
    if kind == "causal":
        return {"mask": "causal"}, causal_mask(L, S), None
    return {}, None, None


def float32_call(r):
    """Row r's case, its call's keyword arguments, and float32 attention on
    it, checked against float64 on the dequantized cache; (q, kq, vq,
    kwargs, ref)."""
    S = keys_for(r["L"], r["span"])
    q, kq, vq = quantized_case(r["batch"], r["heads"], r["L"], S, r["E"], r["bits"], r["group_size"],
                               r["dtype"], r["layout"])
    kwargs, ref_mask, ref_sinks = mask_and_sinks(r["mask"], r["heads"][0], r["L"], S)
    out = flash_attention(q, kq, vq, dtype=mx.float32, stream=mx.gpu, **kwargs)
    assert out.shape == q.shape and out.dtype == mx.float32
    ref = attention_reference(q, dequantize(kq, r["E"]), dequantize(vq, r["E"]), mask=ref_mask, sinks=ref_sinks)
    assert relative_error(out, ref) <= TOLERANCE["float32"]
    return q, kq, vq, kwargs, ref


@pytest.mark.parametrize("r", MATRIX, ids=map(row_id, MATRIX))
def test_matches_float64_on_the_dequantized_cache(r):
    q, kq, vq, kwargs, ref = float32_call(r)
    if r["dtype"] != "float32":  # in the queries' dtype
        native = flash_attention(q, kq, vq, stream=mx.gpu, **kwargs)
        assert native.shape == q.shape and native.dtype == q.dtype
        assert relative_error(native, ref) <= TOLERANCE[r["dtype"]]


@pytest.mark.parametrize("E", [64, 128])
def test_values_at_the_codes_extremes(E):
    # Every code 0 or all ones (15 / 255): the expansion's shifts and masks
    # reach each field whole. Values 0.3 and 0.45 over 256 keys: an output
    # that cancels to near zero would measure the arithmetic, not this (long
    # sums of one sign: tests/gpu/test_cuda.py).
    rng = np.random.default_rng(4)
    L, S = 64, 256
    q = mx.array(rng.standard_normal((1, 8, L, E))).astype(mx.bfloat16)
    for bits in (4, 8):
        top = (1 << bits) - 1
        codes = rng.choice([0, top], size=(1, 2, S, E))
        x = mx.array(0.3 + codes / top * 0.15).astype(mx.bfloat16)
        kq, vq = mx.quantize(x, group_size=32, bits=bits), mx.quantize(x[..., ::-1, :], group_size=32, bits=bits)
        out = flash_attention(q, kq, vq, mask="causal", dtype=mx.float32, stream=mx.gpu)
        ref = attention_reference(q, dequantize(kq, E), dequantize(vq, E), mask=causal_mask(L, S))
        assert relative_error(out, ref) <= TOLERANCE["float32"]


def extra_memory(q, kq, vq, out_dtype=None):
    """(peak memory a float32-attention chunk call adds, its output)."""
    mx.eval(q, kq, vq)
    kw = dict(mask="causal", dtype=mx.float32, out_dtype=out_dtype, stream=mx.gpu)
    out = flash_attention(q, kq, vq, **kw)  # the modules loaded
    mx.eval(out)
    del out
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, kq, vq, **kw)
    mx.eval(out)
    return mx.get_peak_memory() - before, out


def test_reads_the_cache_in_place(monkeypatch):
    # A 2,048-row chunk over 16,384 keys (Qwen2-0.5B's heads): a float32
    # copy of K and V would be 16 MiB and of the queries 7 MiB; the call
    # adds its float32 output (7 MiB) alone.
    monkeypatch.setenv("FLASHATTN_CUDA_QUANT_SPLIT", "0")
    q, kq, vq = quantized_case((1,), (14, 2), 2048, 16384, 64, 4, 64, "bfloat16", "kv_cache", seed=5)
    extra, out = extra_memory(q, kq, vq)
    assert extra < out.nbytes + 2**20, f"{(extra - out.nbytes) / 2**20:.1f} MiB beyond the output"


@pytest.mark.parametrize("out_dtype", [None, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads, E, S", [((14, 2), 64, 16384), ((32, 8), 128, 8192)], ids=["qwen05b", "hd128"])
def test_split_terms_hold_o_of_s(heads, E, S, out_dtype):
    # A 2,048-row chunk through split_terms: at most the two terms of K and
    # V, the output (E wide: the kernel adds P hi and P lo) and MLX's
    # row-contiguous copies of the cache's views (the packed codes, scales
    # and biases); the queries again as [q | q] only on the kernels of GPUs
    # before Hopper (FLASHATTN_CUDA_IMAGE=ptx), whose two-term units read
    # them twice. O(L + S) however long the cache, never the 2,048 x S
    # scores (1.7 GiB in float32 across qwen05b's heads at 16K keys). A
    # bfloat16 out_dtype (the patch's call) is stored by Hopper's two-term
    # units: no float32 output beside it; elsewhere one, cast.
    L, (H, H_kv) = 2048, heads
    ptx = os.environ.get("FLASHATTN_CUDA_IMAGE") == "ptx"
    q, kq, vq = quantized_case((1,), heads, L, S, E, 4, 64, "bfloat16", "kv_cache", seed=5)
    extra, out = extra_memory(q, kq, vq, out_dtype)
    assert out.dtype == (out_dtype or mx.float32)
    views = 2 * sum(x.nbytes for x in kq)
    queries = H * L * 2 * E * 2 if ptx else 0
    float32_out = out.size * 4 if out_dtype is not None and ptx else 0
    bound = 2 * H_kv * S * 2 * E * 2 + out.nbytes + float32_out + views + queries
    assert out.nbytes < extra <= bound + 2**20, (extra / 2**20, bound / 2**20)
    ref = attention_reference(q, dequantize(kq, E), dequantize(vq, E), mask=causal_mask(L, S))
    assert relative_error(out, ref) <= (TOLERANCE["float32"] if out_dtype is None else TOLERANCE["bfloat16"])


SPLIT = [
    row
    for row in pairwise(
        {
            "heads": [(14, 2), (32, 8), (4, 4)],
            "L": [64, 200, 600],
            "span": ["same", "chunk", "fewer"],
            "E": [64, 128],
            "bits": [4, 8],
            "group_size": [32, 64, 128],
            "mask": ["none", "causal", "window", "bool", "sinks"],
            "batch": [(), (2,)],
            "layout": ["contiguous", "kv_cache", "transposed"],
        },
        accept=lambda r: math.prod(r["batch"]) * r["heads"][0] * r["L"] * keys_for(r["L"], r["span"]) <= 25_000_000,
        candidates=300,
    )
]
for r in SPLIT:
    r["group_size"] = dividing_group_size(r["E"], r["group_size"])
    r["dtype"] = "bfloat16"


@pytest.mark.parametrize("r", SPLIT, ids=map(row_id, SPLIT))
def test_split_terms_match_float64(r, monkeypatch):
    # The two-term path against float64, and against the kernels that read
    # the codes in place.
    q, kq, vq, kwargs, ref = float32_call(r)
    # out_dtype (the patch's call): the float32 result rounded once, bit for
    # bit (on Hopper the two-term units store it themselves).
    out = flash_attention(q, kq, vq, dtype=mx.float32, stream=mx.gpu, **kwargs)
    out16 = flash_attention(q, kq, vq, dtype=mx.float32, out_dtype=q.dtype, stream=mx.gpu, **kwargs)
    assert out16.dtype == q.dtype and mx.array_equal(out16, out.astype(q.dtype))
    monkeypatch.setenv("FLASHATTN_CUDA_QUANT_SPLIT", "0")
    in_place = flash_attention(q, kq, vq, dtype=mx.float32, stream=mx.gpu, **kwargs)
    assert relative_error(in_place, ref) <= TOLERANCE["float32"]


def test_keys_and_values_of_other_widths():
    # 4-bit keys, 8-bit values (MLX's format allows it; dequantized for the
    # ordinary kernels).
    rng = np.random.default_rng(6)
    L, S, E = 256, 700, 64
    q = mx.array(rng.standard_normal((1, 14, L, E))).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((2, 1, 2, S, E))).astype(mx.bfloat16)
    kq, vq = mx.quantize(x[0], group_size=64, bits=4), mx.quantize(x[1], group_size=64, bits=8)
    out = flash_attention(q, kq, vq, mask="causal", dtype=mx.float32, stream=mx.gpu)
    ref = attention_reference(q, dequantize(kq, E), dequantize(vq, E), mask=causal_mask(L, S))
    assert relative_error(out, ref) <= TOLERANCE["float32"]


@pytest.mark.parametrize("path", ["split", "in_place"])
def test_hidden_keys_never_reach_a_row(path, monkeypatch):
    # The last 64 keys hold NaN, so do their scales: under the causal mask
    # the rows before them never see them and stay exact, through the two
    # terms (a NaN hi and lo) and through the codes read in place.
    if path == "in_place":
        monkeypatch.setenv("FLASHATTN_CUDA_QUANT_SPLIT", "0")
    rng = np.random.default_rng(7)
    S, E, seen = 512, 64, 448
    q = mx.array(rng.standard_normal((1, 14, S, E))).astype(mx.bfloat16)
    x = rng.standard_normal((2, 1, 2, S, E))
    x[..., seen:, :] = np.nan
    x = mx.array(x).astype(mx.bfloat16)
    kq, vq = mx.quantize(x[0], group_size=64, bits=4), mx.quantize(x[1], group_size=64, bits=4)
    assert np.isnan(np.array(kq[1][..., seen:, :].astype(mx.float32))).all()
    out = np.array(flash_attention(q, kq, vq, mask="causal", dtype=mx.float32, stream=mx.gpu))[..., :seen, :]
    k, v = dequantize(kq, E)[..., :seen, :], dequantize(vq, E)[..., :seen, :]
    ref = attention_reference(q[..., :seen, :], k, v, mask=causal_mask(seen, seen))
    assert np.isfinite(out).all()
    assert relative_error(mx.array(out), ref) <= TOLERANCE["float32"]
