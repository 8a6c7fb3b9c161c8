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
