"""Native 16-bit prefill over a 4-bit cache: in place (fa_prefill_q_) vs the
old route (mx.dequantize into bf16 + the plain kernel) vs the plain kernel on
an unquantized cache. us a call, median (min-max) of rounds of 20 chained calls."""
import os, statistics, time
import mlx.core as mx
from flashattn_core import flash_attention

def bench(f, reps=15, batch=20):
    x = f(None); mx.eval(x); mx.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); prev = None
        for _ in range(batch):
            prev = f(prev)
        mx.eval(prev); mx.synchronize()
        ts.append((time.perf_counter() - t0) / batch * 1e6)
    return statistics.median(ts), min(ts), max(ts)

dt = mx.bfloat16
rows = []
for name, (H, Hk, E) in (("qwen05b", (14, 2, 64)), ("hd128", (32, 8, 128))):
    for L, S in ((2048, 2048), (8192, 8192), (2048, 16384)):
        q = mx.random.normal((1, H, L, E)).astype(dt)
        k = mx.random.normal((1, Hk, S, E)).astype(dt)
        v = mx.random.normal((1, Hk, S, E)).astype(dt)
        kq, vq = mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4)
        kd = mx.dequantize(*kq, group_size=64, bits=4); vd = mx.dequantize(*vq, group_size=64, bits=4)
        mx.eval(q, kq, vq, kd, vd)
        chain = lambda prev: q if prev is None else (q + prev * 0)
        inplace = lambda p: flash_attention(chain(p), kq, vq, mask="causal")
        old = lambda p: flash_attention(chain(p), mx.dequantize(*kq, group_size=64, bits=4, dtype=dt),
                                        mx.dequantize(*vq, group_size=64, bits=4, dtype=dt), mask="causal")
        plain = lambda p: flash_attention(chain(p), kd, vd, mask="causal")
        a, b, c = bench(inplace), bench(old), bench(plain)
        err = mx.abs(inplace(None).astype(mx.float32) - plain(None).astype(mx.float32)).max().item()
        rows.append((f"{name} L={L} S={S}", a, b, c, err))
print(f"GPU: {mx.device_info().get('device_name', '?')}  images: {os.environ.get('FLASHATTN_CUDA_IMAGE', 'default')}")
print(f"{'case':26s} {'in place':>18s} {'dequant+plain':>18s} {'plain bf16':>18s}  in/old  in/plain  max|in-plain|")
for n, a, b, c, e in rows:
    print(f"{n:26s} {a[0]:8.1f} ({a[1]:.0f}-{a[2]:.0f}) {b[0]:8.1f} ({b[1]:.0f}-{b[2]:.0f}) {c[0]:8.1f} ({c[1]:.0f}-{c[2]:.0f})  {a[0]/b[0]:.2f}x  {a[0]/c[0]:.2f}x  {e:.2e}")
