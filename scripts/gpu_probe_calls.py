"""The calls the GPU probe scripts compare (ncu-probe.py, overhead-probe.py,
power-probe.py): flash_attention and MLX's SDPA on the same random inputs of
one benchmark shape."""

import mlx.core as mx

from flashattn_core import flash_attention

# (query heads, KV heads, head dim) of flash-eval's benchmark shapes.
QWEN05B, HD128 = (14, 2, 64), (32, 8, 128)


def calls(heads, L, S, dtype):
    """(flash, mlx): zero-argument calls of flash_attention and
    mx.fast.scaled_dot_product_attention on random (1, H, L, E) queries and
    (1, H_kv, S, E) keys and values (evaluated once here), causal when L > 1
    (prefill), unmasked for decode."""
    H, H_kv, E = heads
    q = mx.random.normal((1, H, L, E)).astype(dtype)
    k = mx.random.normal((1, H_kv, S, E)).astype(dtype)
    v = mx.random.normal((1, H_kv, S, E)).astype(dtype)
    mx.eval(q, k, v)
    mask = "causal" if L > 1 else None
    return (lambda: flash_attention(q, k, v, mask=mask),
            lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=E**-0.5, mask=mask))
