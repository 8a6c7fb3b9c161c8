"""Where a short call's time goes, 20 calls an evaluation (as flash-eval
times them): building the graph (the calls' Python and C++ up to the lazy
output), evaluating it on the host (mx.async_eval: every node's eval_gpu,
MLX's CUDA graph built and launched) and waiting for the GPU
(mx.synchronize), per call, best of 20. Also the same 20 calls chained, each
call's queries the last one's output (as a model's layers follow one
another), chained with each call on the next of several copies of K and V
(read from memory, as each layer reads its own cache), and MLX's custom-kernel path with modules of growing size (it
copies and hashes the module on every launch).

    python3 scripts/host-probe.py [floors|decode|decode32k|prefill]"""

import sys

import mlx.core as mx
from flashattn_core import flash_attention
from flash_eval.kernel import KV_ROTATION_BYTES
from gpu_probe_calls import BATCH, HD128, QWEN05B, calls, phases


def show(name, b):
    print(f"{name:44s} build {b[0]:6.1f}  host eval {b[1]:6.1f}  GPU wait {b[2]:6.1f}  total {b[3]:6.1f} us")


COPY_PTX = """
.visible .entry probe_copy(.param .u64 a, .param .u64 out)
{
  .reg .b64 %rd<6>; .reg .b32 %r<3>; .reg .f32 %f<2>; .reg .pred %p<2>;
  ld.param.u64 %rd1, [a]; ld.param.u64 %rd2, [out];
  mov.u32 %r1, %tid.x; setp.ge.u32 %p1, %r1, 16; @%p1 ret;
  mul.wide.u32 %rd3, %r1, 4; add.s64 %rd4, %rd1, %rd3; add.s64 %rd5, %rd2, %rd3;
  ld.global.f32 %f1, [%rd4]; st.global.f32 [%rd5], %f1;
  ret;
}
"""
EMPTY_PTX = ".visible .entry probe_copy() { ret; }\n"


def ptx_module(entry, pad_bytes):
    """A PTX module of one entry point, padded with pad_bytes of comment."""
    line = "// " + "x" * 76 + "\n"
    return (".version 8.0\n.target sm_80\n.address_size 64\n" + entry + line * (pad_bytes // len(line))).encode()


def custom_kernel_costs():
    a = mx.ones((16,))
    mx.eval(a)
    show("mx add (one node)", phases(lambda i, p: a + 1.0))
    for kb in (0, 8, 16, 32, 64):
        src = ptx_module(COPY_PTX, kb * 1024)
        run = lambda i, p, src=src: mx.fast.precompiled_cuda_kernel(
            name="probe_copy", compiled_source=src, inputs=[a], output_shapes=[(16,)],
            output_dtypes=[mx.float32], scalars=[], grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
        show(f"precompiled trivial, module {len(src) / 1024:5.1f} KB", phases(run))
    # MLX's custom-kernel costs with an 18 KB module (the tensor-core decode's
    # size) and an empty kernel: inputs, outputs (ours: out + 2 scratch) and
    # scalars (ours: 20) added one kind at a time.
    src = ptx_module(EMPTY_PTX, 18 * 1024)
    for n_in, outs, n_sc in ((1, 1, 0), (5, 1, 0), (1, 3, 0), (1, 1, 20), (5, 3, 20), (3, 3, 20), (5, 2, 20),
                             (5, 3, 15), (3, 2, 15)):
        shapes = [(16,), (64 * 14 * 64,), (64 * 14 * 2 + 2 * 2 * 65,)][:outs]
        run = lambda i, p, n_in=n_in, shapes=shapes, n_sc=n_sc: mx.fast.precompiled_cuda_kernel(
            name="probe_copy", compiled_source=src, inputs=[a] * n_in, output_shapes=shapes,
            output_dtypes=[mx.float32] * len(shapes), scalars=[7] * n_sc, grid=(32, 1, 1),
            threadgroup=(32, 1, 1))[0]
        show(f"empty 18 KB: {n_in} in, {outs} out, {n_sc} scalars", phases(run))


def attention(cases):
    """Each case (name, heads, L, S, dtype): both implementations as flash-eval
    calls them (independent calls), then chained."""
    for name, heads, L, S, dtype in cases:
        for impl, fn in zip(("flash", "mlx"), calls(heads, L, S, dtype)):
            show(f"{name} L={L} S={S} {dtype} {impl}", phases(lambda i, p, fn=fn: fn()))
        H, H_kv, E = heads
        q, k, v = (mx.random.normal((1, h, n, E)).astype(dtype) for h, n in ((H, L), (H_kv, S), (H_kv, S)))
        mx.eval(q, k, v)
        mask = "causal" if L > 1 else None
        chained = {
            "flash": lambda i, p: flash_attention(q if p is None else p, k, v, mask=mask),
            "mlx": lambda i, p: mx.fast.scaled_dot_product_attention(q if p is None else p, k, v, scale=E**-0.5,
                                                                     mask=mask),
        }
        for impl, fn in chained.items():
            show(f"  chained {impl}", phases(fn))
        # Chained again, call i on copy i % n of K and V (as many as
        # flash-eval kernel takes, up to BATCH): from memory.
        n = min(BATCH, -(-KV_ROTATION_BYTES // (2 * k.nbytes)))
        kv = [(k, v)] + [(k + 0, v + 0) for _ in range(n - 1)]
        mx.eval(kv)
        rotated = {
            "flash": lambda i, p: flash_attention(q if p is None else p, *kv[i % n], mask=mask),
            "mlx": lambda i, p: mx.fast.scaled_dot_product_attention(q if p is None else p, *kv[i % n],
                                                                     scale=E**-0.5, mask=mask),
        }
        if dtype != mx.float32:
            # The patch's float32 precision on a 16-bit model, as it was
            # (q, k, v cast to float32, the result cast back) and as it is
            # (dtype=float32: the decode reads the 16-bit K / V).
            f32 = mx.float32
            rotated["patch, cast"] = lambda i, p: flash_attention(
                *((q if p is None else p).astype(f32), kv[i % n][0].astype(f32), kv[i % n][1].astype(f32)),
                mask=mask).astype(dtype)
            rotated["patch, dtype=float32"] = lambda i, p: flash_attention(
                q if p is None else p, *kv[i % n], mask=mask, dtype=f32).astype(dtype)
        for impl, fn in rotated.items():
            show(f"  chained, {n} K/V copies {impl}", phases(fn))
        del kv


DECODE = [("qwen05b", QWEN05B, 1, 8192, mx.bfloat16), ("qwen05b", QWEN05B, 1, 32768, mx.bfloat16),
          ("qwen05b", QWEN05B, 1, 32768, mx.float32), ("hd128", HD128, 1, 32768, mx.bfloat16)]
PREFILL = [("qwen05b", QWEN05B, 8192, 8192, mx.bfloat16), ("hd128", HD128, 4096, 4096, mx.bfloat16)]

DECODE_32K = [c for c in DECODE if c[3] == 32768 and c[0] == "qwen05b"]

mode = sys.argv[1] if len(sys.argv) > 1 else "all"
if mode == "decode32k":
    attention(DECODE_32K)
if mode in ("all", "floors"):
    custom_kernel_costs()
if mode in ("all", "decode"):
    attention(DECODE)
if mode in ("all", "prefill"):
    attention(PREFILL)
