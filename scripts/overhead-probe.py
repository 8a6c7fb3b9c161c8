"""Per-call time of flash_attention vs MLX's SDPA, one call per evaluation
and 20 per evaluation (best of 10 each), to separate kernel time from
per-call overhead: prefill at L = 8192 (hd128: 4096) and decode at
S = 1024-32768. First the floors: one MLX op (a tiny add, one graph node)
and one trivial custom kernel through mx.fast.cuda_kernel (the custom-kernel
path flash_attention's launches take). Then per case the time of building
the graph alone (no evaluation): on Hopper MLX records up to 100 nodes in one
CUDA graph and launches it when the evaluation ends, so with 20 calls an
evaluation a call's host time adds to its GPU time instead of hiding under
it.

    python3 scripts/overhead-probe.py [decode]"""

import sys
import time

import mlx.core as mx
from gpu_probe_calls import HD128, QWEN05B, calls


def per_call(fn, batch, reps=10):
    mx.eval(fn())
    best = float("inf")
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([fn() for _ in range(batch)])
        mx.synchronize()
        best = min(best, (time.perf_counter() - t) / batch)
    return best * 1e6


def build_only(fn, batch=20, reps=10):
    """Per-call time of building the graph alone (the calls' Python and C++
    up to the lazy output), best of reps; evaluated afterwards, untimed."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        outs = [fn() for _ in range(batch)]
        best = min(best, (time.perf_counter() - t) / batch)
        mx.eval(outs)
    return best * 1e6


def floors():
    a = mx.ones((16,))
    mx.eval(a)
    copy = mx.fast.cuda_kernel(
        name="probe_copy", input_names=["a"], output_names=["out"],
        source="auto i = cooperative_groups::this_grid().thread_rank(); if (i < 16) out[i] = a[i];")
    run = lambda: copy(inputs=[a], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(16,)],
                       output_dtypes=[mx.float32])[0]
    for name, fn in (("mx add (one node)", lambda: a + 1.0), ("cuda_kernel (one node)", run)):
        print(f"{name:40s} " + " / ".join(f"{per_call(fn, n):7.1f}" for n in (1, 20, 100)) +
              " us (1 / 20 / 100 calls per eval)")


CASES = [  # name, (H, H_kv, E), L, S, dtype
    ("qwen05b prefill", QWEN05B, 8192, 8192, mx.bfloat16),
    ("qwen05b prefill", QWEN05B, 8192, 8192, mx.float32),
    ("hd128 prefill", HD128, 4096, 4096, mx.bfloat16),
    *[("qwen05b decode", QWEN05B, 1, S, mx.bfloat16) for S in (1024, 8192, 32768)],
    ("qwen05b decode", QWEN05B, 1, 32768, mx.float32),
    ("hd128 decode", HD128, 1, 32768, mx.bfloat16),
]
floors()
for name, heads, L, S, dtype in CASES:
    if sys.argv[1:] == ["decode"] and L > 1:
        continue
    f, g = calls(heads, L, S, dtype)
    f20, g20 = per_call(f, 20), per_call(g, 20)
    print(f"{name:16s} L={L:5d} S={S:6d} {str(dtype):18s} flash {per_call(f, 1):9.1f} / {f20:9.1f} us, "
          f"mlx {per_call(g, 1):9.1f} / {g20:9.1f} us (1 / 20 calls per eval), flash / mlx {f20 / g20:.2f}; "
          f"graph building alone flash {build_only(f):.1f}, mlx {build_only(g):.1f} us")
