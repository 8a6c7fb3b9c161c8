"""The patch's default on a 16-bit model, flash_attention(..., dtype=float32)
over bfloat16 (or float16) inputs (fa_prefill_wg32_* on Hopper): us a call
(20 chained calls an evaluation on K/V copies, median of 15) beside the
native 16-bit call and MLX's SDPA, and the output's error against float64 on
sampled rows (relative, Frobenius). Run it on two builds to compare them
(PYTHONPATH).

    python3 benchmarks/cuda-probes/wg32-probe.py [float16]"""

import statistics
import sys

import mlx.core as mx
import numpy as np
from gpu_probe_calls import HD128, QWEN05B, phases

from flashattn_core import flash_attention

ROWS = 96  # sampled query rows a case for the error
DTYPE = getattr(mx, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")


def sampled_error(q, k, v, out, L, S, seed=0):
    """Relative Frobenius error of out on ROWS random rows of every head,
    against float64 (causal: query i sees keys up to S - L + i)."""
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(L, size=min(ROWS, L), replace=False))
    q64, k64, v64 = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    o = np.array(out.astype(mx.float32), dtype=np.float64)[0][:, rows]
    H, H_kv, E = q64.shape[1], k64.shape[1], q64.shape[3]
    kh, vh = np.repeat(k64[0], H // H_kv, axis=0), np.repeat(v64[0], H // H_kv, axis=0)
    s = np.einsum("hre,hse->hrs", q64[0][:, rows], kh) / np.sqrt(E)
    hidden = np.arange(S)[None, :] > (S - L + rows)[:, None]
    s[:, hidden] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hrs,hse->hre", p / p.sum(-1, keepdims=True), vh)
    return np.linalg.norm(o - ref) / np.linalg.norm(ref)


CASES = [("qwen05b", QWEN05B, 2048, 2048), ("qwen05b", QWEN05B, 8192, 8192), ("qwen05b", QWEN05B, 2048, 8192),
         ("qwen05b", QWEN05B, 2048, 16384), ("hd128", HD128, 2048, 2048), ("hd128", HD128, 4096, 4096),
         ("hd128", HD128, 2048, 8192)]
print(f"{str(DTYPE).rsplit('.', 1)[-1]:9s} {'case':18s} {'f32 us':>8s} {'16-bit':>8s} {'MLX us':>8s} {'f32/MLX':>8s} {'error':>9s}")
for name, (H, H_kv, E), L, S in CASES:
    q = mx.random.normal((1, H, L, E)).astype(DTYPE)
    kv = [(mx.random.normal((1, H_kv, S, E)).astype(DTYPE), mx.random.normal((1, H_kv, S, E)).astype(DTYPE))
          for _ in range(8)]
    mx.eval(q, kv)
    fns = {
        "f32": lambda i, p: flash_attention(q if p is None else p, *kv[i % 8], mask="causal",
                                            dtype=mx.float32).astype(DTYPE),
        "native": lambda i, p: flash_attention(q if p is None else p, *kv[i % 8], mask="causal"),
        "mlx": lambda i, p: mx.fast.scaled_dot_product_attention(q if p is None else p, *kv[i % 8], scale=E**-0.5,
                                                                 mask="causal"),
    }
    t = {impl: phases(fn, stat=statistics.median, reps=15)[3] for impl, fn in fns.items()}
    out = flash_attention(q, *kv[0], mask="causal", dtype=mx.float32)
    err = sampled_error(q, *kv[0], out, L, S)
    print(f"{name} L={L} S={S}".ljust(28) + f" {t['f32']:8.1f} {t['native']:8.1f} {t['mlx']:8.1f} "
          f"{t['mlx'] / t['f32']:7.2f}x {err:9.2e}")
