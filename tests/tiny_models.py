"""Tiny random-weight mlx-lm models (Qwen2, Llama) and a local model folder
that `mlx_lm.load` and the `mlx_lm.generate` command read without the hub."""

from __future__ import annotations

import json
import pydoc_data.topics
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

FAMILIES = {
    "qwen2": dict(
        model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    # gpt-oss: attention sinks, and sliding-window layers (RotatingKVCache)
    # alternating with full ones; a mixture of experts for the MLP.
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=64, num_hidden_layers=2, intermediate_size=64, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, rope_theta=1e4, layer_types=["sliding_attention", "full_attention"],
    ),
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=1e4,
        tie_word_embeddings=True,
    ),
}
VOCAB = 384


def tiny_model(family: str = "qwen2", dtype=mx.float32, seed: int = 0, vocab_size: int = VOCAB, **overrides):
    """(model, config) with seeded random weights, scaled so that greedy
    decoding has clear winners rather than near-ties."""
    import importlib

    config = {**FAMILIES[family], "vocab_size": vocab_size, **overrides}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = tree_map(lambda p: mx.random.normal(p.shape) * 0.2, model.parameters())
    model.update(params)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, config


def tiny_tokenizer(vocab_size: int = VOCAB):
    """A byte-level BPE trained on CPython's own documentation text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = list(pydoc_data.topics.topics.values())[:200]
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def wrapped_tokenizer(vocab_size: int = VOCAB):
    """tiny_tokenizer() as mlx-lm's own loader hands it out."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(tiny_tokenizer(vocab_size))


def save_model_folder(path: Path, family: str = "qwen2", dtype=mx.float32) -> Path:
    """A folder `mlx_lm.load(path)` reads: config.json, weights, tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    model, config = tiny_model(family, dtype, vocab_size=len(tokenizer))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(str(path))
    return path


def logits(model, tokens: mx.array, cache=None) -> mx.array:
    out = model(tokens, cache=cache)
    mx.eval(out)
    return out
