"""One gradient of flash_attention for each case below (bfloat16, causal),
for Nsight Compute on the backward's kernels:

    ncu --kernel-name regex:fa_backward python3 benchmarks/cuda-probes/backward-ncu-probe.py

Cases: qwen05b and hd128 at L = S = 8192."""

import mlx.core as mx
from gpu_probe_calls import HD128, QWEN05B

from flashattn_core import flash_attention

for H, H_kv, E in (QWEN05B, HD128):
    L = 8192
    q, k, v = (mx.random.normal((1, h, L, E)).astype(mx.bfloat16) for h in (H, H_kv, H_kv))
    d_out = mx.random.normal(q.shape).astype(mx.bfloat16)
    mx.eval(q, k, v, d_out)
    grads = mx.vjp(lambda q, k, v: flash_attention(q, k, v, mask="causal"), [q, k, v], [d_out])[1]
    mx.eval(grads)
    mx.synchronize()
