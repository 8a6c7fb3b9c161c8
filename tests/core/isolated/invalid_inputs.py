"""Random invalid (and valid) arguments: flash_attention either returns an
array that evaluates, or raises ValueError / TypeError; nothing else. Run in
its own interpreter by test_isolated.py, so a crash fails that test instead
of killing the test run."""

import math

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashattn_core import flash_attention

DTYPES = [mx.float32, mx.float16, mx.bfloat16, mx.float64, mx.int32, mx.int8, mx.uint16, mx.bool_, mx.complex64]

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=6).map(tuple)
dtypes = st.sampled_from(DTYPES)


@st.composite
def arrays(draw):
    shape = draw(shapes)
    dtype = draw(dtypes)
    # Made on the CPU: a GPU cannot hold every dtype drawn here (float64).
    return mx.add(mx.zeros(shape, dtype=dtype, stream=mx.cpu), 1 if dtype != mx.bool_ else True, stream=mx.cpu)


masks = st.one_of(
    st.none(),
    st.sampled_from(["causal", "upper", "", "CAUSAL"]),
    arrays(),
    st.integers(-3, 3),
    st.lists(st.booleans(), max_size=3),
)
scales = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.text(max_size=3))
streams = st.sampled_from([None, mx.cpu, mx.gpu, "cpu", 3])
# Keys or values: an array, or a triple as quantized ones come (packed, scales, biases).
keys_values = st.one_of(arrays(), st.tuples(arrays(), arrays(), arrays()))
groups = st.sampled_from([None, 0, 32, 64, 7])
windows = st.one_of(st.none(), st.integers(-3, 50), st.sampled_from([2**40, 1.5, "4"]))


@settings(max_examples=400, deadline=None)
@given(q=arrays(), k=keys_values, v=keys_values, mask=masks, scale=scales, stream=streams, window=windows,
       group_size=groups, bits=st.sampled_from([None, 4, 8, 3]))
def test_random_arguments(q, k, v, mask, scale, stream, window, group_size, bits):
    try:
        out = flash_attention(q, k, v, mask=mask, scale=scale, stream=stream, window=window, group_size=group_size,
                              bits=bits)
    except (ValueError, TypeError):
        return
    mx.eval(out)
    assert out.shape == q.shape and out.dtype == q.dtype


@settings(max_examples=200, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    heads=st.sampled_from([(1, 1), (4, 2), (3, 3), (6, 2)]),
    L=st.integers(0, 40), S=st.integers(0, 40), E=st.integers(1, 48),
    mask_dims=st.integers(0, 4),
)
def test_near_valid_shapes(lead, heads, L, S, E, mask_dims):
    q = mx.ones((*lead, heads[0], L, E))
    kv = mx.ones((*lead, heads[1], S, E))
    mask = mx.ones((L, S)[-mask_dims:] if mask_dims <= 2 else (1,) * (mask_dims - 2) + (L, S), dtype=mx.bool_)
    if mask.ndim > q.ndim:
        with pytest.raises(ValueError, match="does not broadcast"):
            flash_attention(q, kv, kv, mask=mask)
        return
    out = flash_attention(q, kv, kv, mask=mask if mask_dims else "causal", scale=1 / math.sqrt(E))
    mx.eval(out)
    assert out.shape == q.shape
