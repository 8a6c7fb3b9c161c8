"""Decode and long-key shapes: few query rows against many keys, where the
CPU kernel splits the keys across threads and merges the partial softmax
states (FlashDecoding)."""

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import TOLERANCE, Case, make_inputs

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, relative_error

DECODE = [
    Case(batch=(1,), heads=(14, 2), L=1, S=5000, E=64, mask="none"),
    Case(batch=(1,), heads=(14, 2), L=1, S=4097, E=64, mask="causal", dtype="bfloat16"),
    Case(batch=(2,), heads=(8, 8), L=1, S=3000, E=128, mask="bool_keys"),
    Case(batch=(1,), heads=(4, 1), L=3, S=6000, E=80, mask="causal", layout="kv_cache"),
    Case(batch=(1,), heads=(2, 2), L=8, S=2500, E=96, mask="additive_LS", dtype="float16"),
    Case(batch=(), heads=(6, 3), L=2, S=4500, E=5, mask="bool_full", layout="transposed"),
    Case(batch=(1,), heads=(28, 4), L=5, S=3333, E=256, mask="causal", layout="e_strided"),
    Case(batch=(1,), heads=(1, 1), L=40, S=8192, E=16, mask="causal"),
]


@pytest.mark.parametrize("case", DECODE, ids=str)
def test_decode_matches_reference(case):
    q, k, v, mask = make_inputs(case)
    out = flash_attention(q, k, v, mask=mask)
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= TOLERANCE[case.dtype]


def test_split_with_every_key_of_one_split_hidden():
    # A boolean mask that hides the whole first half of the keys: the splits
    # over those keys contribute nothing and must not disturb the merge.
    case = Case(batch=(1,), heads=(4, 2), L=1, S=8192, E=32)
    q, k, v, _ = make_inputs(case)
    keep = np.zeros((1, 8192), dtype=bool)
    keep[:, 5000:] = True
    mask = mx.array(keep)
    out = flash_attention(q, k, v, mask=mask)
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= 2e-5


def test_decode_row_that_sees_nothing_is_zero():
    case = Case(batch=(1,), heads=(4, 2), L=1, S=6000, E=32)
    q, k, v, _ = make_inputs(case)
    mask = mx.zeros((1, 6000), dtype=mx.bool_)
    out = np.array(flash_attention(q, k, v, mask=mask))
    assert np.all(out == 0)


# The CPU decode kernel (csrc/cpu/isa/decode.h, on AVX-512 machines) takes
# every plan of at most 8 query rows per KV head with no array mask: each row
# count 1-8, head dims that are multiples of 8 (one of 8 falls back), keys
# that split across threads or not, causal masks whose last tile hides keys
# from some rows, and layouts whose key rows are not adjacent.
DECODE_KERNEL = [
    Case(batch=(1,), heads=(1, 1), L=1, S=70, E=8),
    Case(batch=(2,), heads=(2, 1), L=1, S=4099, E=64, dtype="float16"),
    Case(batch=(1,), heads=(3, 1), L=1, S=2100, E=136, layout="kv_cache"),
    Case(batch=(1,), heads=(4, 2), L=1, S=65, E=256, dtype="bfloat16", layout="transposed"),
    Case(batch=(1,), heads=(5, 1), L=1, S=9000, E=80, mask="causal"),
    Case(batch=(1,), heads=(6, 1), L=1, S=3, E=96),
    Case(batch=(1,), heads=(7, 1), L=1, S=131, E=120, dtype="bfloat16"),
    Case(batch=(1,), heads=(8, 1), L=1, S=5000, E=128, layout="transposed"),
    Case(batch=(1,), heads=(2, 2), L=4, S=4100, E=64, mask="causal"),
    Case(batch=(1,), heads=(4, 2), L=2, S=70, E=32, mask="causal", dtype="float16"),
    Case(batch=(1,), heads=(1, 1), L=8, S=8, E=64, mask="causal", layout="kv_cache"),
    Case(batch=(3,), heads=(1, 1), L=7, S=200, E=48, mask="causal", dtype="bfloat16"),
    Case(batch=(1,), heads=(2, 1), L=3, S=2, E=16, mask="causal"),  # rows that see nothing
]


@pytest.mark.parametrize("case", DECODE_KERNEL, ids=str)
def test_decode_kernel_matches_reference(case):
    q, k, v, mask = make_inputs(case)
    out = flash_attention(q, k, v, mask=mask)
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= TOLERANCE[case.dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_kernel_hidden_nonfinite_values_stay_hidden(dtype):
    # Causal L = 4 against S = 100: the last 3 keys are hidden from the first
    # row, and their values are NaN / Inf; no row may see them.
    case = Case(batch=(1,), heads=(2, 1), L=4, S=100, E=64, mask="causal", dtype=dtype)
    q, k, v, _ = make_inputs(case)
    v_np = np.array(v.astype(mx.float32))
    v_np[..., 97, :] = np.nan
    v_np[..., 98, :] = np.inf
    v_np[..., 99, :] = -np.inf
    v = mx.array(v_np).astype(v.dtype)
    out = np.array(flash_attention(q, k, v, mask="causal").astype(mx.float32))
    ref = attention_reference(q, k, v, mask="causal")
    # Row l sees keys <= l + 96: row 0 sees no bad key, row 1 sees the NaN.
    assert np.all(np.isfinite(out[..., 0, :]))
    assert np.all(np.isnan(out[..., 1, :]))
    np.testing.assert_allclose(out[..., 0, :], ref[..., 0, :], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_decode_kernel_every_row_count_and_head_dim():
    # Each (rows, head dim) pair is its own instantiation of the kernel's
    # register blocking: all 8 x 32 of them, on two key tiles (70 keys).
    failures = []
    for E in range(8, 257, 8):
        for rows in range(1, 9):
            case = Case(batch=(1,), heads=(rows, 1), L=1, S=70, E=E)
            q, k, v, _ = make_inputs(case, seed=E * 10 + rows)
            err = relative_error(flash_attention(q, k, v), attention_reference(q, k, v))
            if not err <= TOLERANCE["float32"]:
                failures.append((rows, E, err))
    assert not failures, failures
