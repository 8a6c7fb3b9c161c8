"""flash_attention against the float64 reference and against MLX's own SDPA,
over a pairwise covering matrix of shapes, masks, dtypes and layouts."""

import math

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import LAYOUTS, MASKS, MATRIX, SIZES, TOLERANCE, Case, make_inputs

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, mask_terms, relative_error


def test_matrix_covers_every_value():
    assert {c.L for c in MATRIX} == set(SIZES)
    assert {c.mask for c in MATRIX} == set(MASKS)
    assert {c.layout for c in MATRIX} == set(LAYOUTS)
    assert any(c.layout != "contiguous" and c.dtype != "float32" for c in MATRIX)


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_matches_float64_reference(case):
    q, k, v, mask = make_inputs(case)
    out = flash_attention(q, k, v, mask=mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_reference(q, k, v, mask=mask)
    assert not np.isnan(np.array(out.astype(mx.float32))).any()
    assert relative_error(out, ref) <= TOLERANCE[case.dtype]


def _visible_rows(case, mask):
    """Rows with at least one visible key: MLX returns NaN or a uniform
    average for the others, so only these are compared with it."""
    visible, _ = mask_terms(mask, (*case.batch, case.heads[0], case.L, case.S))
    return visible.any(axis=-1)


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_matches_mlx_sdpa(case):
    q, k, v, mask = make_inputs(case, seed=1)
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        mask = mask.astype(q.dtype)  # MLX wants additive masks in the output dtype
    out = flash_attention(q, k, v, mask=mask)
    # MLX's SDPA takes rank-4 inputs: fold the batch dimensions into one.
    fold = lambda x: x.reshape(-1, *x.shape[-3:])
    mlx_mask = mask
    if isinstance(mask, mx.array):
        target = (*case.batch, case.heads[0], case.L, case.S)
        mlx_mask = fold(mx.broadcast_to(mask, target))
    expected = mx.fast.scaled_dot_product_attention(
        fold(q), fold(k), fold(v), scale=1 / math.sqrt(case.E), mask=mlx_mask
    ).reshape(q.shape)
    rows = _visible_rows(case, mask)
    a = np.array(out.astype(mx.float32))[rows]
    b = np.array(expected.astype(mx.float32))[rows]
    # MLX's CPU path rounds its intermediates to the inputs' dtype.
    tol = 2e-5 if case.dtype == "float32" else 4 * TOLERANCE[case.dtype]
    assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_qwen2_shaped_causal_prefill_with_cache(dtype, tol):
    # 257 new queries against 300 keys (43 already cached): causal, GQA 14/2.
    case = Case(batch=(1,), heads=(14, 2), L=257, S=300, E=64, mask="causal", dtype=dtype)
    q, k, v, mask = make_inputs(case)
    out = flash_attention(q, k, v, mask=mask)
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= tol


@pytest.mark.parametrize("L, S", [(1, 300), (8, 300), (300, 8), (64, 33), (33, 64), (100, 1)])
def test_causal_is_bottom_right_aligned(L, S):
    case = Case(batch=(2,), heads=(4, 2), L=L, S=S, E=16, mask="causal")
    q, k, v, mask = make_inputs(case)
    out = np.array(flash_attention(q, k, v, mask=mask))
    ref = attention_reference(q, k, v, mask=mask)
    assert relative_error(out, ref) <= 2e-5
    if L > S:  # the first L - S rows see no key: zeros, not NaN
        assert np.all(out[..., : L - S, :] == 0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fully_masked_rows_are_zero(dtype):
    case = Case(batch=(1,), heads=(2, 1), L=40, S=70, E=16, dtype=dtype)
    q, k, v, _ = make_inputs(case)
    visible = np.ones((40, 70), dtype=bool)
    visible[[0, 5, 39]] = False
    additive = np.where(visible, 0.0, -np.inf).astype(np.float32)
    for mask in (mx.array(visible), mx.array(additive)):
        out = np.array(flash_attention(q, k, v, mask=mask).astype(mx.float32))
        assert np.all(out[..., [0, 5, 39], :] == 0)
        assert not np.isnan(out).any()
        ref = attention_reference(q, k, v, mask=mask)
        assert relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("magnitude", [30.0, 300.0])
def test_large_magnitude_scores(dtype, magnitude):
    # Scores in the thousands: exp overflows unless the running max is exact.
    case = Case(batch=(1,), heads=(4, 2), L=65, S=97, E=32, mask="causal", dtype=dtype)
    q, k, v, mask = make_inputs(case, scale=math.sqrt(magnitude))
    out = flash_attention(q, k, v, mask=mask)
    assert not np.isnan(np.array(out.astype(mx.float32))).any()
    ref = attention_reference(q, k, v, mask=mask)
    # Near-one-hot softmax: the reference's own rounding of the scores in the
    # input dtype dominates, so compare against float32 inputs' tolerance
    # scaled by the score magnitude.
    tol = TOLERANCE[dtype] if dtype != "float32" else 2e-5 * magnitude / 30
    assert relative_error(out, ref) <= tol


def test_explicit_scale():
    case = Case(batch=(1,), heads=(4, 4), L=33, S=33, E=64, mask="causal")
    q, k, v, mask = make_inputs(case)
    for scale in (0.0, 0.01, 1.0, 3.0):
        out = flash_attention(q, k, v, scale=scale, mask=mask)
        assert relative_error(out, attention_reference(q, k, v, scale=scale, mask=mask)) <= 2e-5


def test_nan_in_a_query_row_stays_in_that_row():
    case = Case(batch=(1,), heads=(2, 1), L=40, S=50, E=16)
    q, k, v, _ = make_inputs(case)
    qn = np.array(q)
    qn[0, 1, 7, 3] = np.nan
    out = np.array(flash_attention(mx.array(qn), k, v))
    assert np.isnan(out[0, 1, 7]).all()
    rest = np.ones(out.shape[:-1], dtype=bool)
    rest[0, 1, 7] = False
    assert not np.isnan(out[rest]).any()


@pytest.mark.parametrize("L, S", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(L, S):
    q = mx.ones((2, 4, L, 8))
    k = mx.ones((2, 2, S, 8))
    out = flash_attention(q, k, k, mask="causal")
    assert out.shape == (2, 4, L, 8)
    assert np.all(np.array(out) == 0)


def test_strided_inputs_are_read_in_place():
    # A view whose rows are every other row of a buffer, E strided too.
    base = mx.random.normal((1, 4, 80, 2 * 32), key=mx.random.key(3))
    q = base[:, :, ::2, ::2]
    k = base[:, :2, 1::2, 1::2]
    v = base[:, 2:, ::2, 1::2]
    out = flash_attention(q, k, v, mask="causal")
    assert relative_error(out, attention_reference(q, k, v, mask="causal")) <= 2e-5
