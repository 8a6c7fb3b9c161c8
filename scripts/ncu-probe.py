"""One launch of each CUDA kernel family on benchmark shapes, for Nsight
Compute: ncu --kernel-name regex:fa_ python3 scripts/ncu-probe.py [decode|compare]
(decode: the decode cases only; compare: the bfloat16 cases, each followed by
MLX's SDPA on the same inputs, for kernel durations of both)."""

import sys

import mlx.core as mx
from gpu_probe_calls import HD128, QWEN05B, calls


def launch(heads, L, S, dtype):
    flash, mlx = calls(heads, L, S, dtype)
    mx.eval(flash())
    mx.synchronize()
    if sys.argv[1:] == ["compare"]:
        mx.eval(mlx())
        mx.synchronize()


if sys.argv[1:] != ["decode"]:
    launch(QWEN05B, 8192, 8192, mx.bfloat16)
    if not sys.argv[1:]:
        launch(QWEN05B, 8192, 8192, mx.float32)
    launch(HD128, 4096, 4096, mx.bfloat16)
launch(QWEN05B, 1, 32768, mx.bfloat16)
launch(HD128, 1, 32768, mx.bfloat16)
