"""One flash_attention call of each prefill case below, for Nsight Compute
(scripts/cuda-check profile runs it):

    ncu --kernel-name regex:fa_ python3 benchmarks/cuda-probes/ncu-probe.py [compare]

bfloat16 causal: qwen05b 2K and 8K, hd128 2K and 4K; float32 causal:
qwen05b 8K, hd128 8K, and hd128's mlx-lm chunk (L = 2048 queries against
S = 8192 keys). compare: each call followed by MLX's SDPA on the same
inputs, for both sides' kernel durations (ncu without the name filter)."""

import sys

import mlx.core as mx
from gpu_probe_calls import HD128, QWEN05B, calls

CASES = [
    (QWEN05B, 2048, 2048, mx.bfloat16),
    (QWEN05B, 8192, 8192, mx.bfloat16),
    (HD128, 2048, 2048, mx.bfloat16),
    (HD128, 4096, 4096, mx.bfloat16),
    (QWEN05B, 8192, 8192, mx.float32),
    (HD128, 8192, 8192, mx.float32),
    (HD128, 2048, 8192, mx.float32),
]


def launch(heads, L, S, dtype):
    flash, mlx = calls(heads, L, S, dtype)
    mx.eval(flash())
    mx.synchronize()
    if sys.argv[1:] == ["compare"]:
        mx.eval(mlx())
        mx.synchronize()


for case in CASES:
    launch(*case)
