"""The attention shapes the benchmarks are named after (anchors of the project)."""

from __future__ import annotations

from dataclasses import dataclass


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
}


@dataclass(frozen=True)
class KernelCase:
    """Causal prefill (L = S) or single-token decode (L = 1, no mask)."""

    shape: HeadShape
    kind: str  # "prefill" | "decode"
    length: int  # L = S for prefill, S for decode
    dtype: str

    @property
    def L(self) -> int:
        return self.length if self.kind == "prefill" else 1

    @property
    def S(self) -> int:
        return self.length

    @property
    def causal(self) -> bool:
        return self.kind == "prefill"

    @property
    def flops(self) -> float:
        """FlashAttention convention: 4 H_q L S E, halved for causal L = S."""
        f = 4.0 * self.shape.H_q * self.L * self.S * self.shape.E
        return f / 2 if self.causal else f

    @property
    def kv_bytes(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.shape.H_kv * self.S * self.shape.E * itemsize

    @property
    def label(self) -> str:
        n = "L" if self.kind == "prefill" else "S"
        return f"{self.shape.name} {self.kind} {n}={self.length}"
