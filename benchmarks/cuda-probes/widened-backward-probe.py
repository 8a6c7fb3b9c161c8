"""Float32 attention over bfloat16 inputs under a gradient (the patch's
default when training): forward + backward time against MLX's VJP of its
bfloat16 SDPA and of its float32 SDPA on cast inputs, and the gradients'
error against float64 beside the float64 gradient rounded to bfloat16.

    python3 benchmarks/cuda-probes/widened-backward-probe.py"""

import statistics
import time

import mlx.core as mx
import numpy as np
from gpu_probe_calls import HD128, QWEN05B

from flashattn_core import flash_attention
from flashattn_core.reference import attention_gradients_reference, relative_error


def timed(fn, reps=15):
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def vjp_of(f, q, k, v, d_out):
    return lambda: mx.vjp(f, [q, k, v], [d_out])


for name, (H, H_kv, E) in (("qwen05b", QWEN05B), ("hd128", HD128)):
    for L in (4096, 8192):
        q, k, v = (mx.random.normal((1, h, L, E)).astype(mx.bfloat16) for h in (H, H_kv, H_kv))
        d32 = mx.random.normal(q.shape)
        d16 = d32.astype(mx.bfloat16)
        mx.eval(q, k, v, d32, d16)
        f32 = lambda x: x.astype(mx.float32)
        ours = lambda q, k, v: flash_attention(q, k, v, mask="causal", dtype=mx.float32)
        mlx16 = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=E**-0.5, mask="causal")
        mlx32 = lambda q, k, v: mx.fast.scaled_dot_product_attention(f32(q), f32(k), f32(v), scale=E**-0.5,
                                                                     mask="causal")
        t_ours = timed(vjp_of(ours, q, k, v, d32))
        t16 = timed(vjp_of(mlx16, q, k, v, d16))
        t32 = timed(vjp_of(mlx32, q, k, v, d32))
        print(f"{name} {L}: ours (float32 over bf16) {t_ours:.3f} ms, MLX bf16 {t16:.3f} ({t16 / t_ours:.2f}x), "
              f"MLX float32 on cast inputs {t32:.3f} ({t32 / t_ours:.2f}x)", flush=True)

# Errors: a shape small enough for the float64 reference.
for E in (64, 128):
    shape = (1, 14, 1024, E)
    q, k, v = (mx.random.normal(s).astype(mx.bfloat16) for s in (shape, shape[:1] + (2,) + shape[2:],
                                                                     shape[:1] + (2,) + shape[2:]))
    for cotangent in (mx.bfloat16, mx.float32):
        d_out = mx.random.normal(shape).astype(cotangent).astype(mx.float32)
        grads = mx.vjp(lambda q, k, v: flash_attention(q, k, v, mask="causal", dtype=mx.float32), [q, k, v],
                       [d_out])[1]
        refs = attention_gradients_reference(q, k, v, d_out, mask="causal")
        for n, g, ref in zip(("dq", "dk", "dv"), grads, refs):
            rounded = mx.array(np.asarray(ref, dtype=np.float32)).astype(mx.bfloat16)
            print(f"E {E} {cotangent} dO {n}: error {relative_error(g, ref):.2e}, float64 rounded to bf16 "
                  f"{relative_error(rounded, ref):.2e}", flush=True)
