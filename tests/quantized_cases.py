"""Inputs for the quantized-cache tests: queries, and keys and values in
MLX's affine format as mlx-lm's QuantizedKVCache holds them."""

import mlx.core as mx
import numpy as np

GROUP_SIZES = (32, 64, 128)


def quantized_case(batch, heads, L, S, E, bits, group_size, dtype, layout, seed=0):
    """Queries, and keys and values as (packed, scales, biases). layout:
    "contiguous"; "kv_cache" (sliced from a longer buffer, as mlx-lm's cache
    is); "odd_queries" (the queries' rows start one element past an aligned
    boundary); "transposed" (queries a transposed view of (batch, L, H, E),
    as mlx-lm's attention passes them)."""
    rng = np.random.default_rng(seed)
    H_q, H_kv = heads
    t = getattr(mx, dtype)
    if layout == "odd_queries":
        q = mx.array(rng.standard_normal((*batch, H_q, L, E + 1))).astype(t)[..., 1:]
    elif layout == "transposed":
        q = mx.swapaxes(mx.array(rng.standard_normal((*batch, L, H_q, E))).astype(t), -2, -3)
    else:
        q = mx.array(rng.standard_normal((*batch, H_q, L, E))).astype(t)
    capacity = 256 * (S // 256 + 1) if layout == "kv_cache" else S

    def quantized():
        x = mx.array(rng.standard_normal((*batch, H_kv, capacity, E))).astype(t)
        return tuple(p[..., :S, :] for p in mx.quantize(x, group_size=group_size, bits=bits))

    return q, quantized(), quantized()


def dividing_group_size(E, drawn):
    """The largest group size up to the one drawn that divides E (MLX's format asks it)."""
    return max(g for g in GROUP_SIZES if g <= drawn and E % g == 0)
