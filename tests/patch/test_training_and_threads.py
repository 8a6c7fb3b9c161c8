"""Fine-tuning through the patch (gradients), and switching the patch while
another thread generates."""

import threading

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm import generate
from tiny_models import tiny_model, wrapped_tokenizer

import mlxlm_flash_patch


def train_losses(patch: bool, steps: int = 5) -> list[float]:
    model, _ = tiny_model("qwen2", mx.float32, seed=3)
    rng = np.random.default_rng(0)
    batch = mx.array(rng.integers(0, 384, (2, 33)))
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def loss_fn(model):
        return nn.losses.cross_entropy(model(inputs), targets, reduction="mean")

    opt = optim.Adam(learning_rate=1e-2)
    step = nn.value_and_grad(model, loss_fn)
    losses = []
    ctx = mlxlm_flash_patch.patched() if patch else _Nothing()
    with ctx:
        for _ in range(steps):
            loss, grads = step(model)
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
            losses.append(loss.item())
    return losses


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_training_steps_match_with_and_without_patch():
    off = train_losses(False)
    on = train_losses(True)
    assert off[-1] < off[0]  # it learns
    np.testing.assert_allclose(on, off, rtol=1e-4)
    stats = mlxlm_flash_patch.stats()
    assert stats["flash_calls"] >= 10
    # Every gradient through the patch took the fused backward (CPU).
    assert stats["gradients"]["fused"] >= 10 and stats["gradients"]["recomputed"] == {}


def test_toggling_while_another_thread_generates():
    tokenizer = wrapped_tokenizer()
    model, _ = tiny_model("llama", vocab_size=len(tokenizer))
    expected = generate(model, tokenizer, "Generators", max_tokens=24)
    results, stop = [], threading.Event()

    def toggler():
        while not stop.is_set():
            mlxlm_flash_patch.enable()
            mlxlm_flash_patch.disable()

    t = threading.Thread(target=toggler)
    t.start()
    try:
        for _ in range(4):
            results.append(generate(model, tokenizer, "Generators", max_tokens=24))
    finally:
        stop.set()
        t.join()
    # Every call ran on one path or the other; both give the same greedy text.
    assert results == [expected] * 4
    assert not mlxlm_flash_patch.is_enabled()
