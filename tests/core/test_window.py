"""Sliding windows (`window=W` with `mask="causal"`: row i sees key j iff
i + S - L - W < j <= i + S - L, mlx-lm's create_causal_mask(window_size=W)):
the forward against a float64 reference given the same rule as a boolean
mask, over a covering matrix of sizes, windows, dtypes and layouts (prefill,
chunked prefill, decode with split keys; on a GPU too, where there is one); gradients through the fused
backward against the reference and MLX's VJP of its SDPA with the boolean
mask; keys outside the window never reach a row; bad windows refused."""

import math

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import TOLERANCE, Case, make_inputs
from pairwise import pairwise

from flashattn_core import UnsupportedError, flash_attention, gradient_stats, reset_gradient_stats
from flashattn_core.reference import (attention_gradients_reference, attention_reference, causal_mask,
                                      relative_error)


@pytest.fixture(autouse=True)
def on_the_cpu():
    with mx.stream(mx.cpu):
        yield


SIZES = [1, 7, 33, 100, 257]
MATRIX = [
    (Case(batch=row["batch"], heads=row["heads"], L=row["L"], S=row["S"], E=row["E"], mask="causal",
          dtype=row["dtype"], layout=row["layout"]), row["window"])
    for row in pairwise(
        {
            "L": SIZES,
            "S": SIZES + [1100],
            "window": [1, 2, 31, 64, 100, 5000],
            "E": [5, 64, 80, 128],
            "heads": [(1, 1), (6, 3), (14, 2), (32, 8)],
            "batch": [(), (1,), (2, 2)],
            "dtype": ["float32", "float16", "bfloat16"],
            "layout": ["contiguous", "transposed", "kv_cache", "e_strided"],
        },
        accept=lambda row: math.prod(row["batch"]) * row["heads"][0] * row["L"] * row["S"] * row["E"] <= 30_000_000,
    )
]


def case_id(item):
    case, window = item
    return f"{case}_w{window}"


