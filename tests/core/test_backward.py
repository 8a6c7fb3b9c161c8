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


@pytest.mark.parametrize("batch,heads", [(1, (2, 1)), (2, (4, 2))], ids=["two passes", "a group an item"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_values_a_row_cannot_see_never_reach_a_gradient(device, batch, heads, dtype):
    # Keys and values hidden from every row hold NaN and an infinity, a row
    # that sees nothing an infinite query: a zero weight must not meet them
    # in any product (0 x inf is NaN). With one KV head the CPU runs its key
    # and query passes, with four a work item a group.
    L, S = 90, 140
    case = Case(batch=(batch,), heads=heads, L=L, S=S, E=64, dtype=dtype)
    q, k, v = (np.array(x.astype(mx.float32)) for x in make_inputs(case)[:3])
    visible = np.ones((L, S), dtype=bool)
    visible[:, 10] = False  # key 10 hidden from every row
    visible[8] = False  # a row that sees nothing
    visible[40:, 100] = False  # key 100 seen by some rows only
    kz, vz, qz = k.copy(), v.copy(), q.copy()
    k[..., 10, 3], v[..., 10, 5], q[..., 8, 7] = np.nan, np.inf, np.inf
    kz[..., 10, :], vz[..., 10, :], qz[..., 8, :] = 0, 0, 0
    as_dtype = lambda x: mx.array(x).astype(getattr(mx, dtype))
    mask = mx.array(visible)
    d_out = d_out_for(case, as_dtype(q))
    grads = vjp(as_dtype(q), as_dtype(k), as_dtype(v), mask, d_out)
    refs = attention_gradients_reference(as_dtype(qz), as_dtype(kz), as_dtype(vz), d_out, mask=mask)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert np.isfinite(np.array(g.astype(mx.float32))).all(), name
        assert relative_error(g, ref) <= TOLERANCE[dtype], name


def test_an_infinite_query_reaches_only_the_keys_its_row_sees(device):
    # Causal: row 20's query holds an infinity (its scores are infinite,
    # its statistics not finite); the keys after 20, which it cannot see,
    # keep the gradients float64 gives them with that value zeroed. (What
    # the keys it sees get is not pinned: NaN, or finite where a score is
    # -inf.)
    case = Case(batch=(1,), heads=(2, 1), L=40, S=40, E=16, mask="causal")
    q, k, v = (np.array(x) for x in make_inputs(case)[:3])
    qz = q.copy()
    q[0, 1, 20, 3], qz[0, 1, 20, 3] = np.inf, 0.0
    d_out = d_out_for(case, mx.array(q))
    _, dk, dv = vjp(mx.array(q), mx.array(k), mx.array(v), "causal", d_out)
    _, dk_ref, dv_ref = attention_gradients_reference(mx.array(qz), mx.array(k), mx.array(v), d_out, mask="causal")
    for name, g, ref in (("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        got = np.array(g)
        assert np.isfinite(got[0, 0, 21:]).all(), name
        assert relative_error(got[0, 0, 21:], ref[0, 0, 21:]) <= TOLERANCE["float32"], name


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
