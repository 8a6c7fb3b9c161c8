"""Attention test cases: shapes, masks, dtypes and memory layouts, and the
inputs that realise them. Shared by the kernel tests and the fuzz tests."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from pairwise import pairwise

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Relative Frobenius-norm error against float64, per input dtype.
TOLERANCE = {"float32": 2e-5, "float16": 5e-3, "bfloat16": 2e-2}

MASKS = [
    "none",
    "causal",
    "bool_full",  # (B..., H_q, L, S)
    "bool_LS",  # (L, S), as mlx-lm passes sliding windows
    "bool_keys",  # (B..., 1, 1, S): key padding, broadcast over heads and rows
    "bool_rows",  # (L, 1): whole rows hidden
    "additive_full",  # float32 (B..., H_q, L, S), some -inf
    "additive_LS",  # (L, S) in the inputs' dtype
    "additive_heads",  # float16 (H_q, 1, S)
]

LAYOUTS = [
    "contiguous",
    "transposed",  # (B..., L, H, E) viewed as (B..., H, L, E), as mlx-lm does
    "kv_cache",  # keys/values sliced from a preallocated (.., 256k, E) buffer
    "e_strided",  # the head dimension is not the fastest axis
]


@dataclass(frozen=True)
class Case:
    batch: tuple
    heads: tuple  # (H_q, H_kv)
    L: int
    S: int
    E: int
    mask: str = "none"
    dtype: str = "float32"
    layout: str = "contiguous"

    @property
    def work(self) -> int:
        """Multiply-adds of Q K^T: what bounds a case's run time."""
        return math.prod(self.batch) * self.heads[0] * self.L * self.S * self.E

    def __str__(self) -> str:
        b = "x".join(map(str, self.batch)) or "-"
        return (
            f"b{b}_h{self.heads[0]}-{self.heads[1]}_L{self.L}_S{self.S}_E{self.E}"
            f"_{self.mask}_{self.dtype}_{self.layout}"
        )


def _tensor(rng, batch, H, rows, E, dtype, layout, *, kv: bool, scale=1.0):
    """A (B..., H, rows, E) array of standard normals in the given layout."""
    if layout == "transposed":
        x = rng.standard_normal((*batch, rows, H, E)) * scale
        return mx.swapaxes(mx.array(x).astype(dtype), -2, -3)
    if layout == "e_strided":
        x = rng.standard_normal((*batch, H, E, rows)) * scale
        return mx.swapaxes(mx.array(x).astype(dtype), -1, -2)
    if layout == "kv_cache" and kv:
        capacity = 256 * (rows // 256 + 1)
        x = rng.standard_normal((*batch, H, capacity, E)) * scale
        return mx.array(x).astype(dtype)[..., :rows, :]
    if layout == "kv_cache":  # queries come through a transpose in mlx-lm
        return _tensor(rng, batch, H, rows, E, dtype, "transposed", kv=False, scale=scale)
    return mx.array(rng.standard_normal((*batch, H, rows, E)) * scale).astype(dtype)


def _bool_mask(rng, shape):
    m = rng.random(shape) < 0.7
    if m.ndim >= 2 and m.shape[-2] > 2:
        m[..., 1, :] = False  # a row that sees no key at all
    return mx.array(m)


def make_mask(rng, case: Case):
    B, (H_q, _), L, S = case.batch, case.heads, case.L, case.S
    dtype = DTYPES[case.dtype]
    kind = case.mask
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    if kind == "bool_full":
        return _bool_mask(rng, (*B, H_q, L, S))
    if kind == "bool_LS":
        return _bool_mask(rng, (L, S))
    if kind == "bool_keys":
        m = rng.random((*B, 1, 1, S)) < 0.8
        m[..., 0] = True
        return mx.array(m)
    if kind == "bool_rows":
        m = np.ones((L, 1), dtype=bool)
        m[L // 2] = False
        return mx.array(m)
    if kind == "additive_full":
        m = rng.standard_normal((*B, H_q, L, S)) * 2
        m[rng.random(m.shape) < 0.2] = -np.inf
        return mx.array(m.astype(np.float32))
    if kind == "additive_LS":
        return mx.array(rng.standard_normal((L, S))).astype(dtype)
    if kind == "additive_heads":
        return mx.array(rng.standard_normal((H_q, 1, S))).astype(mx.float16)
    raise ValueError(kind)


# FLASHATTN_TEST_SEED shifts every seed: fresh inputs on each run where wanted
# (the GPU check does it), the same inputs otherwise.
SEED_SHIFT = int(os.environ.get("FLASHATTN_TEST_SEED", "0"))


def make_inputs(case: Case, seed: int = 0, scale: float = 1.0):
    """(queries, keys, values, mask) for a case, from a seeded generator."""
    rng = np.random.default_rng(seed + SEED_SHIFT)
    dtype = DTYPES[case.dtype]
    H_q, H_kv = case.heads
    q = _tensor(rng, case.batch, H_q, case.L, case.E, dtype, case.layout, kv=False, scale=scale)
    k = _tensor(rng, case.batch, H_kv, case.S, case.E, dtype, case.layout, kv=True, scale=scale)
    v = _tensor(rng, case.batch, H_kv, case.S, case.E, dtype, case.layout, kv=True)
    return q, k, v, make_mask(rng, case)


# The correctness matrix every backend runs: a pairwise covering array.
SIZES = [1, 2, 7, 31, 32, 33, 100, 257]
MATRIX = [
    Case(**row)
    for row in pairwise(
        {
            "L": SIZES,
            "S": SIZES,
            "E": [5, 16, 64, 80, 96, 128, 256],
            "heads": [(1, 1), (6, 3), (14, 2), (28, 4), (32, 8)],
            "batch": [(), (1,), (3,), (2, 2)],
            "mask": MASKS,
            "dtype": ["float32", "float16", "bfloat16"],
            "layout": LAYOUTS,
        },
        # Bound each case's work so the suite stays in CI's budget.
        accept=lambda row: Case(**row).work <= 30_000_000,
    )
]


def sinks_for(H_q, seed=7):
    """Attention sinks for H_q query heads, around the scores' own size so
    that each takes a real share of its rows; head 0 without one (-inf),
    head 1 one that takes nearly all (with more than two heads)."""
    s = np.random.default_rng(seed).normal(0.5, 1.5, H_q).astype(np.float32)
    s[0] = -np.inf
    if H_q > 2:
        s[1] = 12.0
    return mx.array(s)


def band_scales(n, bands, seed):
    """A power of two for each 128-row band of n rows (the float16 terms'
    tiles): magnitudes far apart across tiles."""
    rng = np.random.default_rng(seed)
    return 2.0 ** rng.choice(bands, size=(n + 127) // 128)[np.arange(n) // 128]
