"""CUDA-only checks (the whole CPU suite also runs on the GPU there, since
the CUDA build of MLX makes the GPU the default device): long sequences,
every kernel variant, strided and broadcast inputs, decode splits."""


from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import TOLERANCE, Case, band_scales, make_inputs

from flashattn_core import flash_attention, gradient_stats, reset_gradient_stats
from flashattn_core.reference import attention_gradients_reference, attention_reference, causal_mask, relative_error

pytestmark = pytest.mark.skipif(
    not (mx.is_available(mx.gpu) and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend and an NVIDIA GPU",
)


def sampled_error(q, k, v, out, mask=None, rows=24):
    """Relative error on a few query rows (the full reference would not fit);
    mask: None, "causal" or an (L, S) array."""
    L, S = q.shape[-2], k.shape[-2]
    idx = np.unique(np.linspace(0, L - 1, rows).astype(int))
    if isinstance(mask, mx.array):
        m = np.array(mask if mask.dtype == mx.bool_ else mask.astype(mx.float32))[idx]  # NumPy has no bfloat16
    else:
        m = causal_mask(L, S)[idx] if mask == "causal" else None
    ref = attention_reference(q[..., mx.array(idx), :], k, v, mask=m)
    return relative_error(np.array(out.astype(mx.float32))[..., idx, :], ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_long_sequence_16k(dtype):
    case = Case(batch=(1,), heads=(14, 2), L=16384, S=16384, E=64, mask="causal", dtype=dtype)
    q, k, v, mask = make_inputs(case)
    out = flash_attention(q, k, v, mask=mask)
    assert not mx.isnan(out).any().item()
    assert sampled_error(q, k, v, out, mask) <= TOLERANCE[dtype]


@pytest.mark.parametrize("E", [80, 96, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "batch,heads,L,S,mask",
    [
        ((1,), (17, 1), 4096, 4096, "causal"),
        ((1,), (17, 1), 3900, 4000, "causal"),
        ((1,), (17, 1), 3900, 3900, "none"),
        ((3,), (8, 2), 2800, 2800, "bool_LS"),
    ],
)
def test_scheduled_row_tiles(batch, heads, L, S, mask, dtype, E):
    """Calls of at least 512 row tiles (all slices) at E = 128, and at 80 / 96
    in its tiles: on Hopper one block per SM takes a share of them, ordered
    heaviest first and dealt out in a snake (prefill_f16_wg.cu); a row tile
    left out would stay NaN under FLASHATTN_CUDA_POISON (scripts/cuda-check)."""
    case = Case(batch=batch, heads=heads, L=L, S=S, E=E, mask=mask, dtype=dtype)
    q, k, v, m = make_inputs(case)
    out = flash_attention(q, k, v, mask=m)
    assert not mx.isnan(out).any().item()
    assert sampled_error(q, k, v, out, m, rows=40) <= TOLERANCE[dtype]


@pytest.mark.parametrize("E", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["causal", "none", "bool_LS", "additive_full"])
def test_every_prefill_kernel(E, dtype, mask):
    case = Case(batch=(2,), heads=(8, 2), L=300, S=333, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    q, k, v, m = make_inputs(case)
    out = flash_attention(q, k, v, mask=m)
    assert relative_error(out, attention_reference(q, k, v, mask=m)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["causal", "none", "bool_LS", "additive_LS"])
def test_prefill_chunk_in_row_tiles_of_128(mask, dtype):
    # mlx-lm's prefill chunk (2048 rows against more keys) at E = 64: on an
    # H100 / H200 (132 SMs) its 154 three-consumer blocks are a little more
    # than one wave, and the launch model (wg_launch.cpp) takes the
    # two-consumer kernel (fa_prefill_wg2_*) or splits the last row tiles'
    # keys (key_split.cuh); the cache's layout.
    case = Case(batch=(1,), heads=(14, 2), L=2048, S=6144, E=64, mask=mask, dtype=dtype, layout="kv_cache")
    q, k, v, m = make_inputs(case)
    out = flash_attention(q, k, v, mask=m)
    assert not mx.isnan(out).any().item()
    assert sampled_error(q, k, v, out, m, rows=40) <= TOLERANCE[dtype]


@pytest.mark.parametrize("S", [100, 513, 4096, 32768])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,E", [((8, 4), 256), ((8, 8), 80), ((6, 2), 40), ((4, 4), 96)])
@pytest.mark.parametrize("mask", ["none", "causal", "bool_full", "additive_full"])
def test_generic_decode_splits(S, dtype, heads, E, mask):
    # Head dims no decode kernel takes (Gemma's 256, Phi-2's 80, and 40), and
    # E = 96 with one row a KV head (Phi-3-mini's decode: plan_decode.cpp's
    # decode_takes), go to the generic kernel: keys walked in groups
    # (generic.cu; with 16-byte loads, in 1-4 segments of a warp, where rows
    # start on 16-byte boundaries, as here: generic_vec.cu), split over blocks
    # of at least 64 keys and merged; groups cut short at a split's end, keys
    # hidden inside a group by the array masks.
    case = Case(batch=(2,), heads=heads, L=1, S=S, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    q, k, v, m = make_inputs(case)
    out = flash_attention(q, k, v, mask=m)
    assert relative_error(out, attention_reference(q, k, v, mask=m)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("E", [40, 80, 256])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mask", ["bool", None])
def test_non_finite_inputs_in_generic_decode(E, where, value, mask):
    # tests/core/test_values.py's semantics on the generic kernel's grouped
    # walk (L = 1, a 2:1 group, keys split and merged; at E = 40 and 80 its
    # 16-byte-load form, generic_vec.cu, whose E = 40 warp walks two
    # segments of keys and merges them): a poisoned key that
    # every row sees (3), and two that the boolean mask hides inside a group
    # (4 and 2998: every key c with c % 3 == 1), whose values must never
    # reach an output; a poisoned query element in one row.
    case = Case(batch=(1,), heads=(8, 4), L=1, S=3000, E=E)
    q, k, v, _ = (np.array(x) for x in make_inputs(case))
    if where == "q":
        q[0, 3, 0, 5] = value
    else:
        target = k if where == "k" else v
        for head, key in ((1, 3), (1, 4), (0, 2998)):
            target[0, head, key, 5] = value
    m = mx.array(np.arange(3000) % 3 != 1) if mask == "bool" else None
    assert_non_finite_semantics(q, k, v, m)


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("E,heads", [(64, (14, 2)), (128, (16, 2)), (96, (12, 4)), (80, (8, 8))])
@pytest.mark.parametrize("mask", ["causal", "none", "bool_LS", "additive_LS"])
def test_prefill_few_rows_against_a_long_cache(mask, E, heads, dtype, widen):
    # A few hundred query rows against a long cache (a prompt after a long
    # context, a short last chunk): fewer row tiles than SMs, and on an
    # H100 / H200 the launch model (wg_launch.cpp) cuts each row tile's keys
    # into pieces, a block each, the last piece to finish merging the
    # others (key_split.cuh). Under FLASHATTN_CUDA_POISON (scripts/cuda-check)
    # a row tile that no piece stored would stay NaN.
    case = Case(batch=(1,), heads=heads, L=200, S=8192, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    q, k, v, m = make_inputs(case)
    out = flash_attention(q, k, v, mask=m, dtype=mx.float32 if widen else None)
    assert not mx.isnan(out).any().item()
    assert relative_error(out, attention_reference(q, k, v, mask=m)) <= TOLERANCE["float32" if widen else dtype]


def test_key_split_calls_in_one_evaluation():
    # Split calls keep their pieces' tickets in scratch MLX allocates afresh
    # (tagged with the call, as the fused decode's ticket): calls evaluated
    # together, whose kernels may run at once and whose scratch may reuse
    # another call's memory, must each get their own answer.
    cases = [Case(batch=(1,), heads=heads, L=L, S=S, E=E, mask="causal", dtype="bfloat16", layout="kv_cache")
             for heads, E, L, S in [((14, 2), 64, 200, 8192), ((16, 2), 128, 100, 6000), ((14, 2), 64, 2048, 8192)]]
    inputs = [make_inputs(c, seed=i) for i, c in enumerate(cases * 3)]
    outs = [flash_attention(q, k, v, mask=m) for q, k, v, m in inputs]
    mx.eval(outs)
    for (q, k, v, m), out in zip(inputs, outs):
        assert sampled_error(q, k, v, out, m, rows=40) <= TOLERANCE["bfloat16"]


def assert_non_finite_semantics(q, k, v, m):
    args = [mx.array(x) for x in (q, k, v)]
    out = np.array(flash_attention(*args, mask=m), dtype=np.float64)
    ref = attention_reference(*args, mask=m)
    assert np.array_equal(np.isnan(out), np.isnan(ref)), "NaN in different places"
    assert np.array_equal(np.isinf(out), np.isinf(ref)), "Inf in different places"
    finite = np.isfinite(ref)
    assert relative_error(out[finite], ref[finite]) <= TOLERANCE["float32"]


@pytest.mark.parametrize("E", [64, 80, 128, 256])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mask", ["causal", "bool", None])
def test_non_finite_inputs_in_float32_prefill(E, where, value, mask):
    # tests/core/test_values.py's semantics on the tensor-core float32 prefill
    # kernels (its E = 16 takes the generic kernel; on Hopper E = 64 is the
    # wgmma kernel's, the others the mma.sync one's, whose key tiles are 32
    # at E = 256): one poisoned row early,
    # seen by most queries, one late, hidden from most; L != S, three key
    # tiles, so the masked tiles' rare path for NaN / Inf values runs.
    case = Case(batch=(1,), heads=(4, 2), L=70, S=150, E=E)
    q, k, v, _ = (np.array(x) for x in make_inputs(case))
    L, S = q.shape[-2], k.shape[-2]
    target = {"q": q, "k": k, "v": v}[where]
    target[0, 1, 3, 5] = value
    target[0, 0, target.shape[-2] - 2, 0] = value
    m = {"causal": "causal", None: None}.get(mask)
    if mask == "bool":
        m = mx.array(causal_mask(L, S) & (np.arange(S) % 3 != 1))
    assert_non_finite_semantics(q, k, v, m)


@pytest.mark.parametrize("E", [64, 80, 128, 256])
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("value", [float("inf"), -float("inf")])
def test_infinity_meets_values_exact_in_tf32(E, where, value):
    # 3xTF32 adds low-part products (q_lo k_hi, q_hi k_lo). Where the element
    # an infinity meets is exactly representable in TF32 (as every value
    # upcast from bfloat16 is), its low part is 0, and 0 x inf must not make
    # a NaN score out of what float64 makes +-inf. Every value here is
    # bfloat16-exact; the column the infinity meets is positive, so a -inf
    # key hides itself from every row (the rest stays finite), and a -inf
    # query element gives its row only -inf scores (a row of zeros).
    case = Case(batch=(1,), heads=(4, 2), L=70, S=150, E=E)
    q, k, v, _ = (np.array(x) for x in make_inputs(case))
    other = k if where == "q" else q
    other[..., 5] = np.abs(other[..., 5]) + 0.5
    q, k, v = (np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)) for x in (q, k, v))
    {"q": q, "k": k}[where][0, 1, 3, 5] = value
    assert_non_finite_semantics(q, k, v, "causal")
    assert_non_finite_semantics(q, k, v, None)


@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mask", ["causal", None])
def test_non_finite_inputs_in_float32_decode(E, where, value, mask):
    # tests/core/test_values.py's semantics on the tensor-core float32 decode
    # (decode_tf32.cu: L = 1, a 7:1 group, the keys split over several
    # blocks and merged): one poisoned key early, one late, in different
    # groups; a poisoned query element in one row.
    case = Case(batch=(1,), heads=(14, 2), L=1, S=3000, E=E)
    q, k, v, _ = (np.array(x) for x in make_inputs(case))
    if where == "q":
        q[0, 3, 0, 5] = value
    else:
        target = k if where == "k" else v
        target[0, 1, 3, 5] = value
        target[0, 0, 2998, 0] = value
    assert_non_finite_semantics(q, k, v, {"causal": "causal", None: None}[mask])


@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("inf"), -float("inf")])
def test_infinity_meets_values_exact_in_tf32_decode(E, where, value):
    # As test_infinity_meets_values_exact_in_tf32, on the float32 decode: every
    # value bfloat16-exact (a low part of 0 after the 3xTF32 split), so an
    # infinity in q or k meets exact elements, and one in v meets exact
    # probabilities (the row maximum's P is exactly 1).
    case = Case(batch=(1,), heads=(14, 2), L=1, S=3000, E=E)
    q, k, v, _ = (np.array(x) for x in make_inputs(case))
    if where != "v":
        other = k if where == "q" else q
        other[..., 5] = np.abs(other[..., 5]) + 0.5
    q, k, v = (np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)) for x in (q, k, v))
    if where == "q":
        q[0, 3, 0, 5] = value
    else:
        {"k": k, "v": v}[where][0, 1, 1500, 5] = value
    assert_non_finite_semantics(q, k, v, "causal")
    assert_non_finite_semantics(q, k, v, None)


@pytest.mark.parametrize("S", [200, 513, 4096, 32768])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("heads,E", [((14, 2), 64), ((32, 8), 128), ((16, 1), 64), ((12, 4), 96)])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_decode_splits(S, dtype, heads, E, mask):
    # E = 64 / 128 take the tensor-core decode kernels (float32 when a group
    # has at most 8 rows), the rest decode.cu.
    case = Case(batch=(2,), heads=heads, L=1, S=S, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    q, k, v, m = make_inputs(case)
    out = flash_attention(q, k, v, mask=m)
    assert relative_error(out, attention_reference(q, k, v, mask=m)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fused_decode_calls_in_one_evaluation(dtype, widen):
    # The fused decode (one launch, the last split of a group merges) keeps
    # its per-call ticket in scratch MLX allocates afresh: calls evaluated
    # together, whose kernels may run at once and whose scratch may reuse
    # another call's memory, must each get their own answer. L = 2 with an
    # 8:1 group fills all 16 rows of a block.
    cases = [Case(batch=(1,), heads=heads, L=L, S=S, E=E, mask="none", dtype=dtype, layout="kv_cache")
             for heads, E, L, S in [((14, 2), 64, 1, 32768), ((32, 8), 128, 1, 5000), ((16, 2), 64, 2, 9000),
                                    ((14, 2), 64, 1, 2048), ((8, 8), 128, 4, 20000)]]
    inputs = [make_inputs(c, seed=i) for i, c in enumerate(cases * 3)]
    out_dtype = mx.float32 if widen else None  # widened: fa_decode_mma32_fused_*
    outs = [flash_attention(q, k, v, mask=m, dtype=out_dtype) for q, k, v, m in inputs]
    mx.eval(outs)
    for (q, k, v, m), out in zip(inputs, outs):
        tol = TOLERANCE["float32" if widen else dtype]
        assert relative_error(out, attention_reference(q, k, v, mask=m)) <= tol


@pytest.mark.parametrize("E,heads,S", [(64, (14, 2), 32768), (128, (32, 8), 9000)])
def test_fused_decode_scratch_left_by_earlier_calls(E, heads, S):
    # Calls evaluated one after another get back the scratch the last one
    # freed, its ticket words still holding that call's tag and a full count
    # (decode_combine.cuh): each call must arm them afresh, not merge early
    # or never. Fresh inputs each call, so a stale output cannot pass.
    case = Case(batch=(1,), heads=heads, L=1, S=S, E=E, mask="none", dtype="bfloat16", layout="kv_cache")
    for i in range(12):
        q, k, v, m = make_inputs(case, seed=100 + i)
        out = flash_attention(q, k, v, mask=m)
        mx.eval(out)
        assert relative_error(out, attention_reference(q, k, v, mask=m)) <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("heads,E", [((14, 2), 64), ((32, 8), 128), ((12, 4), 96)])
def test_fused_decode_merge_in_shares(dtype, heads, E):
    # One batch, long caches: a group's merge would take one block more than
    # one batch of loads, so the blocks with the last tickets each merge a
    # share of the output columns (decode_combine.cuh), every share written
    # by exactly one of them. Calls evaluated together and one after another.
    case = Case(batch=(1,), heads=heads, L=1, S=32768, E=E, mask="none", dtype=dtype, layout="kv_cache")
    for round in range(2):
        inputs = [make_inputs(case, seed=200 + 4 * round + i) for i in range(4)]
        outs = [flash_attention(q, k, v, mask=m) for q, k, v, m in inputs]
        mx.eval(outs)
        for (q, k, v, m), out in zip(inputs, outs):
            assert relative_error(out, attention_reference(q, k, v, mask=m)) <= TOLERANCE[dtype]


DECODE_CALL = Case(batch=(1,), heads=(14, 2), L=1, S=3000, E=64, dtype="bfloat16", layout="kv_cache")
PREFILL_CALL = Case(batch=(1,), heads=(8, 2), L=40, S=300, E=64, mask="bool_LS", dtype="bfloat16")


@pytest.mark.parametrize(
    "base,other,kwargs",
    [
        (DECODE_CALL, replace(DECODE_CALL, S=5000), {}),  # other key splits
        (DECODE_CALL, replace(DECODE_CALL, heads=(14, 7)), {}),  # another group size
        (DECODE_CALL, replace(DECODE_CALL, batch=(2,)), {}),
        (DECODE_CALL, replace(DECODE_CALL, L=2), {}),
        (DECODE_CALL, replace(DECODE_CALL, dtype="float16"), {}),
        (DECODE_CALL, DECODE_CALL, {"scale": 0.3}),
        (DECODE_CALL, DECODE_CALL, {"dtype": mx.float32}),  # float32 attention over the 16-bit inputs
        (PREFILL_CALL, replace(PREFILL_CALL, mask="bool_keys"), {}),  # the mask's strides
        (PREFILL_CALL, replace(PREFILL_CALL, mask="causal"), {}),
        (PREFILL_CALL, replace(PREFILL_CALL, mask="additive_LS"), {}),
    ],
    ids=["S", "group", "batch", "L", "dtype", "scale", "widened", "mask_strides", "mask_kind", "mask_additive"],
)
def test_calls_alike_but_for_one_planned_value(base, other, kwargs):
    # The planner keeps each thread's recent plans (cuda/dispatch.cpp, recent.h):
    # calls that differ in one value their launches depend on, made in turn
    # and evaluated together, must each get their own answer.
    calls = [(base, {}), (other, kwargs)] * 2
    inputs = [make_inputs(case, seed=i) for i, (case, _) in enumerate(calls)]
    outs = [flash_attention(q, k, v, mask=m, **kw) for (q, k, v, m), (_, kw) in zip(inputs, calls)]
    mx.eval(outs)
    for (q, k, v, m), (case, kw), out in zip(inputs, calls, outs):
        tol = TOLERANCE["float32" if "dtype" in kw else case.dtype]
        assert relative_error(out, attention_reference(q, k, v, mask=m, scale=kw.get("scale"))) <= tol


def assert_float32_over_16_bit(q, k, v, mask=None):
    """dtype=float32 over 16-bit inputs: a float32 output within float32's
    tolerance of the float64 reference."""
    out = flash_attention(q, k, v, mask=mask, dtype=mx.float32)
    assert out.dtype == mx.float32
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= TOLERANCE["float32"]


@pytest.mark.parametrize("S", [200, 1024, 1025, 4096, 32768])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("heads,E", [((14, 2), 64), ((32, 8), 128), ((16, 1), 64)])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_float32_decode_over_16_bit_inputs(S, dtype, heads, E, mask):
    # fa_decode_mma32_*: the 16-bit keys and values read as they are, P kept
    # to float32 accuracy, a float32 output: the float32 tolerance.
    case = Case(batch=(2,), heads=heads, L=1, S=S, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    assert_float32_over_16_bit(*make_inputs(case))


@pytest.mark.parametrize("L,S,mask", [(1, 300, None), (1, 4096, None), (200, 333, "causal")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_over_misaligned_16_bit_rows(L, S, mask, dtype):
    # Rows off 16-byte boundaries, decode and prefill: the generic kernel's
    # split form (float32 partials, even for one split) and fa_merge_float32
    # instead of the tensor-core kernels.
    q = _misaligned((2, 8, L, 64), dtype, 1)
    k = _misaligned((2, 2, S, 64), dtype, 2)
    v = _misaligned((2, 2, S, 64), dtype, 3)
    assert_float32_over_16_bit(q, k, v, mask)


@pytest.mark.parametrize("S", [300, 4096, 32768])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "heads,E,L,mask",
    [((32, 32), 80, 1, "none"), ((12, 4), 96, 2, "causal"), ((8, 4), 256, 1, "none"), ((14, 2), 64, 1, "bool_keys"),
     ((32, 8), 128, 4, "additive_LS"), ((8, 2), 40, 1, "bool_full")])
def test_float32_decode_over_16_bit_inputs_in_the_generic_kernel(S, dtype, heads, E, L, mask):
    # Decode that no tensor-core decode takes (other head dims, array masks):
    # the generic kernel's split form reads the 16-bit keys and values in
    # place, in float32 arithmetic, and fa_merge_float32 writes a float32
    # output: the float32 tolerance.
    case = Case(batch=(2,), heads=heads, L=L, S=S, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    assert_float32_over_16_bit(*make_inputs(case))


@pytest.mark.parametrize("E,heads", [(80, (32, 32)), (64, (14, 2))])
def test_float32_decode_in_the_generic_kernel_reads_the_16_bit_cache_in_place(E, heads):
    # Casting keys and values of this cache to float32 would take 2 x 293 MiB
    # at E = 80, 2 x 15 MiB at E = 64 (with a key-padding mask).
    H, H_kv = heads
    capacity, offset = 32768, 30000
    keys = mx.random.normal((1, H_kv, capacity, E)).astype(mx.bfloat16)
    values = mx.random.normal((1, H_kv, capacity, E)).astype(mx.bfloat16)
    q = mx.random.normal((1, H, 1, E)).astype(mx.bfloat16)
    mask = mx.random.uniform(shape=(1, 1, 1, offset)) > 0.5 if E == 64 else None
    mx.eval(keys, values, q, *([mask] if mask is not None else []))
    k, v = keys[..., :offset, :], values[..., :offset, :]
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, k, v, mask=mask, dtype=mx.float32)
    mx.eval(out)
    assert mx.get_peak_memory() - before < 16 * 2**20
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= TOLERANCE["float32"]


def test_float32_decode_reads_the_16_bit_cache_in_place():
    # Casting keys and values of this cache to float32 would take 2 x 234 MiB.
    capacity, offset = 65536, 60000
    keys = mx.random.normal((1, 8, capacity, 128)).astype(mx.bfloat16)
    values = mx.random.normal((1, 8, capacity, 128)).astype(mx.bfloat16)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    mx.eval(keys, values, q)
    k, v = keys[..., :offset, :], values[..., :offset, :]
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, k, v, dtype=mx.float32)
    mx.eval(out)
    assert mx.get_peak_memory() - before < 32 * 2**20
    assert relative_error(out, attention_reference(q, k, v)) <= TOLERANCE["float32"]


HEADS_OF = {64: (14, 2), 80: (8, 8), 96: (12, 4), 128: (32, 8), 256: (8, 4)}


@pytest.mark.parametrize("E", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["causal", "none", "bool_LS", "additive_full"])
def test_float32_prefill_over_16_bit_inputs(E, dtype, mask):
    # Hopper: fa_prefill_wg32_* (prefill_f16_wg.cu's float32 variant) up to
    # E = 128, fa_prefill32_* (prefill_f16.cu's, mma.sync) at E = 256 and on
    # the PTX images, read the 16-bit inputs as they are; P goes into P V as
    # 16-bit terms that sum to it at float32 accuracy; the output is float32.
    heads = HEADS_OF[E]
    case = Case(batch=(2,), heads=heads, L=300, S=333, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    assert_float32_over_16_bit(*make_inputs(case))


@pytest.mark.parametrize("E", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_float32_prefill_over_16_bit_inputs_long(E, dtype, mask):
    # 4096 rows: at E = 128 (32 heads) and 96 (Phi-3-mini's 32) the scheduled
    # launch, a block per SM taking a share of every row tile; at E = 256
    # (Gemma's heads) the mma.sync kernel over 64 tiles of keys.
    heads = {64: (14, 2), 96: (32, 32), 128: (32, 8), 256: (8, 4)}[E]
    case = Case(batch=(1,), heads=heads, L=4096, S=4096, E=E, mask=mask, dtype=dtype)
    q, k, v, m = make_inputs(case)
    out = flash_attention(q, k, v, mask=m, dtype=mx.float32)
    assert out.dtype == mx.float32 and not mx.isnan(out).any().item()
    assert sampled_error(q, k, v, out, m, rows=40) <= TOLERANCE["float32"]


OUT16_CASES = [
    # the wgmma prefills' float32 variants (Hopper; mma.sync on the PTX
    # images): E = 64 and 128, a chunk of 2,048 rows over 16K keys (key
    # splits of the last row tiles), 4,096 rows at E = 128 (the scheduled
    # launch), with sinks; the mma.sync variant at E = 256; a decode (its
    # float32 output cast by flash_attention)
    (dict(heads=(14, 2), L=300, S=333, E=64, mask="causal", layout="kv_cache"), False),
    (dict(heads=(32, 8), L=300, S=333, E=128, mask="bool_LS"), False),
    (dict(heads=(14, 2), L=2048, S=16384, E=64, mask="causal", layout="kv_cache"), False),
    (dict(heads=(32, 8), L=4096, S=4096, E=128, mask="causal"), True),
    (dict(heads=(8, 4), L=300, S=333, E=256, mask="none"), False),
    (dict(heads=(14, 2), L=1, S=5000, E=64, mask="none", layout="kv_cache"), False),
]


@pytest.mark.parametrize("shape, sinks", OUT16_CASES, ids=lambda x: str(x) if isinstance(x, dict) else f"sinks={x}")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_attention_with_a_16_bit_out_dtype(shape, sinks, dtype):
    # out_dtype = the inputs' dtype (the patch's default): the prefills store
    # the float32 result rounded, bit for bit the cast of their float32
    # output; the float32 output itself is held to float64 above.
    q, k, v, m = make_inputs(Case(batch=(1,), dtype=dtype, **shape))
    kw = dict(mask=m, dtype=mx.float32)
    if sinks:
        kw["sinks"] = mx.array(np.linspace(-1.0, 3.0, q.shape[-3]), dtype=mx.float32)
    out = flash_attention(q, k, v, out_dtype=q.dtype, **kw)
    assert out.dtype == q.dtype
    assert mx.array_equal(out, flash_attention(q, k, v, **kw).astype(q.dtype))


@pytest.mark.parametrize("L,S", [(1, 300), (200, 333)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_attention_with_a_16_bit_out_dtype_over_misaligned_rows(L, S, dtype):
    # The generic kernel's split form, its merge writing the 16-bit output.
    q = _misaligned((2, 8, L, 64), dtype, 1)
    k = _misaligned((2, 2, S, 64), dtype, 2)
    v = _misaligned((2, 2, S, 64), dtype, 3)
    mask = "causal" if L > 1 else None
    out = flash_attention(q, k, v, mask=mask, dtype=mx.float32, out_dtype=q.dtype)
    assert out.dtype == q.dtype
    assert mx.array_equal(out, flash_attention(q, k, v, mask=mask, dtype=mx.float32).astype(q.dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_prefill_keeps_small_weights(dtype):
    # Most keys far below the best one of each row: their weights (down to
    # ~2^-40) go into P V as they are, not flushed by 16-bit rounding of P.
    rng = np.random.default_rng(11)
    L, S, E = 64, 4096, 64
    q = np.full((1, 2, L, E), 0.5) + rng.standard_normal((1, 2, L, E)) * 0.01
    k = rng.standard_normal((1, 1, S, E)) * 0.1
    k[..., 100, :] = 2.0
    v = rng.standard_normal((1, 1, S, E))
    q, k, v = (mx.array(x).astype(getattr(mx, dtype)) for x in (q, k, v))
    out = flash_attention(q, k, v, scale=1.0, dtype=mx.float32)
    assert relative_error(out, attention_reference(q, k, v, scale=1.0)) <= TOLERANCE["float32"]


@pytest.mark.parametrize("jump", [10.0, 30.0, 120.0])
@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("E", [64, 128])
def test_prefill_scores_that_rise_past_the_running_base(E, dtype, widen, jump):
    # Eleven key tiles of small scores, then keys whose scores (log2 units)
    # are `jump`, jump - 3 (the same tile) and jump - 5 (a later tile). The
    # 16-bit prefill in the inputs' dtype takes a tile's exponents against
    # the rows' running base, each P bounded by its thread's row sum
    # (softmax.cuh's softmax_scores_stale): a rise of ~7 leaves P under 2^8
    # as it is, ~27 rescales the tile, ~117 takes its scores again. The
    # float32 attention (widen) takes the exact step throughout.
    rng = np.random.default_rng(int(jump) + E)
    L, S = 256, 4096
    q = rng.standard_normal((1, 4, L, E)) * 0.3
    q[..., 0] = 1.0
    k = rng.standard_normal((1, 2, S, E)) * 0.3
    for key, rise in ((1500, jump), (1501, jump - 3.0), (3000, jump - 5.0)):
        k[..., key, :] = 0.0
        k[..., key, 0] = rise / np.log2(np.e)  # scale 1: the score in log2 units is `rise`
    v = rng.standard_normal((1, 2, S, E))
    q, k, v = (mx.array(x).astype(getattr(mx, dtype)) for x in (q, k, v))
    ref = attention_reference(q, k, v, scale=1.0)
    if widen:
        out = flash_attention(q, k, v, scale=1.0, dtype=mx.float32)
        assert relative_error(out, ref) <= TOLERANCE["float32"]
    else:
        out = flash_attention(q, k, v, scale=1.0)
        assert relative_error(out.astype(mx.float32), ref) <= TOLERANCE[dtype]
    assert bool(mx.all(mx.isfinite(out)))


@pytest.mark.parametrize("E", [64, 256])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_prefill_non_finite_value_hidden_by_the_mask(value, dtype, E):
    # A non-finite value in a key that the causal mask hides from the rows
    # before it: those rows stay finite (the kernel's exact path for such
    # tiles), the rows after see it. An infinite value may come out NaN
    # where float64 has +-inf: P's 16-bit terms include zeros and negative
    # remainders (the README's "dtype=float32" notes); non-finite either way.
    L = S = 300
    q = mx.random.normal((1, 4, L, E)).astype(getattr(mx, dtype))
    k = mx.random.normal((1, 2, S, E)).astype(getattr(mx, dtype))
    v = np.array(mx.random.normal((1, 2, S, E)).astype(getattr(mx, dtype)).astype(mx.float32))
    v[0, 1, 200, 7] = value
    v = mx.array(v).astype(getattr(mx, dtype))
    out = np.array(flash_attention(q, k, v, mask="causal", dtype=mx.float32), dtype=np.float64)
    ref = attention_reference(q, k, v, mask="causal")
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(out), finite)
    if np.isnan(value):
        assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert not finite.all() and finite[0, 2:, :200].all()
    assert relative_error(out[finite], ref[finite]) <= TOLERANCE["float32"]


def test_float32_over_16_bit_inputs_where_no_kernel_reads_them():
    # A prefill at E = 32: no tensor-core prefill takes that head dim, so the
    # call runs the float32 path on cast inputs; the planner keeps that it
    # does (cuda/dispatch.cpp's recent plans), so the second call takes the
    # cached answer.
    case = Case(batch=(1,), heads=(8, 2), L=200, S=3000, E=32, mask="causal", dtype="bfloat16", layout="kv_cache")
    for seed in (0, 1):
        q, k, v, m = make_inputs(case, seed=seed)
        out = flash_attention(q, k, v, mask=m, dtype=mx.float32)
        assert out.dtype == mx.float32
        assert relative_error(out, attention_reference(q, k, v, mask=m)) <= TOLERANCE["float32"]


@pytest.mark.parametrize("E", [64, 256])
def test_float32_prefill_reads_the_16_bit_cache_in_place(E):
    # A 2048-token chunk of prompt against a long bfloat16 cache: casting its
    # keys and values to float32 would take 2 x 16 MiB (E = 64; 2 x 32 MiB
    # at E = 256 with 4 KV heads), and the float32 queries and output 7 MiB
    # each (16 MiB at E = 256).
    heads, kv_heads = {64: (14, 2), 256: (8, 4)}[E]
    capacity, offset, L = 65536, {64: 32768, 256: 8192}[E], 2048
    keys = mx.random.normal((1, kv_heads, capacity, E)).astype(mx.bfloat16)
    values = mx.random.normal((1, kv_heads, capacity, E)).astype(mx.bfloat16)
    q = mx.random.normal((1, heads, L, E)).astype(mx.bfloat16)
    mx.eval(keys, values, q)
    k, v = keys[..., :offset, :], values[..., :offset, :]
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, k, v, mask="causal", dtype=mx.float32)
    mx.eval(out)
    # the float32 output (7 MiB; 16 at E = 256), the generic plan's unused
    # partials (as much again), at E = 64 the tensor maps' scratch and any key
    # splits' states (wg_launch.cpp: at most 16 MiB); the casts would add
    # 32 MiB (E = 256: 80)
    assert mx.get_peak_memory() - before < {64: 32, 256: 40}[E] * 2**20
    assert sampled_error(q, k, v, out, "causal", rows=24) <= TOLERANCE["float32"]


def test_decode_nan_key_reaches_only_its_rows():
    # A NaN in one key row: every query row sees it (no mask), so every output
    # row of that group is NaN, and the other group's rows are not.
    q = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 2, 3000, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 3000, 128)).astype(mx.bfloat16)
    k[0, 1, 1234, 5] = float("nan")
    out = np.array(flash_attention(q, k, v).astype(mx.float32))
    assert np.isnan(out[0, 4:]).all() and not np.isnan(out[0, :4]).any()


def _misaligned(shape, dtype, seed):
    """A row-contiguous view whose data starts one element into its buffer:
    rows off 16-byte boundaries, which the fast kernels' vector loads need."""
    flat = mx.random.normal((int(np.prod(shape)) + 1,), key=mx.random.key(seed)).astype(getattr(mx, dtype))
    return flat[1:].reshape(shape)


@pytest.mark.parametrize("L,S", [(1, 4096), (7, 300), (200, 333)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_off_16_byte_boundaries(L, S, dtype):
    q = _misaligned((2, 8, L, 64), dtype, 1)
    k = _misaligned((2, 2, S, 64), dtype, 2)
    v = _misaligned((2, 2, S, 64), dtype, 3)
    out = flash_attention(q, k, v, mask="causal")
    assert relative_error(out, attention_reference(q, k, v, mask="causal")) <= TOLERANCE[dtype]


def test_batch_axes_that_do_not_collapse():
    # (2, 3) batch axes swapped: no single batch stride, so MLX copies first.
    rng = np.random.default_rng(5)
    q, k, v = (mx.swapaxes(mx.array(rng.standard_normal((3, 2, h, n, 64)), dtype=mx.bfloat16), 0, 1)
               for h, n in ((4, 50), (2, 70), (2, 70)))
    out = flash_attention(q, k, v, mask="causal")
    assert relative_error(out, attention_reference(q, k, v, mask="causal")) <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize("E", [64, 80, 96, 128])
@pytest.mark.parametrize("layout", ["transposed", "reversed"])
def test_strided_views_in_the_tensor_core_prefill(E, layout):
    """Views that reach the Hopper kernels' tensor maps (prefill_f16_wg.cu)
    in place: mlx-lm's (B, L, H, E) projections transposed to (B, H, L, E)
    (head stride below the row stride); and keys and values with their rows
    reversed (a negative stride, which tensor maps cannot take: another
    kernel runs)."""
    rng = np.random.default_rng(E)
    B, H_q, H_kv, L = 2, 8, 2, 700
    if layout == "transposed":
        q, k, v = (mx.swapaxes(mx.array(rng.standard_normal((B, L, h, E)), dtype=mx.bfloat16), 1, 2)
                   for h in (H_q, H_kv, H_kv))
    else:
        q = mx.array(rng.standard_normal((B, H_q, L, E)), dtype=mx.bfloat16)
        k, v = (mx.array(rng.standard_normal((B, H_kv, L, E)), dtype=mx.bfloat16)[..., ::-1, :] for _ in range(2))
    out = flash_attention(q, k, v, mask="causal")
    assert relative_error(out, attention_reference(q, k, v, mask="causal")) <= TOLERANCE["bfloat16"]


def _transposed(B, L, heads, E, dtype, seed):
    """mlx-lm's layout: (B, L, H, E) projections viewed as (B, H, L, E)."""
    rng = np.random.default_rng(seed)
    return tuple(mx.swapaxes(mx.array(rng.standard_normal((B, L, h, E)), dtype=getattr(mx, dtype)), 1, 2)
                 for h in heads)


@pytest.mark.parametrize("dtype, E, kw", [
    ("bfloat16", 64, {}), ("bfloat16", 128, {}), ("float16", 80, {}), ("float16", 256, {}),
    ("bfloat16", 64, {"dtype": mx.float32}), ("bfloat16", 128, {"dtype": mx.float32, "out_dtype": mx.bfloat16}),
    ("float32", 64, {}), ("float32", 128, {}),
], ids=str)
@pytest.mark.parametrize("mask", ["causal", None])
def test_prefill_output_in_the_queries_layout(dtype, E, kw, mask):
    """The prefills store the output as the queries lie (as MLX's attention
    allocates its own), each kernel family through its own store."""
    q, k, v = _transposed(2, 300, (8, 2, 2), E, dtype, E)
    out = flash_attention(q, k, v, mask=mask, **kw)
    widened = "dtype" in kw
    ref = attention_reference(q, k, v, mask=mask)
    assert relative_error(out, ref) <= TOLERANCE["float32" if widened and "out_dtype" not in kw else dtype]


@pytest.mark.parametrize("kw", [{}, {"dtype": mx.float32, "out_dtype": mx.bfloat16}], ids=str)
def test_mlx_lm_transpose_of_the_output_copies_nothing(kw):
    # mlx-lm's attention output goes back to (B, L, H E) by a transpose and
    # a reshape, which copy the output unless it lies as the queries do.
    B, L, H, E = 1, 4096, 16, 128
    q, k, v = _transposed(B, L, (H, 4, 4), E, "bfloat16", 3)
    mx.eval(q, k, v)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    y = mx.swapaxes(flash_attention(q, k, v, mask="causal", **kw), 1, 2).reshape(B, L, H * E)
    mx.eval(y)
    out_bytes = B * L * H * E * 2
    assert mx.get_peak_memory() - before < 1.5 * out_bytes
    assert relative_error(y.reshape(B, L, H, E).swapaxes(1, 2), attention_reference(q, k, v, mask="causal")) <= (
        TOLERANCE["bfloat16"])


@pytest.mark.parametrize("L", [1, 512])
@pytest.mark.parametrize("transposed", [False, True])
def test_kv_cache_views_are_not_copied(L, transposed):
    # mlx-lm's KVCache hands attention keys[..., :offset, :] of a larger
    # buffer; a copy of keys and values would add 2 x 117 MiB here. Its
    # queries are (B, L, H, E) projections transposed to (B, H, L, E) (until
    # 6eb4dcd such queries made MLX copy every input).
    capacity, offset = 65536, 60000
    keys = mx.random.normal((1, 8, capacity, 128)).astype(mx.bfloat16)
    values = mx.random.normal((1, 8, capacity, 128)).astype(mx.bfloat16)
    q = mx.random.normal((1, 32, L, 128)).astype(mx.bfloat16)
    if transposed:
        q = mx.swapaxes(mx.random.normal((1, L, 32, 128)).astype(mx.bfloat16), 1, 2)
    mx.eval(keys, values, q)
    k, v = keys[..., :offset, :], values[..., :offset, :]
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, k, v, mask="causal")
    mx.eval(out)
    assert mx.get_peak_memory() - before < 32 * 2**20
    assert sampled_error(q, k, v, out, "causal") <= TOLERANCE["bfloat16"]


def test_broadcast_padding_mask_batched():
    case = Case(batch=(3,), heads=(4, 2), L=40, S=70, E=64, dtype="bfloat16")
    q, k, v, _ = make_inputs(case)
    keep = np.ones((3, 1, 1, 70), dtype=bool)
    keep[0, ..., :10] = False
    keep[2, ..., 50:] = False
    mask = mx.array(keep)
    out = flash_attention(q, k, v, mask=mask)
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= TOLERANCE["bfloat16"]


def test_cpu_and_gpu_agree():
    case = Case(batch=(1,), heads=(14, 2), L=257, S=300, E=64, mask="causal")
    q, k, v, mask = make_inputs(case)
    gpu = flash_attention(q, k, v, mask=mask, stream=mx.gpu)
    cpu = flash_attention(q, k, v, mask=mask, stream=mx.cpu)
    assert relative_error(gpu, np.array(cpu)) <= 2e-5


def test_patch_routes_through_the_gpu_kernels():
    import mlxlm_flash_patch
    from mlx_lm.models import base

    q = mx.random.normal((1, 14, 40, 64)).astype(mx.bfloat16)
    k = v = mx.random.normal((1, 2, 40, 64)).astype(mx.bfloat16)
    mlxlm_flash_patch.reset_stats()
    with mlxlm_flash_patch.patched():
        out = base.scaled_dot_product_attention(q, k, v, None, scale=0.125, mask="causal")
    stats = mlxlm_flash_patch.stats()
    assert (stats["flash_calls"], stats["fallbacks"]) == (1, {})
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert relative_error(out, np.array(ref.astype(mx.float32))) <= 2e-2


# Sliding windows: the kernels walk only the key tiles inside some row's
# window (forward) and the row tiles that see a key tile (backward), and mask
# the rest inside a tile; keys before the first row's window are left out.
WINDOW_PREFILL = [  # (heads, L, S, E, window)
    ((8, 2), 2000, 2000, 64, 300),
    ((8, 2), 700, 5000, 128, 1000),  # a chunk against a long cache
    ((4, 1), 1500, 1500, 80, 1),  # each row sees itself only
    ((17, 1), 4096, 4096, 128, 500),  # 16-bit: scheduled row tiles (prefill_f16_wg.cu)
    ((6, 3), 300, 300, 256, 64),
    ((2, 1), 1000, 1000, 64, 5000),  # a window longer than the keys: plain causal
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("c", WINDOW_PREFILL, ids=[f"{c[0]}-L{c[1]}-S{c[2]}-E{c[3]}-w{c[4]}" for c in WINDOW_PREFILL])
def test_sliding_window_prefill(c, dtype):
    heads, L, S, E, window = c
    case = Case(batch=(1,), heads=heads, L=L, S=S, E=E, mask="causal", dtype=dtype, layout="kv_cache")
    q, k, v, _ = make_inputs(case, seed=9)
    band = mx.array(causal_mask(L, S, window))
    out = flash_attention(q, k, v, mask="causal", window=window)
    assert out.dtype == q.dtype
    assert sampled_error(q, k, v, out, band) <= TOLERANCE[dtype]
    if dtype != "float32":  # float32 attention over the 16-bit inputs
        wide = flash_attention(q, k, v, mask="causal", window=window, dtype=mx.float32)
        assert wide.dtype == mx.float32
        assert sampled_error(q, k, v, wide, band) <= 2e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("L, S, window", [(1, 5000, 700), (1, 700, 5000), (4, 3000, 500), (8, 40000, 4096)])
def test_sliding_window_decode(L, S, window, dtype):
    # One position: its window's keys alone reach the decode kernels, whole.
    case = Case(batch=(2,), heads=(14, 2), L=L, S=S, E=64, mask="causal", dtype=dtype, layout="kv_cache")
    q, k, v, _ = make_inputs(case, seed=4)
    out = flash_attention(q, k, v, mask="causal", window=window)
    assert relative_error(out, attention_reference(q, k, v, mask=causal_mask(L, S, window))) <= TOLERANCE[dtype]


def test_sliding_window_prefill_holds_no_band():
    # The band as booleans would be 1 GiB (L = S = 32768); the call holds its
    # output (56 MiB) and the key splits' states (~250 MiB when forced:
    # FLASHATTN_CUDA_SPLITS in scripts/cuda-check).
    L = 32768
    case = Case(batch=(1,), heads=(14, 2), L=L, S=L, E=64, mask="causal", dtype="bfloat16")
    q, k, v, _ = make_inputs(case, seed=1)
    mx.eval(q, k, v)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, k, v, mask="causal", window=512)
    mx.eval(out)
    assert mx.get_peak_memory() - before < 512 * 2**20
    assert sampled_error(q, k, v, out, mx.array(causal_mask(L, L, 512))) <= TOLERANCE["bfloat16"]


WINDOW_GRADIENTS = [  # (heads, L, S, E, window, dtype)
    ((14, 2), 1024, 1024, 64, 200, "bfloat16"),
    ((8, 2), 300, 2000, 128, 500, "float16"),
    ((4, 2), 700, 700, 64, 100, "float32"),
    ((4, 1), 200, 900, 96, 300, "float32"),
    ((2, 2), 400, 400, 256, 1, "bfloat16"),
]


@pytest.mark.parametrize("c", WINDOW_GRADIENTS, ids=[f"{c[5]}-{c[0]}-L{c[1]}-S{c[2]}-E{c[3]}-w{c[4]}" for c in WINDOW_GRADIENTS])
def test_sliding_window_gradients(c):
    heads, L, S, E, window, dtype = c
    case = Case(batch=(1,), heads=heads, L=L, S=S, E=E, mask="causal", dtype=dtype)
    q, k, v, _ = make_inputs(case, seed=2)
    band = causal_mask(L, S, window)
    d_out = mx.array(np.random.default_rng(5).standard_normal(q.shape)).astype(q.dtype)
    reset_gradient_stats()
    _, got = mx.vjp(lambda q, k, v: flash_attention(q, k, v, mask="causal", window=window), [q, k, v], [d_out])
    mx.eval(got)
    assert gradient_stats() == {"fused": 1, "recomputed": {}}
    refs, sizes = attention_gradients_reference(q, k, v, d_out, mask=band, sizes=True)
    tolerance = 2e-5 if dtype == "float32" else TOLERANCE[dtype]
    for name, g, ref, size in zip(("dq", "dk", "dv"), got, refs, sizes):
        assert g.dtype == q.dtype, name
        g = np.array(g.astype(mx.float32), dtype=np.float64)
        # Relative to the terms summed before dP - D cancels (window 1: to nothing).
        assert np.linalg.norm(g - ref) / max(np.linalg.norm(ref), size, 1e-30) <= tolerance, name


QUANTIZED_GPU_CASES = [  # (heads, L, S, E, bits, group size, dtype, mask)
    ((14, 2), 1, 32768, 64, 4, 64, "bfloat16", None),  # decode against a long cache: many splits
    ((14, 2), 1, 5000, 64, 8, 32, "float16", "causal"),
    ((32, 8), 300, 300, 128, 4, 64, "bfloat16", "causal"),  # prefill: one split
    ((8, 2), 64, 2000, 256, 2, 128, "float32", "bool"),
    ((4, 4), 7, 100, 96, 8, 32, "float32", None),
]


def quantized_case(heads, L, S, E, bits, group_size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((1, heads[0], L, E))).astype(getattr(mx, dtype))

    def quantized():  # sliced from a larger buffer, as mlx-lm's cache does
        x = mx.array(rng.standard_normal((1, heads[1], S + 100, E))).astype(getattr(mx, dtype))
        return tuple(p[..., :S, :] for p in mx.quantize(x, group_size=group_size, bits=bits))

    return q, quantized(), quantized()


@pytest.mark.parametrize("c", QUANTIZED_GPU_CASES, ids=[f"{c[0]}-L{c[1]}-S{c[2]}-E{c[3]}-{c[4]}bit-{c[6]}"
                                                        for c in QUANTIZED_GPU_CASES])
def test_quantized_keys_and_values(c):
    # cuda/quantized.cpp (dequantized in the call) against float64 on the float64 dequantization; the dtype's
    # own output and float32 attention over it.
    from flashattn_core.reference import dequantize

    heads, L, S, E, bits, group_size, dtype, mask_kind = c
    q, kq, vq = quantized_case(heads, L, S, E, bits, group_size, dtype)
    mask = mx.array(np.random.default_rng(2).random((L, S)) < 0.7) if mask_kind == "bool" else mask_kind
    ref = attention_reference(q, dequantize(kq, E), dequantize(vq, E), mask=mask)
    out = flash_attention(q, kq, vq, mask=mask, stream=mx.gpu)
    wide = flash_attention(q, kq, vq, mask=mask, dtype=mx.float32, stream=mx.gpu)
    assert out.dtype == q.dtype and wide.dtype == mx.float32
    assert relative_error(out, ref) <= TOLERANCE[dtype]
    assert relative_error(wide, ref) <= 2e-5


def test_quantized_keys_beside_plain_values_and_a_window():
    from flashattn_core.reference import dequantize

    q, kq, vq = quantized_case((8, 2), 40, 900, 64, 4, 32, "float32")
    v = mx.array(dequantize(vq, 64).astype(np.float32))
    out = flash_attention(q, kq, v, mask="causal", window=100, stream=mx.gpu)
    ref = attention_reference(q, dequantize(kq, 64), v, mask=causal_mask(40, 900, 100))
    assert relative_error(out, ref) <= 2e-5


@pytest.mark.parametrize("L", [1, 4])
def test_quantized_decode_with_a_window(L):
    # The keys before the window are left out of the packed cache (views of
    # codes, scales and biases); one position then reads the rest in place.
    from flashattn_core.reference import dequantize

    q, kq, vq = quantized_case((14, 2), L, 5000, 64, 4, 64, "bfloat16")
    out = flash_attention(q, kq, vq, mask="causal", window=700, stream=mx.gpu)
    ref = attention_reference(q, dequantize(kq, 64), dequantize(vq, 64), mask=causal_mask(L, 5000, 700))
    assert relative_error(out, ref) <= TOLERANCE["bfloat16"]


def test_no_gradient_through_quantized_keys_on_the_gpu():
    q, kq, vq = quantized_case((2, 1), 8, 8, 64, 4, 64, "float32")
    with pytest.raises(ValueError, match="no gradient through quantized keys or values"):
        mx.grad(lambda q: flash_attention(q, kq, vq, stream=mx.gpu).sum())(q)


def test_patch_routes_quantized_caches_through_the_gpu_kernels():
    # mlx-lm's own quantized attention has no CUDA kernel for this shape
    # (MLX 0.32.4's quantized_matmul refuses 14 query heads over head dim 64
    # with bfloat16 activations): the float64 reference is the yardstick.
    import mlxlm_flash_patch
    from mlx_lm.models import base
    from mlx_lm.models.cache import QuantizedKVCache

    from flashattn_core.reference import dequantize

    cache = QuantizedKVCache(group_size=64, bits=4)
    k = mx.random.normal((1, 2, 300, 64)).astype(mx.bfloat16)
    keys, values = cache.update_and_fetch(k, k * 0.5)
    q = mx.random.normal((1, 14, 1, 64)).astype(mx.bfloat16)
    mlxlm_flash_patch.reset_stats()
    with mlxlm_flash_patch.patched():
        out = base.scaled_dot_product_attention(q, keys, values, cache, scale=0.125, mask=None)
    stats = mlxlm_flash_patch.stats()
    assert (stats["flash_calls"], stats["fallbacks"]) == (1, {})
    ref = attention_reference(q, dequantize(keys, 64), dequantize(values, 64), scale=0.125)
    assert relative_error(out, ref) <= 2e-2


@pytest.mark.parametrize("E", [64, 128, 256])
@pytest.mark.parametrize("L", [1, 200, 2048])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_float32_one_signed_values_over_many_keys(E, L, mask):
    # Values of one sign (0.15 to 0.3) averaged over 16,384 keys with nearly
    # even weights: o's sum only grows, so a float32 accumulator that rounds
    # every addition the same way (the tensor cores' own sums carried across
    # key tiles) drifts with the number of tiles, where a sum whose signs
    # vary hides it. Every float32 kernel (decode, few rows, a chunk; each
    # head dim's) stays within float32's tolerance of float64.
    rng = np.random.default_rng(7)
    S, heads = 16384, (4, 2)
    q = mx.array(rng.standard_normal((1, heads[0], L, E)) * 0.3, dtype=mx.float32)
    k = mx.array(rng.standard_normal((1, heads[1], S, E)) * 0.3, dtype=mx.float32)
    v = mx.array(rng.uniform(0.15, 0.3, (1, heads[1], S, E)), dtype=mx.float32)
    out = flash_attention(q, k, v, mask=None if mask == "none" else mask)
    assert sampled_error(q, k, v, out, None if mask == "none" else mask) <= TOLERANCE["float32"]


@pytest.mark.parametrize("mask", ["causal", "none", "bool_LS"])
@pytest.mark.parametrize("L,S", [(700, 700), (300, 1000)])
def test_float32_prefill_tiles_of_any_magnitude(L, S, mask):
    # On Hopper float32 at E = 64 runs on float16 tensor cores: each 128-row
    # tile of q, k and v is scaled by a power of two of its own into
    # float16's range, and the kernel undoes it per tile (f32_split.cu).
    # Bands of rows far outside that range both ways, every band's own
    # error held to float32's tolerance (one band's mistake would hide
    # under another's larger values in a single norm). Query and key bands
    # make some rows' scores flat, and keep them small: a score of size x
    # carries 2^-22 x of error from the 22-bit products (of 3xTF32 alike),
    # too much for the tolerance where x is in the hundreds. Value bands
    # rising with the key make each causal row's output mostly its last
    # band's, and the rest of the rows' the keys with the smallest weights.
    case = Case(batch=(2,), heads=(4, 2), L=L, S=S, E=64, mask=mask)
    q, k, v, m = make_inputs(case)
    q, k, v = (np.array(x) for x in (q, k, v))
    q = q * band_scales(L, [-40, -12, 0, 0], 1)[:, None]
    k = k * band_scales(S, [-30, -5, 0, 0], 2)[:, None]
    v = v * 2.0 ** np.minimum(np.arange(S) // 128 * 25 - 60, 60)[:, None]
    args = [mx.array(x, dtype=mx.float32) for x in (q, k, v)]
    out = np.array(flash_attention(*args, mask=m), dtype=np.float64)
    ref = attention_reference(*args, mask=m)
    for start in range(0, L, 128):
        rows = slice(start, start + 128)
        assert relative_error(out[..., rows, :], ref[..., rows, :]) <= TOLERANCE["float32"], f"rows {start}.."


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_float32_prefill_one_tile_not_finite(where, value):
    # A value that is not finite in one 128-row tile of many: the tiles that
    # hold it take their scores and P V in plain float32 (the float16 split
    # marks them), the rest stay on the tensor cores; float64's semantics
    # throughout, causal, L != S.
    case = Case(batch=(1,), heads=(4, 2), L=500, S=900, E=64)
    q, k, v, _ = (np.array(x) for x in make_inputs(case))
    target = {"q": q, "k": k, "v": v}[where]
    target[0, 1, 300, 7] = value
    assert_non_finite_semantics(q, k, v, "causal")
