"""The attention shapes the benchmarks are named after (anchors of the project)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HeadShape:
    name: str
    H_q: int
    H_kv: int
    E: int


SHAPES = {
    # Qwen2-0.5B / Qwen2.5-0.5B attention.
    "qwen05b": HeadShape("qwen05b", H_q=14, H_kv=2, E=64),
    # Llama / Qwen 7B-class attention.
    "hd128": HeadShape("hd128", H_q=32, H_kv=8, E=128),
    # The other head dims the kernels have fast paths for: Phi-2's (80),
    # Phi-3-mini's (96), both without GQA, and Gemma-2-2B's (256).
    "hd80": HeadShape("hd80", H_q=32, H_kv=32, E=80),
    "hd96": HeadShape("hd96", H_q=32, H_kv=32, E=96),
    "hd256": HeadShape("hd256", H_q=8, H_kv=4, E=256),
}


# mlx-lm's prefill step: a long prompt goes through a model in chunks of this
# many tokens, each attending to the cache before it and to itself.
CHUNK_ROWS = 2048


@dataclass(frozen=True)
class KernelCase:
    """Causal prefill (L = S), single-token decode (L = 1, no mask), or one
    chunk of a chunked prefill (the last `rows` queries of S keys, causal: the
    queries are the newest tokens, as mlx-lm's prefill steps make them)."""

    shape: HeadShape
    kind: str  # "prefill" | "decode" | "chunk"
    length: int  # L = S for prefill, S for decode and chunk
    dtype: str
    rows: int = CHUNK_ROWS  # L of a chunk
    window: int = 0  # causal cases: a sliding window of this many keys (0: none)
    kv_bits: int = 0  # keys and values quantized to this many bits (0: the dtype's own)
    kv_group_size: int = 64
    sinks: bool = False  # an attention sink per query head (gpt-oss)

    @property
    def L(self) -> int:
        if self.kind == "chunk":
            return self.rows
        return self.length if self.kind == "prefill" else 1

    @property
    def S(self) -> int:
        return self.length

    @property
    def causal(self) -> bool:
        return self.kind != "decode" or self.window > 0

    @property
    def flops(self) -> float:
        """FlashAttention convention: 4 H_q E for each query-key pair,
        counting half of the causal triangle (L^2 / 2), so that a chunk's
        count at L = S is the prefill's: a chunk's rows see the S - L keys
        before them in full. With a window, the pairs it shows: row i sees
        min(W, i + S - L + 1) keys."""
        if self.window:
            seen = np.minimum(self.window, np.arange(self.L) + (self.S - self.L) + 1)
            pairs = float(np.clip(seen, 0, None).sum())
        elif self.causal:
            pairs = self.L * (self.S - self.L) + self.L * self.L / 2
        else:
            pairs = self.L * self.S
        return 4.0 * self.shape.H_q * self.shape.E * pairs

    @property
    def kv_bytes(self) -> int:
        """The keys and values a call reads: a window's share of them."""
        itemsize = 4 if self.dtype == "float32" else 2
        keys = min(self.S, self.window + self.L - 1) if self.window else self.S
        row = self.shape.E * itemsize
        if self.kv_bits:  # packed fields, and a scale and a bias a group
            row = self.shape.E * self.kv_bits // 8 + 2 * itemsize * (self.shape.E // self.kv_group_size)
        return 2 * self.shape.H_kv * keys * row

    @property
    def label(self) -> str:
        window = f" window={self.window}" if self.window else ""
        if self.kv_bits:
            window += f" {self.kv_bits}-bit KV"
        if self.sinks:
            window += " sinks"
        if self.kind == "chunk":
            return f"{self.shape.name} chunk L={self.rows} S={self.length}{window}"
        n = "L" if self.kind == "prefill" else "S"
        return f"{self.shape.name} {self.kind} {n}={self.length}{window}"
