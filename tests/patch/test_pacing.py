"""Pacing of a quantized-cache prefill (mlxlm_flash_patch/pacing.py): which
calls are scheduled early, how many stay queued, and that the text is the
same. The memory it saves is measured on a GPU (`scripts/cuda-check kv`)."""

import mlx.core as mx
import pytest
from mlx_lm import generate
from tiny_models import tiny_model, wrapped_tokenizer

import mlxlm_flash_patch
from mlxlm_flash_patch import pacing

PROMPT = "Exceptions are raised when a function is called with arguments of the wrong type. " * 6
# As token ids: how many the text makes depends on the tokenizers release.
PROMPT_TOKENS = [5 + (7 * i) % 300 for i in range(258)]
KW = dict(max_tokens=12, kv_bits=4, kv_group_size=32, quantized_kv_start=0)


@pytest.fixture(scope="module")
def tokenizer():
    return wrapped_tokenizer()


@pytest.fixture
def scheduled(monkeypatch):
    """The arrays pacing schedules, and the longest queue it kept. Pacing is
    on regardless of the backend (it runs on CUDA alone otherwise)."""
    record = {"shapes": [], "longest": 0}
    async_eval = mx.async_eval

    def spy(*arrays):
        async_eval(*arrays)  # raises under a transformation: nothing recorded
        record["shapes"] += [a.shape for a in arrays]
        queued = getattr(pacing._local, "queued", ())
        record["longest"] = max(record["longest"], len(queued) + 1)

    monkeypatch.setattr(pacing, "enabled", lambda: True)
    monkeypatch.setattr(pacing.mx, "async_eval", spy)
    monkeypatch.setattr(pacing, "_local", type(pacing._local)())
    return record


def test_a_quantized_prefill_is_paced_with_the_same_text(tokenizer, scheduled, monkeypatch):
    model, _ = tiny_model("qwen2", vocab_size=len(tokenizer), hidden_size=256)  # head dim 64, 2 layers
    prompt_tokens = len(PROMPT_TOKENS)
    # The same patched run unpaced is the reference (mlx-lm's own quantized
    # attention has no CUDA kernel for these shapes; the CPU tests compare
    # with it in test_patch_models.py).
    with mlxlm_flash_patch.patched():
        with monkeypatch.context() as m:
            m.setattr(pacing, "enabled", lambda: False)
            unpaced = generate(model, tokenizer, PROMPT_TOKENS, prefill_step_size=128, **KW)
        assert not [s for s in scheduled["shapes"] if len(s) == 4]
        on = generate(model, tokenizer, PROMPT_TOKENS, prefill_step_size=128, **KW)
    assert on == unpaced and len(on) > 0
    assert not mlxlm_flash_patch.stats()["fallbacks"]
    paced = [s for s in scheduled["shapes"] if len(s) == 4]
    # Both layers' calls of the prefill steps of 128 rows after the first
    # (mlx-lm quantizes the cache once a step has filled it); no decode call.
    assert paced == [(1, 4, 128, 64)] * 2 * ((prompt_tokens - 1) // 128 - 1)
    assert 0 < scheduled["longest"] <= pacing.DEPTH + 1
    # The decode calls after it emptied the queue.
    assert not pacing._local.queued


def test_calls_without_a_quantized_cache_are_not_paced(tokenizer, scheduled):
    model, _ = tiny_model("qwen2", vocab_size=len(tokenizer), hidden_size=256)
    with mlxlm_flash_patch.patched():
        generate(model, tokenizer, PROMPT, max_tokens=4)
    assert not [s for s in scheduled["shapes"] if len(s) == 4]


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_switched_off_by_the_environment(monkeypatch, value):
    monkeypatch.setenv(pacing.ENV, value)
    assert not pacing.enabled()


def test_a_paced_call_under_compile_runs_unpaced(scheduled):
    # mx.compile (and grad, vmap) refuse async_eval: the call is left to MLX.
    from mlx_lm.models import base
    from mlx_lm.models.cache import QuantizedKVCache

    cache = QuantizedKVCache(group_size=32, bits=4)
    k = mx.random.normal((1, 2, 96, 64))
    keys, values = cache.update_and_fetch(k, k * 0.5)
    q = mx.random.normal((1, 4, 96, 64))
    # The reference: MLX's SDPA on the exact dequantization (mlx-lm's own
    # quantized attention has no CUDA kernel for these shapes).
    kd, vd = (mx.dequantize(*t, group_size=32, bits=4) for t in (keys, values))
    expected = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125, mask="causal")
    with mlxlm_flash_patch.patched():
        attend = lambda q: base.scaled_dot_product_attention(q, keys, values, cache, scale=0.125, mask="causal")
        out = mx.compile(attend)(q)
        eager = attend(q)
    assert mx.allclose(out, expected, rtol=1e-4, atol=1e-5)
    assert mx.allclose(eager, expected, rtol=1e-4, atol=1e-5)
    # Only the eager call was scheduled.
    assert scheduled["shapes"] == [(1, 4, 96, 64)]
