"""Per-call decode time of flash_attention and MLX's SDPA (20 calls per
evaluation, best of 10), one line per shape: python3 scripts/decode-probe.py"""

import sys
import time

import mlx.core as mx

from flashattn_core import flash_attention


def per_call(fn, batch=20, reps=10):
    mx.eval(fn())
    best = float("inf")
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([fn() for _ in range(batch)])
        mx.synchronize()
        best = min(best, (time.perf_counter() - t) / batch)
    return best * 1e6


label = sys.argv[1] if len(sys.argv) > 1 else ""
for name, H, H_kv, E, S, dtype in [("qwen05b", 14, 2, 64, 1024, mx.bfloat16), ("qwen05b", 14, 2, 64, 8192, mx.bfloat16),
                                   ("qwen05b", 14, 2, 64, 32768, mx.bfloat16), ("hd128", 32, 8, 128, 32768, mx.bfloat16),
                                   ("qwen05b", 14, 2, 64, 32768, mx.float32)]:
    q = mx.random.normal((1, H, 1, E)).astype(dtype)
    k = mx.random.normal((1, H_kv, S, E)).astype(dtype)
    v = mx.random.normal((1, H_kv, S, E)).astype(dtype)
    mx.eval(q, k, v)
    f = per_call(lambda: flash_attention(q, k, v))
    f1 = per_call(lambda: flash_attention(q, k, v), batch=1)
    m = per_call(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=E**-0.5))
    print(f"{label:10s} {name:8s} S={S:6d} {str(dtype):14s} flash {f:7.1f} us (1/eval {f1:7.1f})  mlx {m:7.1f} us  ratio {f / m:5.2f}")