@pytest.mark.parametrize("item", MATRIX, ids=map(case_id, MATRIX))
def test_matches_float64_reference(item):
    case, window = item
    q, k, v, _ = make_inputs(case)
    out = flash_attention(q, k, v, mask="causal", window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_reference(q, k, v, mask=causal_mask(case.L, case.S, window))
    assert relative_error(out, ref) <= TOLERANCE[case.dtype]


@pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs a GPU (MLX's CUDA or Metal backend)")
@pytest.mark.parametrize("item", MATRIX, ids=map(case_id, MATRIX))
def test_matches_float64_reference_on_the_gpu(item):
    # The GPU kernels' forward over the same matrix (the GPU suite runs it).
    case, window = item
    q, k, v, _ = make_inputs(case)
    out = flash_attention(q, k, v, mask="causal", window=window, stream=mx.gpu)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_reference(q, k, v, mask=causal_mask(case.L, case.S, window))
    assert relative_error(out, ref) <= TOLERANCE[case.dtype]


@pytest.mark.parametrize(
    "L, S, window",
    [
        (1, 6000, 3000),  # decode, keys split across threads inside the window
        (1, 6000, 40),
        (2, 6000, 2500),  # two positions: the rows' windows start apart
        (300, 5000, 1000),  # a chunk against a long cache
        (200, 200, 1),  # every row sees itself only
    ],
)
def test_long_keys_prefill_chunks_and_decode(L, S, window):
    case = Case(batch=(1,), heads=(8, 2), L=L, S=S, E=64, mask="causal", layout="kv_cache")
    q, k, v, _ = make_inputs(case, seed=3)
    out = flash_attention(q, k, v, mask="causal", window=window)
    ref = attention_reference(q, k, v, mask=causal_mask(L, S, window))
    assert relative_error(out, ref) <= 2e-5


def test_keys_outside_the_window_never_reach_a_row():
    case = Case(batch=(1,), heads=(4, 2), L=130, S=300, E=32, mask="causal")
    q, k, v, _ = make_inputs(case, seed=4)
    band = causal_mask(case.L, case.S, 50)
    seen = band.any(axis=0)
    poison = mx.array(np.where(seen[:, None], 0.0, np.nan).astype(np.float32))
    out = flash_attention(q, k + poison, v + poison, mask="causal", window=50)
    assert np.isfinite(np.array(out)).all()
    ref = attention_reference(q, k, v, mask=band)
    assert relative_error(out, ref) <= 2e-5


GRADIENT_CASES = [
    (Case(batch=(1,), heads=(14, 2), L=130, S=130, E=64, mask="causal"), 40),
    (Case(batch=(2,), heads=(4, 4), L=70, S=300, E=32, mask="causal"), 64),
    (Case(batch=(1,), heads=(6, 3), L=1, S=500, E=80, mask="causal"), 100),
    (Case(batch=(1,), heads=(2, 1), L=64, S=64, E=16, mask="causal"), 1),
    (Case(batch=(1,), heads=(8, 2), L=100, S=100, E=128, mask="causal", dtype="bfloat16"), 33),
]


@pytest.mark.parametrize("item", GRADIENT_CASES, ids=map(case_id, GRADIENT_CASES))
def test_gradients_match_reference_and_mlx_vjp(item):
    case, window = item
    q, k, v, _ = make_inputs(case, seed=2)
    band = causal_mask(case.L, case.S, window)
    d_out = mx.array(np.random.default_rng(5).standard_normal(q.shape)).astype(q.dtype)
    ours = lambda q, k, v: flash_attention(q, k, v, mask="causal", window=window)
    mlx = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=case.E**-0.5, mask=mx.array(band))
    reset_gradient_stats()
    _, got = mx.vjp(ours, [q, k, v], [d_out])
    assert gradient_stats() == {"fused": 1, "recomputed": {}}
    f32 = lambda x: x.astype(mx.float32)
    _, want = mx.vjp(mlx, [f32(q), f32(k), f32(v)], [f32(d_out)])
    refs, sizes = attention_gradients_reference(q, k, v, d_out, mask=band, sizes=True)
    tolerance = 2e-5 if case.dtype == "float32" else TOLERANCE[case.dtype]
    for name, g, w, ref, size in zip(("dq", "dk", "dv"), got, want, refs, sizes):
        assert g.dtype == q.dtype, name
        # Relative to the terms summed before dP - D cancels (to nothing at
        # window 1, where each row sees itself alone).
        g = np.array(g.astype(mx.float32), dtype=np.float64)
        scale = max(np.linalg.norm(ref), size, 1e-30)
        assert np.linalg.norm(g - ref) / scale <= tolerance, name
        assert np.linalg.norm(g - np.array(w, dtype=np.float64)) / scale <= max(tolerance, 2e-5), name


def test_compiled_gradient_equals_the_eager_one():
    case = Case(batch=(1,), heads=(4, 2), L=90, S=90, E=32, mask="causal")
    q, k, v, _ = make_inputs(case, seed=6)
    loss = lambda q, k, v: flash_attention(q, k, v, mask="causal", window=20).sum()
    eager = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    compiled = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(eager, compiled):
        assert np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize(
    "window, mask, message",
    [
        (0, "causal", "window must be a positive number of keys; got 0"),
        (-3, "causal", "window must be a positive number of keys; got -3"),
        (8, None, r'window needs mask="causal".*got window=8 with no mask'),
        (8, mx.ones((4, 4), dtype=mx.bool_), r'window needs mask="causal".*with a mask array'),
    ],
)
def test_bad_windows_are_refused(window, mask, message):
    q = mx.zeros((1, 2, 4, 16))
    with pytest.raises(UnsupportedError, match=message) as info:
        flash_attention(q, q, q, mask=mask, window=window)
    assert info.value.reason == "unsupported_mask"


def test_a_window_of_the_wrong_type_is_a_type_error():
    q = mx.zeros((1, 2, 4, 16))
    with pytest.raises(TypeError):
        flash_attention(q, q, q, mask="causal", window=2.5)
