"""The quantized decode on CUDA: keys and values in MLX's affine format (as
mlx-lm's QuantizedKVCache holds them) read in place by the 16-bit
tensor-core decode, against float64 attention on their float64
dequantization, over a covering matrix of head layouts, query rows, cache
lengths (one block, key splits merged in the launch), head dims, bits, group
sizes, dtypes, masks, attention sinks, batch and memory layouts; float32
attention over it
(the patch's default) read in place by the float32 tensor-core decode, over
the same matrix; the calls neither takes (more rows than a block holds)
still exact; no full-precision copy of the cache."""

import math

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import TOLERANCE, sinks_for
from pairwise import pairwise
from quantized_cases import dividing_group_size, quantized_case

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, causal_mask, dequantize, relative_error

pytestmark = pytest.mark.skipif(
    not (mx.is_available(mx.gpu) and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend and an NVIDIA GPU",
)


def covering_matrix(heads, dtypes, L=None):
    """A pairwise covering matrix of the decode's cases: these heads and
    dtypes (and query rows L, where given) against cache lengths, head dims,
    bits, group sizes (the largest that divides E), masks, sinks, batch and
    layouts."""
    rows = pairwise(
        {
            "heads": heads,
            **({"L": L} if L else {}),
            "S": [1, 31, 100, 1024, 1025, 5000, 32768],
            "E": [64, 128],
            "bits": [4, 8],
            "group_size": [32, 64, 128],
            "dtype": dtypes,
            "mask": ["none", "causal"],
            "sinks": [False, True],
            "batch": [(), (1,), (3,)],
            "layout": ["contiguous", "kv_cache", "odd_queries"],
        },
        accept=lambda r: math.prod(r["batch"]) * r["heads"][1] * r["S"] * r["E"] <= 20_000_000,
        candidates=300,
    )
    for r in rows:
        r["group_size"] = dividing_group_size(r["E"], r["group_size"])
    return rows


# (14, 2) Qwen2-0.5B, (32, 8) 7B-class, (8, 1) and (16, 1) a block's 16 rows full at L = 2 / 1, (4, 4) multi-head
MATRIX = covering_matrix([(14, 2), (32, 8), (8, 1), (16, 1), (4, 4)], ["bfloat16", "float16"], L=[1, 2, 3])


def row_id(r):
    b = "x".join(map(str, r["batch"])) or "-"
    return (f"b{b}_h{r['heads'][0]}-{r['heads'][1]}_L{r['L']}_S{r['S']}_E{r['E']}_{r['bits']}bit_g{r['group_size']}"
            f"_{r['mask']}{'_sinks' if r['sinks'] else ''}_{r['dtype']}_{r['layout']}")


@pytest.mark.parametrize("r", MATRIX, ids=map(row_id, MATRIX))
def test_matches_float64_on_the_dequantized_cache(r):
    q, kq, vq = quantized_case(r["batch"], r["heads"], r["L"], r["S"], r["E"], r["bits"], r["group_size"],
                               r["dtype"], r["layout"])
    mask = "causal" if r["mask"] == "causal" else None
    sinks = sinks_for(r["heads"][0]) if r["sinks"] else None
    out = flash_attention(q, kq, vq, mask=mask, sinks=sinks, stream=mx.gpu)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_reference(q, dequantize(kq, r["E"]), dequantize(vq, r["E"]),
                              mask=causal_mask(r["L"], r["S"]) if mask else None, sinks=sinks)
    assert relative_error(out, ref) <= TOLERANCE[r["dtype"]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("E", [64, 128])
def test_values_at_the_codes_extremes(dtype, E):
    # Every code 0 or all ones (15 / 255): the expansion's shifts and masks
    # reach each field whole. (Values kept positive: an output that cancels
    # to near zero would measure 16-bit attention's rounding, not this.)
    rng = np.random.default_rng(4)
    S = 3000
    q = mx.array(rng.standard_normal((1, 8, 1, E))).astype(getattr(mx, dtype))
    for bits in (4, 8):
        top = (1 << bits) - 1
        codes = rng.choice([0, top], size=(1, 2, S, E))
        x = mx.array(codes * 0.01 + 0.3).astype(getattr(mx, dtype))
        kq, vq = mx.quantize(x, group_size=32, bits=bits), mx.quantize(x[..., ::-1, :], group_size=32, bits=bits)
        out = flash_attention(q, kq, vq, stream=mx.gpu)
        ref = attention_reference(q, dequantize(kq, E), dequantize(vq, E))
        assert relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("with_sinks", [False, True])
def test_reads_the_cache_in_place(with_sinks):
    # A dequantized copy of K and V at S = 32768 (2 KV heads, E = 64,
    # bfloat16) is 16 MiB; the fused decode's partials are well under 1 MiB.
    q, kq, vq = quantized_case((1,), (14, 2), 1, 32768, 64, 4, 64, "bfloat16", "kv_cache", seed=5)
    sinks = sinks_for(14) if with_sinks else None
    mx.eval(q, kq, vq)
    out = flash_attention(q, kq, vq, sinks=sinks, stream=mx.gpu)  # the kernel's module loaded
    mx.eval(out)
    del out
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, kq, vq, sinks=sinks, stream=mx.gpu)
    mx.eval(out)
    extra = mx.get_peak_memory() - before
    assert extra < 2**20, f"{extra / 2**20:.1f} MiB beyond the inputs"


# a block's 8 rows: (14, 2) 7, (32, 8) 4, (8, 1) 8 at L = 1, (4, 4) 2 at L = 2
FLOAT32_MATRIX = covering_matrix([(14, 2), (32, 8), (8, 1), (4, 4)], ["bfloat16", "float16", "float32"])
for r in FLOAT32_MATRIX:
    r["L"] = 2 if r["heads"] == (4, 4) else 1


@pytest.mark.parametrize("r", FLOAT32_MATRIX, ids=map(row_id, FLOAT32_MATRIX))
def test_float32_attention_matches_float64(r):
    # dtype=float32 (the patch's default) over a quantized cache: the float32
    # tensor-core decode reads it in place, its float32 output within float32's
    # tolerance of float64 on the dequantized cache.
    q, kq, vq = quantized_case(r["batch"], r["heads"], r["L"], r["S"], r["E"], r["bits"], r["group_size"],
                               r["dtype"], r["layout"])
    mask = "causal" if r["mask"] == "causal" and r["L"] == 1 else None
    sinks = sinks_for(r["heads"][0]) if r["sinks"] else None
    out = flash_attention(q, kq, vq, mask=mask, sinks=sinks, dtype=mx.float32, stream=mx.gpu)
    assert out.shape == q.shape and out.dtype == mx.float32
    ref = attention_reference(q, dequantize(kq, r["E"]), dequantize(vq, r["E"]), sinks=sinks)
    assert relative_error(out, ref) <= TOLERANCE["float32"]


@pytest.mark.parametrize("with_sinks", [False, True])
def test_float32_attention_reads_the_cache_in_place(with_sinks):
    # A float32 copy of K and V at S = 32768 (2 KV heads, E = 64) is 32 MiB.
    q, kq, vq = quantized_case((1,), (14, 2), 1, 32768, 64, 4, 64, "bfloat16", "kv_cache", seed=7)
    sinks = sinks_for(14) if with_sinks else None
    mx.eval(q, kq, vq)
    out = flash_attention(q, kq, vq, dtype=mx.float32, sinks=sinks, stream=mx.gpu)
    mx.eval(out)
    del out
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, kq, vq, dtype=mx.float32, sinks=sinks, stream=mx.gpu)
    mx.eval(out)
    extra = mx.get_peak_memory() - before
    assert extra < 2**20, f"{extra / 2**20:.1f} MiB beyond the inputs"


@pytest.mark.parametrize("L, heads, dtype", [(2, (16, 1), "float32"), (3, (16, 1), "bfloat16")])
def test_calls_the_kernel_does_not_take_stay_exact(L, heads, dtype):
    # 32 rows a KV head with float32 attention, 48 in bfloat16: more than a
    # block holds, dequantized for the ordinary kernels.
    q, kq, vq = quantized_case((1,), heads, L, 4000, 64, 4, 64, "bfloat16", "kv_cache", seed=6)
    wide = dtype == "float32"
    out = flash_attention(q, kq, vq, mask="causal", dtype=mx.float32 if wide else None, stream=mx.gpu)
    ref = attention_reference(q, dequantize(kq, 64), dequantize(vq, 64), mask=causal_mask(L, 4000))
    assert relative_error(out, ref) <= TOLERANCE[dtype]
