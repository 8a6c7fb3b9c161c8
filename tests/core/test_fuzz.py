"""Random shapes, masks, dtypes and layouts against the float64 reference:
the attention and its gradients."""

from attention_cases import LAYOUTS, MASKS, TOLERANCE, Case, make_inputs
from hypothesis import given
from hypothesis import strategies as st

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, relative_error


@st.composite
def cases(draw):
    H_kv = draw(st.integers(1, 3))
    return Case(
        batch=tuple(draw(st.lists(st.integers(1, 3), max_size=2))),
        heads=(H_kv * draw(st.integers(1, 4)), H_kv),
        L=draw(st.integers(1, 80)),
        S=draw(st.integers(1, 80)),
        E=draw(st.integers(1, 72)),
        mask=draw(st.sampled_from(MASKS)),
        dtype=draw(st.sampled_from(list(TOLERANCE))),
        layout=draw(st.sampled_from(LAYOUTS)),
    )


@given(case=cases(), seed=st.integers(0, 2**31 - 1))
def test_random_cases_match_reference(case, seed):
    q, k, v, mask = make_inputs(case, seed=seed)
    out = flash_attention(q, k, v, mask=mask)
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= TOLERANCE[case.dtype]


@given(case=cases(), seed=st.integers(0, 2**31 - 1))
def test_random_cases_gradients_match_reference(case, seed):
    import mlx.core as mx
    import numpy as np

    from flashattn_core.reference import attention_gradients_reference

    q, k, v, mask = make_inputs(case, seed=seed)
    d_out = mx.array(np.random.default_rng(seed).standard_normal(q.shape)).astype(q.dtype)
    _, grads = mx.vjp(lambda q, k, v: flash_attention(q, k, v, mask=mask), [q, k, v], [d_out])
    refs, sizes = attention_gradients_reference(q, k, v, d_out, mask=mask, sizes=True)
    for g, ref, size in zip(grads, refs, sizes):
        diff = np.linalg.norm(np.array(g.astype(mx.float32), dtype=np.float64) - ref)
        assert diff <= TOLERANCE[case.dtype] * max(np.linalg.norm(ref), size, 1e-30)
