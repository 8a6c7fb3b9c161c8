"""Where the peak memory of a 16K prefill over a 4-bit cache goes (patch's
float32 attention against native): 24 chained attention calls alone, then a
random-weight Qwen2-0.5B-architecture model chunk by chunk.
Usage: python3 kv-memory-probe.py MODEL_FOLDER"""

import sys

import mlx.core as mx
import numpy as np

from flashattn_core import flash_attention

MiB = 2**20


def chained(precision, quantized, L=2048, S=16384, calls=24):
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 14, L, 64))).astype(mx.bfloat16)
    kvs = []
    for _ in range(calls):
        k = mx.array(rng.standard_normal((1, 2, S, 64))).astype(mx.bfloat16)
        kvs.append((tuple(mx.quantize(k, group_size=64, bits=4)), tuple(mx.quantize(k * 0.5, group_size=64, bits=4)))
                   if quantized else (k, k * 0.5))
    mx.eval(q, kvs)
    dtype = mx.float32 if precision == "float32" else None

    def run():
        x = q
        for k, v in kvs:
            o = flash_attention(x, k, v, mask="causal", dtype=dtype, stream=mx.gpu)
            x = o.astype(mx.bfloat16) * 0.5 + q
        return x

    mx.eval(run())
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(run())
    print(f"chained {calls} calls {precision:8s} {'4-bit' if quantized else 'bf16 '}: "
          f"{(mx.get_peak_memory() - before) / MiB / calls:6.1f} MiB a call")


def model_prefill(path, precision):
    import mlxlm_flash_patch
    from mlx_lm import load
    from mlx_lm.models.cache import QuantizedKVCache

    model, _ = load(path)
    tokens = mx.array(np.random.default_rng(1).integers(0, 1000, 16384))
    with mlxlm_flash_patch.patched(precision):
        cache = [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
        peaks = []
        for i in range(0, 16384, 2048):
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            model(tokens[None, i:i + 2048], cache=cache)
            mx.eval([c.state for c in cache])
            peaks.append(f"{(mx.get_peak_memory() - base) / MiB:.0f}")
    print(f"model {precision:8s}: extra MiB per chunk {' '.join(peaks)}; stats {mlxlm_flash_patch.stats()}")


for precision in ("float32", "native"):
    for quantized in (True, False):
        chained(precision, quantized)
for precision in ("float32", "native"):
    model_prefill(sys.argv[1], precision)
