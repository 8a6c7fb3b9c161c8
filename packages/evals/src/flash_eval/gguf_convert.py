"""A Qwen2 GGUF file as an mlx-lm model folder: dequantized weights
(safetensors), config.json, and the tokenizer rebuilt from the GGUF metadata.

Only the `qwen2` architecture is taken (the embedded model); its weights need
no q/k row permutation. GGUF stores dimensions reversed; the `gguf` package's
dequantize already returns arrays in (out, in) order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mlx.core as mx

# GGUF tensor names -> mlx-lm (Hugging Face) parameter names.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Qwen2's pre-tokenizer split (its tokenizer.json), before byte-level mapping.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


class ConversionError(ValueError):
    pass


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ConversionError(f"unexpected tensor {gguf_name!r} in a qwen2 GGUF")


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ConversionError(f"GGUF metadata lacks {key!r}")
    return field.contents()


def qwen2_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "qwen2":
        raise ConversionError(f"only qwen2 GGUF files are converted; this one is {arch!r}")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": int(_field(reader, "qwen2.embedding_length")),
        "intermediate_size": int(_field(reader, "qwen2.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "qwen2.block_count")),
        "num_attention_heads": int(_field(reader, "qwen2.attention.head_count")),
        "num_key_value_heads": int(_field(reader, "qwen2.attention.head_count_kv")),
        # Stored as float32: 1e-6 reads back as 9.99999997e-07.
        "rms_norm_eps": float(f"{_field(reader, 'qwen2.attention.layer_norm_rms_epsilon'):.7g}"),
        "rope_theta": float(_field(reader, "qwen2.rope.freq_base")),
        "max_position_embeddings": int(_field(reader, "qwen2.context_length")),
        "vocab_size": len(tokens.data),
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
    }


def build_tokenizer(reader):
    """The byte-level BPE tokenizer stored in the GGUF, as a transformers
    PreTrainedTokenizerFast: Qwen2's split regex, ByteLevel, NFC; control and
    user-defined tokens become added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = _field(reader, "tokenizer.ggml.pre")
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or pre != "qwen2":
        raise ConversionError(f"expected a gpt2-style BPE with qwen2 pre-tokenizer; got {pre!r}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=types[i] == TOKEN_CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    tok.add_tokens(added)

    eos = tokens[int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    pad_id = reader.fields.get("tokenizer.ggml.padding_token_id")
    pad = tokens[int(pad_id.contents())] if pad_id is not None else None
    chat = reader.fields.get("tokenizer.chat_template")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=pad,
        chat_template=chat.contents() if chat is not None else None,
        model_max_length=int(_field(reader, "qwen2.context_length")),
        clean_up_tokenization_spaces=False,
    )


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: str = "float32",
    on_tensor: Callable[[int, int], None] | None = None,
) -> dict:
    """Writes model.safetensors, config.json and the tokenizer into out_dir
    (which should be a fresh temporary folder). Returns the config."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConversionError(f"dtype must be float32, bfloat16 or float16; got {dtype!r}")
    reader = GGUFReader(str(gguf_path))
    config = qwen2_config(reader)
    config["torch_dtype"] = dtype
    mx_dtype = getattr(mx, dtype)

    weights = {}
    for i, t in enumerate(reader.tensors):
        values = dequantize(t.data, t.tensor_type)
        expected = tuple(int(d) for d in reversed(t.shape.tolist()))
        if values.shape != expected:
            values = values.reshape(expected)
        weights[hf_name(t.name)] = mx.array(values).astype(mx_dtype)
        if on_tensor:
            on_tensor(i + 1, len(reader.tensors))
    missing = _missing_weights(config, weights)
    if missing:
        raise ConversionError(f"GGUF lacks tensors for {', '.join(missing[:5])}")

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(reader).save_pretrained(str(out_dir))
    return config


def _missing_weights(config: dict, weights: dict) -> list[str]:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        needed.append("lm_head.weight")
    for n in range(config["num_hidden_layers"]):
        for part in BLOCK_NAMES.values():
            needed.append(f"model.layers.{n}.{part}.weight")
    return [name for name in needed if name not in weights]
