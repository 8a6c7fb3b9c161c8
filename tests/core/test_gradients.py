"""mx.grad through flash_attention against MLX's own autodiff of the unfused
attention (scores, mask, softmax, weighted sum), and mx.compile around it."""

import math

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import Case, make_inputs

from flashattn_core import flash_attention


def unfused(q, k, v, scale, mask):
    """Plain MLX operations: the reference for gradients (MLX differentiates it)."""
    ratio = q.shape[-3] // k.shape[-3]
    k = mx.repeat(k, ratio, axis=-3)
    v = mx.repeat(v, ratio, axis=-3)
    s = (q @ mx.swapaxes(k, -1, -2)) * scale
    L, S = q.shape[-2], k.shape[-2]
    if isinstance(mask, str):
        visible = mx.arange(S)[None] <= mx.arange(L)[:, None] + (S - L)
        s = mx.where(visible, s, -mx.inf)
    elif mask is not None and mask.dtype == mx.bool_:
        s = mx.where(mask, s, -mx.inf)
    elif mask is not None:
        s = s + mask
    return mx.softmax(s, axis=-1) @ v


def rel(a, b):
    a, b = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (a, b))
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


CASES = [
    Case(batch=(2,), heads=(4, 2), L=33, S=33, E=16, mask="causal"),
    Case(batch=(1,), heads=(6, 3), L=20, S=45, E=32, mask="causal"),
    Case(batch=(), heads=(2, 1), L=17, S=9, E=8, mask="none"),
    Case(batch=(1,), heads=(4, 4), L=12, S=30, E=16, mask="bool_keys", layout="kv_cache"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_grad_of_queries_keys_values(case):
    q, k, v, mask = make_inputs(case)
    scale = 1 / math.sqrt(case.E)
    cot = mx.random.normal(q.shape, key=mx.random.key(7))

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * cot).sum()

    ours = mx.grad(loss(lambda q, k, v: flash_attention(q, k, v, scale=scale, mask=mask)), argnums=(0, 1, 2))(q, k, v)
    ref = mx.grad(loss(lambda q, k, v: unfused(q, k, v, scale, mask)), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel(a, b) <= 1e-4, name


def test_grad_of_an_additive_mask():
    case = Case(batch=(1,), heads=(4, 2), L=16, S=24, E=16)
    q, k, v, _ = make_inputs(case)
    bias = mx.random.normal((16, 24), key=mx.random.key(3))

    def loss(fn):
        return lambda b: fn(q, k, v, 0.25, b).sum()

    ours = mx.grad(loss(lambda q, k, v, s, b: flash_attention(q, k, v, scale=s, mask=b)))(bias)
    ref = mx.grad(loss(unfused))(bias)
    assert ours.shape == bias.shape
    assert rel(ours, ref) <= 1e-4


def test_value_and_grad_in_bfloat16():
    case = Case(batch=(1,), heads=(4, 2), L=32, S=32, E=32, mask="causal", dtype="bfloat16")
    q, k, v, mask = make_inputs(case)
    # A sum of squares: no cancellation to magnify bfloat16 rounding.
    f = lambda q: flash_attention(q, k, v, mask=mask).astype(mx.float32).square().sum()
    g = lambda q: unfused(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
                          1 / math.sqrt(32), mask).square().sum()
    (val, grad), (val_ref, grad_ref) = mx.value_and_grad(f)(q), mx.value_and_grad(g)(q)
    assert grad.dtype == mx.bfloat16
    assert abs(val.item() - val_ref.item()) <= 2e-2 * abs(val_ref.item()) + 1e-2
    assert rel(grad, grad_ref) <= 3e-2


def test_rows_without_visible_keys_have_zero_gradient():
    case = Case(batch=(1,), heads=(2, 1), L=8, S=8, E=8)
    q, k, v, _ = make_inputs(case)
    visible = np.ones((8, 8), dtype=bool)
    visible[2] = False
    mask = mx.array(visible)
    dq = mx.grad(lambda q: flash_attention(q, k, v, mask=mask).sum())(q)
    assert np.all(np.array(dq)[..., 2, :] == 0) and not np.isnan(np.array(dq)).any()


def test_compile():
    case = Case(batch=(1,), heads=(4, 2), L=40, S=40, E=16, mask="causal")
    q, k, v, mask = make_inputs(case)

    def f(q, k, v):
        return flash_attention(q * 2, k, v, mask="causal") + 1

    compiled = mx.compile(f)
    expected = f(q, k, v)
    for _ in range(3):
        assert mx.allclose(compiled(q, k, v), expected, atol=1e-6)
    grads = mx.compile(mx.grad(lambda q: f(q, k, v).sum()))(q)
    assert rel(grads, mx.grad(lambda q: f(q, k, v).sum())(q)) <= 1e-6
