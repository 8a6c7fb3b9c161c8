"""Tiny random-weight Qwen2 and Llama models through mlx-lm with the patch
off and on: same logits, same greedy text, through every cache mlx-lm has."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import batch_generate, generate, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import logits, tiny_model, wrapped_tokenizer

import mlxlm_flash_patch

TOKENS = mx.array([[5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 1, 300, 77, 8, 200, 31, 45]])


def rel(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture(scope="module")
def tokenizer():
    return wrapped_tokenizer()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-4), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("precision", ["float32", "native"])
def test_logits_agree(family, dtype, tol, precision):
    model, _ = tiny_model(family, dtype)
    off = logits(model, TOKENS)
    with mlxlm_flash_patch.patched(precision):
        on = logits(model, TOKENS)
    assert on.dtype == off.dtype == dtype
    assert rel(on, off) <= tol
    s = mlxlm_flash_patch.stats()
    assert s["flash_calls"] == 2 and not s["fallbacks"]  # two layers, one call each


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_generation_is_identical(family, tokenizer):
    model, _ = tiny_model(family, vocab_size=len(tokenizer))
    prompt = "The function returns"
    off = generate(model, tokenizer, prompt, max_tokens=32)
    off_stream = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=32))
    with mlxlm_flash_patch.patched():
        on = generate(model, tokenizer, prompt, max_tokens=32)
        on_stream = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=32))
    assert on == off and on_stream == off_stream and len(off) > 0
    assert mlxlm_flash_patch.stats()["flash_calls"] > 0


def test_rotating_cache_that_wraps(tokenizer):
    # max_kv_size 24 < prompt + 40 new tokens: the window wraps, masks are arrays.
    model, _ = tiny_model("qwen2", vocab_size=len(tokenizer))
    prompt = "Lambda expressions and the assignment statement"
    off = generate(model, tokenizer, prompt, max_tokens=40, max_kv_size=24)
    with mlxlm_flash_patch.patched():
        on = generate(model, tokenizer, prompt, max_tokens=40, max_kv_size=24)
    assert on == off
    s = mlxlm_flash_patch.stats()
    assert s["flash_calls"] > 0 and not s["fallbacks"]


def test_prompt_cache_reused_across_turns(tokenizer):
    model, _ = tiny_model("llama", vocab_size=len(tokenizer))
    texts = {}
    for state in ("off", "on"):
        with mlxlm_flash_patch.patched() if state == "on" else _nothing():
            cache = make_prompt_cache(model)
            first = generate(model, tokenizer, "Class definitions", max_tokens=12, prompt_cache=cache)
            second = generate(model, tokenizer, " and then", max_tokens=12, prompt_cache=cache)
            texts[state] = (first, second)
    assert texts["on"] == texts["off"]


def test_batched_generation_with_padding(tokenizer):
    model, _ = tiny_model("qwen2", vocab_size=len(tokenizer))
    prompts = [tokenizer.encode(p) for p in ("A", "The with statement is used to wrap", "Yield")]
    off = batch_generate(model, tokenizer, prompts, max_tokens=16).texts
    with mlxlm_flash_patch.patched():
        on = batch_generate(model, tokenizer, prompts, max_tokens=16).texts
    assert on == off
    s = mlxlm_flash_patch.stats()
    assert s["flash_calls"] > 0 and not s["fallbacks"]


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 32), (4, 64)])
@pytest.mark.parametrize("precision", ["float32", "native"])
def test_quantized_kv_cache_goes_through_flash_attention(tokenizer, bits, group_size, precision):
    # mlx-lm's QuantizedKVCache hands over (packed, scales, biases): read in
    # place, the same greedy text as mlx-lm's own quantized attention. Both on
    # the CPU: mlx-lm's quantized attention has no CUDA kernel for these
    # shapes (tests/gpu checks the CUDA kernels on quantized caches).
    model, _ = tiny_model("qwen2", vocab_size=len(tokenizer), hidden_size=256)  # head dim 64
    prompt = "Exceptions are raised"
    kw = dict(max_tokens=16, kv_bits=bits, kv_group_size=group_size, quantized_kv_start=0, stream=mx.cpu)
    off = generate(model, tokenizer, prompt, **kw)
    with mlxlm_flash_patch.patched(precision):
        on = generate(model, tokenizer, prompt, **kw)
    assert on == off and len(off) > 0
    s = mlxlm_flash_patch.stats()
    assert s["flash_calls"] > 0 and not s["fallbacks"]


def test_a_quantized_call_the_kernel_refuses_falls_back_and_is_counted(monkeypatch):
    # A refusal (an unsupported bit width, say) names its reason; mlx-lm's own
    # quantized attention runs instead.
    from mlx_lm.models import base
    from mlx_lm.models.cache import QuantizedKVCache

    from flashattn_core import UnsupportedError
    from mlxlm_flash_patch import attention

    def refuse(*args, **kwargs):
        error = UnsupportedError("flash_attention: quantized keys of 6 bits: the kernels read 2, 4 and 8 bits")
        error.reason = "quantized_kv_cache"
        raise error

    cache = QuantizedKVCache(group_size=32, bits=4)
    k = mx.random.normal((1, 2, 5, 32))
    keys, values = cache.update_and_fetch(k, k + 1)
    q = mx.random.normal((1, 4, 5, 32))
    # On the CPU: mlx-lm's quantized attention has no CUDA kernel for this
    # shape. Copies: it scales its queries argument in place.
    with mx.stream(mx.cpu):
        expected = base.scaled_dot_product_attention(q + 0, keys, values, cache, scale=0.2, mask="causal")
        monkeypatch.setattr(attention, "flash_attention", refuse)
        with mlxlm_flash_patch.patched():
            out = base.scaled_dot_product_attention(q + 0, keys, values, cache, scale=0.2, mask="causal")
        assert mx.array_equal(out, expected)
    assert mlxlm_flash_patch.stats()["fallbacks"] == {"quantized_kv_cache": 1}


def test_attention_sinks_go_through_flash_attention():
    from mlx_lm.models import base

    q = mx.random.normal((1, 4, 3, 16))
    k = v = mx.random.normal((1, 2, 3, 16))
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    expected = base.scaled_dot_product_attention(q, k, v, None, scale=0.25, mask=None, sinks=sinks)
    with mlxlm_flash_patch.patched():
        out = base.scaled_dot_product_attention(q, k, v, None, scale=0.25, mask=None, sinks=sinks)
    assert rel(out, expected) <= 1e-5
    assert mlxlm_flash_patch.stats()["flash_calls"] == 1 and not mlxlm_flash_patch.stats()["fallbacks"]


def test_gpt_oss_sinks_and_sliding_windows(tokenizer):
    # Sinks on every layer; a sliding-window layer whose RotatingKVCache (8
    # keys) wraps during the 24 generated tokens.
    model, _ = tiny_model("gpt_oss", vocab_size=len(tokenizer))
    prompt = "Lambda expressions and the assignment statement"
    off_logits = logits(model, TOKENS)
    off = generate(model, tokenizer, prompt, max_tokens=24)
    with mlxlm_flash_patch.patched():
        on_logits = logits(model, TOKENS)
        on = generate(model, tokenizer, prompt, max_tokens=24)
    assert rel(on_logits, off_logits) <= 1e-4
    assert on == off and len(off) > 0
    s = mlxlm_flash_patch.stats()
    assert s["flash_calls"] > 0 and not s["fallbacks"]
    # The sliding layer's band masks (17 tokens, and the prompt's prefill,
    # past the 8-key window) went in as windows.
    assert s["windowed_calls"] >= 2


def test_head_dim_the_kernel_refuses_falls_back():
    from mlx_lm.models import base

    q = mx.random.normal((1, 2, 3, 320))
    k = v = mx.random.normal((1, 2, 3, 320))
    expected = base.scaled_dot_product_attention(q, k, v, None, scale=0.1, mask="causal")
    with mlxlm_flash_patch.patched():
        out = base.scaled_dot_product_attention(q, k, v, None, scale=0.1, mask="causal")
    assert mx.allclose(out, expected)
    assert mlxlm_flash_patch.stats()["fallbacks"] == {"unsupported_head_dim": 1}


def test_fallback_reason_comes_from_the_check_that_refused(monkeypatch):
    # The reason is the one the refusing check names, whatever its message says.
    from mlx_lm.models import base

    from flashattn_core import UnsupportedError
    from mlxlm_flash_patch import attention

    def refuse(*args, **kwargs):
        error = UnsupportedError("flash_attention: no words that name a reason")
        error.reason = "unsupported_mask"
        raise error

    monkeypatch.setattr(attention, "flash_attention", refuse)
    q = mx.random.normal((1, 2, 3, 16))
    k = v = mx.random.normal((1, 2, 3, 16))
    expected = base.scaled_dot_product_attention(q, k, v, None, scale=0.25, mask=None)
    with mlxlm_flash_patch.patched():
        out = base.scaled_dot_product_attention(q, k, v, None, scale=0.25, mask=None)
    assert mx.array_equal(out, expected)
    assert mlxlm_flash_patch.stats()["fallbacks"] == {"unsupported_mask": 1}


def test_float32_precision_casts_back_to_model_dtype():
    from mlx_lm.models import base

    q = mx.random.normal((1, 4, 5, 16)).astype(mx.bfloat16)
    k = v = mx.random.normal((1, 2, 5, 16)).astype(mx.bfloat16)
    with mlxlm_flash_patch.patched():
        out = base.scaled_dot_product_attention(q, k, v, None, scale=0.25, mask="causal")
    assert out.dtype == mx.bfloat16


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
