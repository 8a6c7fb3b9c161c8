"""CUDA-only checks (the whole CPU suite also runs on the GPU there, since
the CUDA build of MLX makes the GPU the default device): long sequences,
every kernel variant, strided and broadcast inputs, decode splits."""


import mlx.core as mx
import numpy as np
import pytest
from attention_cases import TOLERANCE, Case, make_inputs

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, causal_mask, relative_error

pytestmark = pytest.mark.skipif(
    not (mx.is_available(mx.gpu) and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend and an NVIDIA GPU",
)


def sampled_error(q, k, v, out, mask=None, rows=24):
    """Relative error on a few query rows (the full reference would not fit)."""
    L, S = q.shape[-2], k.shape[-2]
    idx = np.unique(np.linspace(0, L - 1, rows).astype(int))
    m = causal_mask(L, S)[idx] if mask == "causal" else None
    ref = attention_reference(q[..., mx.array(idx), :], k, v, mask=m)
    return relative_error(np.array(out.astype(mx.float32))[..., idx, :], ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_long_sequence_16k(dtype):
    case = Case(batch=(1,), heads=(14, 2), L=16384, S=16384, E=64, mask="causal", dtype=dtype)
    q, k, v, mask = make_inputs(case)
    out = flash_attention(q, k, v, mask=mask)
    assert not mx.isnan(out).any().item()
    assert sampled_error(q, k, v, out, mask) <= TOLERANCE[dtype]


@pytest.mark.parametrize("E", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["causal", "none", "bool_LS", "additive_full"])
def test_every_prefill_kernel(E, dtype, mask):
    case = Case(batch=(2,), heads=(8, 2), L=300, S=333, E=E, mask=mask, dtype=dtype, layout="kv_cache")
    q, k, v, m = make_inputs(case)
    out = flash_attention(q, k, v, mask=m)
    assert relative_error(out, attention_reference(q, k, v, mask=m)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("S", [513, 4096, 32768])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_splits(S, dtype):
    case = Case(batch=(2,), heads=(14, 2), L=1, S=S, E=64, dtype=dtype, layout="kv_cache")
    q, k, v, _ = make_inputs(case)
    out = flash_attention(q, k, v)
    assert relative_error(out, attention_reference(q, k, v)) <= TOLERANCE[dtype]


def test_broadcast_padding_mask_batched():
    case = Case(batch=(3,), heads=(4, 2), L=40, S=70, E=64, dtype="bfloat16")
    q, k, v, _ = make_inputs(case)
    keep = np.ones((3, 1, 1, 70), dtype=bool)
    keep[0, ..., :10] = False
    keep[2, ..., 50:] = False
    mask = mx.array(keep)
    out = flash_attention(q, k, v, mask=mask)
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= TOLERANCE["bfloat16"]


def test_cpu_and_gpu_agree():
    case = Case(batch=(1,), heads=(14, 2), L=257, S=300, E=64, mask="causal")
    q, k, v, mask = make_inputs(case)
    gpu = flash_attention(q, k, v, mask=mask, stream=mx.gpu)
    cpu = flash_attention(q, k, v, mask=mask, stream=mx.cpu)
    assert relative_error(gpu, np.array(cpu)) <= 2e-5


def test_patch_routes_through_the_gpu_kernels():
    import mlxlm_flash_patch
    from mlx_lm.models import base

    q = mx.random.normal((1, 14, 40, 64)).astype(mx.bfloat16)
    k = v = mx.random.normal((1, 2, 40, 64)).astype(mx.bfloat16)
    mlxlm_flash_patch.reset_stats()
    with mlxlm_flash_patch.patched():
        out = base.scaled_dot_product_attention(q, k, v, None, scale=0.125, mask="causal")
    assert mlxlm_flash_patch.stats() == {"flash_calls": 1, "fallbacks": {}}
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert relative_error(out, np.array(ref.astype(mx.float32))) <= 2e-2
