"""One launch of each CUDA kernel family on benchmark shapes, for Nsight
Compute: ncu --kernel-name regex:fa_ python3 scripts/ncu-probe.py [decode|compare]
(decode: the decode cases only; compare: the bfloat16 cases, each followed by
MLX's SDPA on the same inputs, for kernel durations of both)."""

import sys

import mlx.core as mx

from flashattn_core import flash_attention


def launch(H, H_kv, E, L, S, dtype):
    q = mx.random.normal((1, H, L, E)).astype(dtype)
    k = mx.random.normal((1, H_kv, S, E)).astype(dtype)
    v = mx.random.normal((1, H_kv, S, E)).astype(dtype)
    mx.eval(q, k, v)
    mask = "causal" if L > 1 else None
    mx.eval(flash_attention(q, k, v, mask=mask))
    mx.synchronize()
    if sys.argv[1:] == ["compare"]:
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=E**-0.5, mask=mask))
        mx.synchronize()


if sys.argv[1:] != ["decode"]:
    launch(14, 2, 64, 8192, 8192, mx.bfloat16)
    if not sys.argv[1:]:
        launch(14, 2, 64, 8192, 8192, mx.float32)
    launch(32, 8, 128, 4096, 4096, mx.bfloat16)
launch(14, 2, 64, 1, 32768, mx.bfloat16)
launch(32, 8, 128, 1, 32768, mx.bfloat16)
