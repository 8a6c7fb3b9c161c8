"""Where forward + backward's GPU time goes, kernel by kernel (PyTorch's
profiler: CUPTI sees MLX's kernels too): flash_attention's gradient against
MLX's VJP of its SDPA, causal, qwen05b and hd128 at 4K and 8K; bfloat16, or
the dtype named.

    python3 benchmarks/cuda-probes/backward-split-probe.py [float32]"""

import sys

import mlx.core as mx
from gpu_probe_calls import HD128, QWEN05B
from torch.profiler import ProfilerActivity, profile

from flashattn_core import flash_attention

REPS = 20
dtype = getattr(mx, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
for name, (H, H_kv, E) in (("qwen05b", QWEN05B), ("hd128", HD128)):
    for L in (4096, 8192):
        q, k, v = (mx.random.normal((1, h, L, E)).astype(dtype) for h in (H, H_kv, H_kv))
        d_out = mx.random.normal(q.shape).astype(dtype)
        mx.eval(q, k, v, d_out)
        fns = {
            "flash": lambda q, k, v: flash_attention(q, k, v, mask="causal"),
            "mlx": lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=E**-0.5, mask="causal"),
        }
        for impl, fn in fns.items():
            step = lambda: mx.eval(mx.vjp(fn, [q, k, v], [d_out]))
            for _ in range(5):
                step()
            mx.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(REPS):
                    step()
                mx.synchronize()
            rows = sorted(((e.device_time_total / 1e3 / REPS, e.count / REPS, e.key) for e in prof.key_averages()
                           if e.device_time_total > 0), reverse=True)
            print(f"{name} L={L} {impl}: GPU ms a call {sum(r[0] for r in rows):.3f}")
            for t, n, key in rows:
                print(f"  {t:8.4f} {n:5.1f}  {key[:100]}")
