"""A small qwen2 GGUF written with the `gguf` package's own writer: the shape
of the embedded model (GQA, biases on q/k/v, separate output head, a BPE
tokenizer with control tokens and a chat template) at a size tests can afford.
Tensors are stored quantized (Q8_0) where the real file is, F32 elsewhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CONFIG = dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, context=256, rope=1e6, eps=1e-6)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 base tokens of a byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tokenizer_tables():
    base = byte_level_alphabet()
    merges = ["t h", "th e", "Ġ th", "Ġth e", "i n", "e r", "a n", "o n"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = base + merged + SPECIALS
    types = [1] * (len(base) + len(merged)) + [3] * len(SPECIALS)
    return tokens, types, merges


def expected_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in (out, in) order, before quantization."""
    c = CONFIG
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer_tables()[0])
    head_dim = c["hidden"] // c["heads"]
    kv = c["kv_heads"] * head_dim
    w = {
        "token_embd.weight": (vocab, c["hidden"]),
        "output.weight": (vocab, c["hidden"]),
        "output_norm.weight": (c["hidden"],),
    }
    for n in range(c["layers"]):
        w.update({
            f"blk.{n}.attn_q.weight": (c["hidden"], c["hidden"]), f"blk.{n}.attn_q.bias": (c["hidden"],),
            f"blk.{n}.attn_k.weight": (kv, c["hidden"]), f"blk.{n}.attn_k.bias": (kv,),
            f"blk.{n}.attn_v.weight": (kv, c["hidden"]), f"blk.{n}.attn_v.bias": (kv,),
            f"blk.{n}.attn_output.weight": (c["hidden"], c["hidden"]),
            f"blk.{n}.ffn_gate.weight": (c["ffn"], c["hidden"]),
            f"blk.{n}.ffn_up.weight": (c["ffn"], c["hidden"]),
            f"blk.{n}.ffn_down.weight": (c["hidden"], c["ffn"]),
            f"blk.{n}.attn_norm.weight": (c["hidden"],),
            f"blk.{n}.ffn_norm.weight": (c["hidden"],),
        })
    return {k: (rng.standard_normal(shape) * 0.1).astype(np.float32) for k, shape in w.items()}


def write_gguf(path: Path, arch: str = "qwen2", seed: int = 0) -> dict[str, np.ndarray]:
    """Writes the file; returns GGUF name -> the values a reader must get back
    (after the Q8_0 round trip for quantized tensors)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    c = CONFIG
    tokens, types, merges = tokenizer_tables()
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(c["layers"])
    writer.add_context_length(c["context"])
    writer.add_embedding_length(c["hidden"])
    writer.add_feed_forward_length(c["ffn"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_rope_freq_base(c["rope"])
    writer.add_layer_norm_rms_eps(c["eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(TEMPLATE)

    expected = {}
    for name, values in expected_weights(seed).items():
        if values.ndim == 2:
            q = quantize(values, GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
            expected[name] = dequantize(q, GGMLQuantizationType.Q8_0).reshape(values.shape)
        else:
            writer.add_tensor(name, values)
            expected[name] = values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
