"""Per-call time of flash_attention vs MLX's SDPA, one call per evaluation
and 20 per evaluation, to separate kernel time from per-call overhead."""

import time

import mlx.core as mx

from flashattn_core import flash_attention


def per_call(fn, batch, reps=10):
    mx.eval(fn())
    best = float("inf")
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([fn() for _ in range(batch)])
        mx.synchronize()
        best = min(best, (time.perf_counter() - t) / batch)
    return best * 1e3


for name, L, S, dtype in [("prefill 8192 bf16", 8192, 8192, mx.bfloat16), ("prefill 8192 f32", 8192, 8192, mx.float32),
                          ("decode 32768 bf16", 1, 32768, mx.bfloat16)]:
    q = mx.random.normal((1, 14, L, 64)).astype(dtype)
    k = mx.random.normal((1, 2, S, 64)).astype(dtype)
    mx.eval(q, k)
    mask = "causal" if L > 1 else None
    f = lambda: flash_attention(q, k, k, mask=mask)
    g = lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask=mask)
    print(f"{name}: flash {per_call(f, 1):.3f} / {per_call(f, 20):.3f} ms, "
          f"mlx {per_call(g, 1):.3f} / {per_call(g, 20):.3f} ms (1 / 20 calls per eval)")
