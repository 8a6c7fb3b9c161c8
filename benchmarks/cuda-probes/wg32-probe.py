"""The patch's default on a 16-bit model, flash_attention(..., dtype=float32)
over bfloat16 (or float16) inputs (fa_prefill_wg32_* on Hopper, fa_prefill32_*
at E = 256): us a call (20 chained calls an evaluation on K/V copies, median
of 15), its float32 output cast to the inputs' dtype ("f32") or stored in it
(out_dtype: "out16"), beside the same on inputs cast to float32 first, the
native 16-bit call and MLX's SDPA, and the output's error against float64 on sampled rows
(relative, Frobenius). Run it on two builds to compare them (PYTHONPATH).
`hd256`: Gemma's head dim (8 / 4 heads) instead of qwen05b and hd128.

    python3 benchmarks/cuda-probes/wg32-probe.py [float16] [hd256]"""

import statistics
import sys

import mlx.core as mx
import numpy as np
from gpu_probe_calls import HD128, QWEN05B, phases

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, causal_mask, relative_error

ROWS = 96  # sampled query rows a case for the error
DTYPE = mx.float16 if "float16" in sys.argv[1:] else mx.bfloat16
HD256 = (8, 4, 256)


def sampled_error(q, k, v, out, L, S, seed=0):
    """Relative Frobenius error of out on ROWS random rows of every head,
    against the float64 reference (causal, bottom-right aligned)."""
    rows = np.sort(np.random.default_rng(seed).choice(L, size=min(ROWS, L), replace=False))
    ref = attention_reference(q[..., mx.array(rows), :], k, v, mask=causal_mask(L, S)[rows])
    return relative_error(np.array(out.astype(mx.float32))[..., rows, :], ref)


CASES = [("qwen05b", QWEN05B, 2048, 2048), ("qwen05b", QWEN05B, 8192, 8192), ("qwen05b", QWEN05B, 2048, 8192),
         ("qwen05b", QWEN05B, 2048, 16384), ("hd128", HD128, 2048, 2048), ("hd128", HD128, 4096, 4096),
         ("hd128", HD128, 2048, 8192)]
if "hd256" in sys.argv[1:]:
    CASES = [("hd256", HD256, L, S) for L, S in ((2048, 2048), (4096, 4096), (8192, 8192), (2048, 8192))]
print(f"{str(DTYPE).rsplit('.', 1)[-1]:9s} {'case':18s} {'f32 us':>8s} {'out16':>8s} {'cast us':>8s} {'16-bit':>8s}"
      f" {'MLX us':>8s} {'f32/MLX':>8s} {'o16/MLX':>8s} {'error':>9s}")
for name, (H, H_kv, E), L, S in CASES:
    q = mx.random.normal((1, H, L, E)).astype(DTYPE)
    kv = [(mx.random.normal((1, H_kv, S, E)).astype(DTYPE), mx.random.normal((1, H_kv, S, E)).astype(DTYPE))
          for _ in range(8)]
    mx.eval(q, kv)
    fns = {
        "f32": lambda i, p: flash_attention(q if p is None else p, *kv[i % 8], mask="causal",
                                            dtype=mx.float32).astype(DTYPE),
        "out16": lambda i, p: flash_attention(q if p is None else p, *kv[i % 8], mask="causal", dtype=mx.float32,
                                              out_dtype=DTYPE),
        "cast": lambda i, p: flash_attention(*(x.astype(mx.float32) for x in (q if p is None else p, *kv[i % 8])),
                                             mask="causal").astype(DTYPE),
        "native": lambda i, p: flash_attention(q if p is None else p, *kv[i % 8], mask="causal"),
        "mlx": lambda i, p: mx.fast.scaled_dot_product_attention(q if p is None else p, *kv[i % 8], scale=E**-0.5,
                                                                 mask="causal"),
    }
    t = {impl: phases(fn, stat=statistics.median, reps=15)[3] for impl, fn in fns.items()}
    out = flash_attention(q, *kv[0], mask="causal", dtype=mx.float32)
    err = sampled_error(q, *kv[0], out, L, S)
    print(f"{name} L={L} S={S}".ljust(28) + f" {t['f32']:8.1f} {t['out16']:8.1f} {t['cast']:8.1f} {t['native']:8.1f}"
          f" {t['mlx']:8.1f} {t['mlx'] / t['f32']:7.2f}x {t['mlx'] / t['out16']:7.2f}x {err:9.2e}")
