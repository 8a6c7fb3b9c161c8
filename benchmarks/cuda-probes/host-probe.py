"""Where a prefill call's time goes, 20 calls an evaluation (as flash-eval
times them): building the graph (the calls' Python and C++ up to the lazy
output), evaluating it on the host (mx.async_eval: every node's eval_gpu,
MLX's CUDA graph built and launched) and waiting for the GPU
(mx.synchronize), per call, best of 20. Each case: flash_attention and MLX's
SDPA as independent calls, then chained (each call's queries the last one's
output, as a model's layers follow one another), then chained on several
copies of K and V taken in turn (read from memory, as each layer reads its
own cache); for 16-bit inputs also the patch's float32 attention, by casting
the inputs and by dtype=float32 (the 16-bit inputs read in place).

    python3 benchmarks/cuda-probes/host-probe.py [prefill|dims|short]

prefill (the default): qwen05b causal 8K and hd128 causal 4K, bfloat16;
dims: hd80 2K and hd96 2K / 8K, bfloat16; short: qwen05b and hd128 causal
2K, bfloat16 (calls whose host work outlasts their kernel)."""

import sys

import mlx.core as mx
from flashattn_core import flash_attention
from flash_eval.kernel import KV_ROTATION_BYTES
from gpu_probe_calls import BATCH, HD128, QWEN05B, calls, phases


def show(name, b):
    print(f"{name:44s} build {b[0]:6.1f}  host eval {b[1]:6.1f}  GPU wait {b[2]:6.1f}  total {b[3]:6.1f} us")


def kv_copies(k, v):
    """As many copies of (k, v) as flash-eval kernel takes in turn (up to
    BATCH), evaluated: call i reads copy i % n from memory."""
    n = min(BATCH, -(-KV_ROTATION_BYTES // (2 * k.nbytes)))
    kv = [(k, v)] + [(k + 0, v + 0) for _ in range(n - 1)]
    mx.eval(kv)
    return kv


def attention(cases):
    """Each case (name, heads, L, S, dtype), causal: both implementations as
    flash-eval calls them (independent calls), then chained."""
    for name, heads, L, S, dtype in cases:
        for impl, fn in zip(("flash", "mlx"), calls(heads, L, S, dtype)):
            show(f"{name} L={L} S={S} {dtype} {impl}", phases(lambda i, p, fn=fn: fn()))
        H, H_kv, E = heads
        q, k, v = (mx.random.normal((1, h, n, E)).astype(dtype) for h, n in ((H, L), (H_kv, S), (H_kv, S)))
        mask = "causal"
        mx.eval(q, k, v)
        chained = {
            "flash": lambda i, p: flash_attention(q if p is None else p, k, v, mask=mask),
            "mlx": lambda i, p: mx.fast.scaled_dot_product_attention(q if p is None else p, k, v, scale=E**-0.5,
                                                                     mask=mask),
        }
        for impl, fn in chained.items():
            show(f"  chained {impl}", phases(fn))
        # Chained again, call i on copy i % n of K and V: from memory.
        kv = kv_copies(k, v)
        n = len(kv)
        rotated = {
            "flash": lambda i, p: flash_attention(q if p is None else p, *kv[i % n], mask=mask),
            "mlx": lambda i, p: mx.fast.scaled_dot_product_attention(q if p is None else p, *kv[i % n],
                                                                     scale=E**-0.5, mask=mask),
        }
        if dtype != mx.float32:
            # The patch's float32 precision on a 16-bit model: q, k, v cast to
            # float32 and the result cast back, or dtype=float32 (the kernels
            # read the 16-bit inputs in place).
            f32 = mx.float32
            rotated["patch, cast"] = lambda i, p: flash_attention(
                *((q if p is None else p).astype(f32), kv[i % n][0].astype(f32), kv[i % n][1].astype(f32)),
                mask=mask).astype(dtype)
            rotated["patch, dtype=float32"] = lambda i, p: flash_attention(
                q if p is None else p, *kv[i % n], mask=mask, dtype=f32).astype(dtype)
        for impl, fn in rotated.items():
            show(f"  chained, {n} K/V copies {impl}", phases(fn))
        del kv


PREFILL = [("qwen05b", QWEN05B, 8192, 8192, mx.bfloat16), ("hd128", HD128, 4096, 4096, mx.bfloat16)]
# Phi-2's and Phi-3-mini's heads (flash-eval's hd80, hd96).
PREFILL_DIMS = [("hd80", (32, 32, 80), 2048, 2048, mx.bfloat16), ("hd96", (32, 32, 96), 2048, 2048, mx.bfloat16),
                ("hd96", (32, 32, 96), 8192, 8192, mx.bfloat16)]

PREFILL_SHORT = [("qwen05b", QWEN05B, 2048, 2048, mx.bfloat16), ("hd128", HD128, 2048, 2048, mx.bfloat16)]

modes = {"prefill": PREFILL, "dims": PREFILL_DIMS, "short": PREFILL_SHORT}
mode = sys.argv[1] if len(sys.argv) > 1 else "prefill"
if mode not in modes:
    sys.exit(f"unknown mode {mode!r}: {', '.join(modes)}")
attention(modes[mode])
