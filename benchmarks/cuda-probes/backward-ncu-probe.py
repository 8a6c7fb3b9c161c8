"""One gradient of flash_attention for each case below (causal; bfloat16, or
the dtype named), for Nsight Compute on the backward's kernels:

    ncu --kernel-name regex:fa_backward python3 benchmarks/cuda-probes/backward-ncu-probe.py [float32]

Cases: qwen05b and hd128 at L = S = 8192."""

import sys

import mlx.core as mx
from gpu_probe_calls import HD128, QWEN05B

from flashattn_core import flash_attention

dtype = getattr(mx, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
for H, H_kv, E in (QWEN05B, HD128):
    L = 8192
    q, k, v = (mx.random.normal((1, h, L, E)).astype(dtype) for h in (H, H_kv, H_kv))
    d_out = mx.random.normal(q.shape).astype(dtype)
    mx.eval(q, k, v, d_out)
    grads = mx.vjp(lambda q, k, v: flash_attention(q, k, v, mask="causal"), [q, k, v], [d_out])[1]
    mx.eval(grads)
    mx.synchronize()
