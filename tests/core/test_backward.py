"""The fused backward (FlashAttention-2 Algorithm 2) on the CPU and, where
MLX's CUDA backend has a GPU, on CUDA: gradients of queries, keys and values
against a float64 reference over the forward's covering matrix and against
MLX's VJP of its own SDPA; its memory stays O(L)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import MATRIX, TOLERANCE, Case, make_inputs

from flashattn_core import flash_attention, gradient_stats, reset_gradient_stats
from flashattn_core.reference import attention_gradients_reference, relative_error

HAS_CUDA = mx.is_available(mx.gpu) and mx.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU"))])
def device(request):
    """The backend whose fused backward runs: each test below runs on both."""
    with mx.stream(mx.cpu if request.param == "cpu" else mx.gpu):
        yield request.param


@pytest.fixture
def on_the_cpu():
    """The CPU's own backward, whatever the default device."""
    with mx.stream(mx.cpu):
        yield


def vjp(q, k, v, mask, d_out, scale=None):
    f = lambda q, k, v: flash_attention(q, k, v, scale=scale, mask=mask)
    _, grads = mx.vjp(f, [q, k, v], [d_out])
    return grads


def d_out_for(case, q, seed=5):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(q.shape)).astype(q.dtype)


def gradient_error(g, ref, size):
    """||g - ref|| relative to the larger of ||ref|| and the size of the terms
    summed before dP - D cancels (attention_gradients_reference)."""
    diff = np.linalg.norm(np.array(g.astype(mx.float32), dtype=np.float64) - ref)
    return diff / max(np.linalg.norm(ref), size, 1e-30)


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_matches_float64_reference(device, case):
    q, k, v, mask = make_inputs(case, seed=2)
    d_out = d_out_for(case, q)
    grads = vjp(q, k, v, mask, d_out)
    refs, sizes = attention_gradients_reference(q, k, v, d_out, mask=mask, sizes=True)
    for name, g, x, ref, size in zip(("dq", "dk", "dv"), grads, (q, k, v), refs, sizes):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert not np.isnan(np.array(g.astype(mx.float32))).any(), name
        assert gradient_error(g, ref, size) <= TOLERANCE[case.dtype], name


SDPA_CASES = [
    Case(batch=(2,), heads=(14, 2), L=130, S=130, E=64, mask="causal"),
    Case(batch=(1,), heads=(8, 8), L=64, S=200, E=128, mask="causal", layout="kv_cache"),
    Case(batch=(1,), heads=(6, 3), L=77, S=77, E=80, mask="additive_LS"),
    Case(batch=(1,), heads=(4, 1), L=1, S=513, E=96),
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=str)
def test_matches_mlx_sdpa_vjp(device, case):
    q, k, v, mask = make_inputs(case, seed=3)
    d_out = d_out_for(case, q)
    scale = 1 / math.sqrt(case.E)
    ref_f = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    _, refs = mx.vjp(ref_f, [q, k, v], [d_out])
    for name, g, ref in zip(("dq", "dk", "dv"), vjp(q, k, v, mask, d_out, scale), refs):
        assert relative_error(g, np.array(ref, dtype=np.float64)) <= 2e-5, name


def test_value_and_grad_under_compile(device):
    case = Case(batch=(1,), heads=(4, 2), L=70, S=70, E=32, mask="causal")
    q, k, v, _ = make_inputs(case)
    loss = lambda q, k, v: flash_attention(q, k, v, mask="causal").square().sum()
    step = mx.compile(mx.value_and_grad(loss, argnums=(0, 1, 2)))
    value, grads = step(q, k, v)
    d_out = 2 * flash_attention(q, k, v, mask="causal")
    refs = attention_gradients_reference(q, k, v, d_out, mask="causal")
    assert value.item() == pytest.approx(float(np.sum(np.array(d_out) ** 2) / 4), rel=1e-5)
    for g, ref in zip(grads, refs):
        assert relative_error(g, ref) <= 2e-5


def test_rows_and_keys_nobody_sees_get_zero_gradients(device):
    # L > S causal: the first L - S rows see no key.
    case = Case(batch=(1,), heads=(2, 1), L=40, S=24, E=16, mask="causal")
    q, k, v, _ = make_inputs(case)
    dq, dk, dv = vjp(q, k, v, "causal", d_out_for(case, q))
    assert np.all(np.array(dq)[..., :16, :] == 0)
    assert not np.isnan(np.array(dq)).any() and np.abs(np.array(dk)).sum() > 0


def test_gradient_memory_is_linear_in_sequence_length(device):
    # One L x S float32 score matrix of a head here is 1 GiB; inputs,
    # outputs and gradients together are ~6 MiB.
    L = 16384
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, 1, L, 16)).astype(np.float32)) for _ in range(3))
    mx.eval(q, k, v)
    grad = mx.grad(lambda q, k, v: flash_attention(q, k, v, mask="causal").sum(), argnums=(0, 1, 2))
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    grads = grad(q, k, v)
    mx.eval(grads)
    extra = mx.get_peak_memory() - before
    assert extra < 16 * 2**20, f"{extra / 2**20:.1f} MiB"
    assert all(not np.isnan(np.array(g)).any() for g in grads)


def test_gradient_stats_say_which_backward_ran(on_the_cpu):
    case = Case(batch=(1,), heads=(4, 2), L=16, S=24, E=16)
    q, k, v, _ = make_inputs(case)
    bias = mx.zeros((16, 24))
    reset_gradient_stats()
    mx.eval(mx.grad(lambda q: flash_attention(q, k, v, mask="causal").sum())(q))
    assert gradient_stats() == {"fused": 1, "recomputed": {}}
    # An additive mask's gradient is dS itself (L x S): recomputed, counted.
    mx.eval(mx.grad(lambda b: flash_attention(q, k, v, mask=b).sum())(bias))
    assert gradient_stats() == {"fused": 1, "recomputed": {"mask_gradient": 1}}
    reset_gradient_stats()
    assert gradient_stats() == {"fused": 0, "recomputed": {}}
