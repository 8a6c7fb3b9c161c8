"""Attention sinks (`sinks=`, one logit per query head in every row's softmax
denominator, as MLX's SDPA takes them) on the CPU: the forward against a
float64 reference over the covering matrix (on a GPU too, where there is one), gradients (queries, keys,
values and the sinks themselves) against MLX's VJP of its own SDPA, through
the fused backward; bad sinks refused."""

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import MATRIX, TOLERANCE, Case, make_inputs

from flashattn_core import UnsupportedError, flash_attention, gradient_stats, reset_gradient_stats
from flashattn_core.reference import attention_reference, relative_error


def sinks_for(case, seed=7, dtype=None):
    # Around the scores' own size, so that the sink takes a real share of each row.
    s = np.random.default_rng(seed).normal(0.5, 1.5, case.heads[0]).astype(np.float32)
    return mx.array(s).astype(dtype or mx.float32)


@pytest.fixture(autouse=True)
def on_the_cpu():
    with mx.stream(mx.cpu):
        yield


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_matches_float64_reference(case):
    q, k, v, mask = make_inputs(case)
    sinks = sinks_for(case)
    out = flash_attention(q, k, v, mask=mask, sinks=sinks)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_reference(q, k, v, mask=mask, sinks=sinks)
    assert relative_error(out, ref) <= TOLERANCE[case.dtype]


@pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs a GPU (MLX's CUDA or Metal backend)")
@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_matches_float64_reference_on_the_gpu(case):
    # The GPU kernels' forward over the same matrix (the GPU suite runs it).
    q, k, v, mask = make_inputs(case)
    sinks = sinks_for(case)
    out = flash_attention(q, k, v, mask=mask, sinks=sinks, stream=mx.gpu)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_reference(q, k, v, mask=mask, sinks=sinks)
    assert relative_error(out, ref) <= TOLERANCE[case.dtype]


CASES = [
    Case(batch=(2,), heads=(14, 2), L=130, S=130, E=64, mask="causal"),
    Case(batch=(1,), heads=(4, 4), L=1, S=300, E=64),  # decode
    Case(batch=(1,), heads=(6, 3), L=33, S=70, E=80, mask="bool_LS"),
    Case(batch=(1,), heads=(8, 2), L=40, S=24, E=32, mask="causal"),  # rows that see no key
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_gradients_match_mlx_sdpa(case):
    q, k, v, mask = make_inputs(case)
    sinks = sinks_for(case)
    d_out = mx.array(np.random.default_rng(5).standard_normal(q.shape).astype(np.float32))

    def loss(attention):
        return lambda q, k, v, s: (attention(q, k, v, s) * d_out).sum()

    ours = lambda q, k, v, s: flash_attention(q, k, v, mask=mask, sinks=s)
    mlx = lambda q, k, v, s: mx.fast.scaled_dot_product_attention(q, k, v, scale=case.E**-0.5, mask=mask, sinks=s)
    assert relative_error(ours(q, k, v, sinks), np.array(mlx(q, k, v, sinks), dtype=np.float64)) <= 1e-5
    reset_gradient_stats()
    got = mx.grad(loss(ours), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    want = mx.grad(loss(mlx), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert g.shape == w.shape, name
        assert relative_error(g, np.array(w, dtype=np.float64)) <= 2e-5, name
    assert gradient_stats() == {"fused": 1, "recomputed": {}}


def test_rows_that_see_no_key_and_no_keys_at_all_are_zero():
    case = Case(batch=(1,), heads=(2, 1), L=40, S=24, E=16, mask="causal")
    q, k, v, _ = make_inputs(case)
    out = np.array(flash_attention(q, k, v, mask="causal", sinks=sinks_for(case)))
    assert np.all(out[..., :16, :] == 0) and not np.isnan(out).any()
    empty = flash_attention(q, k[..., :0, :], v[..., :0, :], sinks=sinks_for(case))
    assert empty.shape == q.shape and np.all(np.array(empty) == 0)


def test_a_very_large_sink_takes_the_whole_row():
    case = Case(batch=(1,), heads=(2, 2), L=8, S=8, E=16)
    q, k, v, _ = make_inputs(case)
    out = flash_attention(q, k, v, sinks=mx.array([200.0, -200.0]))
    base = flash_attention(q, k, v)
    assert np.abs(np.array(out[:, 0])).max() < 1e-30
    assert np.allclose(np.array(out[:, 1]), np.array(base[:, 1]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_inputs_and_float32_attention(name):
    dtype = getattr(mx, name)
    case = Case(batch=(1,), heads=(4, 2), L=50, S=50, E=64, mask="causal")
    q, k, v = (x.astype(dtype) for x in make_inputs(case)[:3])
    sinks = sinks_for(case, dtype=dtype)
    ref = attention_reference(q, k, v, mask="causal", sinks=sinks)
    native = flash_attention(q, k, v, mask="causal", sinks=sinks)
    wide = flash_attention(q, k, v, mask="causal", sinks=sinks, dtype=mx.float32)
    assert native.dtype == dtype and wide.dtype == mx.float32
    assert relative_error(native, ref) <= TOLERANCE[name]
    assert relative_error(wide, ref) <= 2e-5


@pytest.mark.parametrize(
    "sinks, message",
    [
        (mx.zeros((3,)), r"sinks must have shape \(H_q,\) = \(4,\), one logit per query head; got \(3,\)"),
        (mx.zeros((4, 1)), r"sinks must have shape \(H_q,\) = \(4,\).*got \(4, 1\)"),
        (mx.zeros((4,), dtype=mx.int32), "sinks must be float32, float16 or bfloat16; got int32"),
    ],
)
def test_bad_sinks_are_refused(sinks, message):
    q = mx.zeros((1, 4, 8, 16))
    k = mx.zeros((1, 2, 8, 16))
    with pytest.raises(UnsupportedError, match=message) as info:
        flash_attention(q, k, k, sinks=sinks)
    assert info.value.reason == "unsupported_input"
