"""One launch of each CUDA kernel family on benchmark shapes, for Nsight
Compute: ncu --kernel-name regex:fa_ python3 scripts/ncu-probe.py"""

import mlx.core as mx

from flashattn_core import flash_attention

for dtype, L, H, H_kv, E in [(mx.bfloat16, 8192, 14, 2, 64), (mx.float32, 8192, 14, 2, 64),
                             (mx.bfloat16, 4096, 32, 8, 128)]:
    q = mx.random.normal((1, H, L, E)).astype(dtype)
    k = mx.random.normal((1, H_kv, L, E)).astype(dtype)
    mx.eval(q, k)
    mx.eval(flash_attention(q, k, k, mask="causal"))
q = mx.random.normal((1, 14, 1, 64)).astype(mx.bfloat16)
k = mx.random.normal((1, 2, 32768, 64)).astype(mx.bfloat16)
mx.eval(q, k)
mx.eval(flash_attention(q, k, k))
mx.synchronize()
