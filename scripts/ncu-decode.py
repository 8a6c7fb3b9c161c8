"""One launch of each decode case, for Nsight Compute:
ncu --kernel-name regex:fa_ python3 scripts/ncu-decode.py"""

import mlx.core as mx

from flashattn_core import flash_attention

for H, H_kv, E, S in [(14, 2, 64, 32768), (32, 8, 128, 32768)]:
    q = mx.random.normal((1, H, 1, E)).astype(mx.bfloat16)
    k = mx.random.normal((1, H_kv, S, E)).astype(mx.bfloat16)
    v = mx.random.normal((1, H_kv, S, E)).astype(mx.bfloat16)
    mx.eval(q, k, v)
    mx.eval(flash_attention(q, k, v))
    mx.synchronize()
