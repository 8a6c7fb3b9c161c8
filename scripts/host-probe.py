"""Where a short call's time goes, 20 calls an evaluation (as flash-eval
times them): building the graph (the calls' Python and C++ up to the lazy
output), evaluating it on the host (mx.async_eval: every node's eval_gpu,
MLX's CUDA graph built and launched) and waiting for the GPU
(mx.synchronize), per call, best of 20. Also the same 20 calls chained, each
call's queries the last one's output (as a model's layers follow one
another), chained with each call on the next of several copies of K and V
(read from memory, as each layer reads its own cache), and MLX's custom-kernel path with modules of growing size (it
copies and hashes the module on every launch). `floor32k`: the qwen05b
S = 32768 bfloat16 decode chained on K / V copies, ours and MLX's SDPA,
against two kernels launched through the same custom-kernel path: one that
does nothing (the path's own cost a call) and one that only reads K and V
once (the least any decode kernel reached that way can take).

    python3 scripts/host-probe.py [floors|decode|decode32k|floor32k|bench-floor|prefill|prefill-dims|decode-dims]"""

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

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
    # size) and an empty kernel: inputs, outputs (our fused decode had out + 2
    # scratch; now one, partials.h) and
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


def kv_copies(k, v):
    """As many copies of (k, v) as flash-eval kernel takes in turn (up to
    BATCH), evaluated: call i reads copy i % n from memory."""
    n = min(BATCH, -(-KV_ROTATION_BYTES // (2 * k.nbytes)))
    kv = [(k, v)] + [(k + 0, v + 0) for _ in range(n - 1)]
    mx.eval(kv)
    return kv


def attention(cases):
    """Each case (name, heads, L, S, dtype[, "bool"]): both implementations as
    flash-eval calls them (independent calls, unmasked decode or causal
    prefill), then chained, with the case's mask: causal prefill, unmasked
    decode, or "bool", a boolean (1, 1, L, S) mask hiding a tenth of the keys."""
    for name, heads, L, S, dtype, *kind in cases:
        if not kind:
            for impl, fn in zip(("flash", "mlx"), calls(heads, L, S, dtype)):
                show(f"{name} L={L} S={S} {dtype} {impl}", phases(lambda i, p, fn=fn: fn()))
        else:
            print(f"{name} L={L} S={S} {dtype} mask {kind[0]}")
        H, H_kv, E = heads
        q, k, v = (mx.random.normal((1, h, n, E)).astype(dtype) for h, n in ((H, L), (H_kv, S), (H_kv, S)))
        mask = mx.random.uniform(shape=(1, 1, L, S)) > 0.1 if kind else "causal" if L > 1 else None
        mx.eval(q, k, v, *([mask] if kind else []))
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


# The floor kernels (floor32k), compiled by nvcc to PTX at run time, one
# module each (MLX copies and hashes a module's bytes every launch, ~0.2 us a
# KB, so neither carries the other's code).
FLOOR_CU = r"""
#include <cstdint>
// Block 0 copies the queries to the output: the chained call's next input.
__device__ __forceinline__ void pass_queries(const uint32_t* q, uint32_t* out, int q_words) {
  if (blockIdx.x != 0) return;
  for (int i = threadIdx.x; i < q_words; i += blockDim.x) out[i] = q[i];
}
#ifdef EMPTY
extern "C" __global__ void floor_empty(const uint32_t* q, const uint4* k, const uint4* v, uint32_t* out,
                                       int n16, int q_words) {
  pass_queries(q, out, q_words);
}
#else
// Reads every 16 bytes of K and V once, eight loads in flight a thread.
extern "C" __global__ void floor_read(const uint32_t* q, const uint4* k, const uint4* v, uint32_t* out,
                                      int n16, int q_words) {
  const int stride = gridDim.x * blockDim.x;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 a[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      a[j] = k[i + j * stride];
      a[4 + j] = v[i + j * stride];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= a[j].x ^ a[j].y ^ a[j].z ^ a[j].w;
  }
  for (; i < n16; i += stride) {
    const uint4 a = k[i], b = v[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;  // never on random data, but the loads must stay
  pass_queries(q, out, q_words);
}
#endif
"""


def floor_modules():
    """{kernel name: PTX bytes} of the floor kernels, for this GPU's arch."""
    arch = mx.device_info()["architecture"]  # sm_90 on an H100 / H200
    modules = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "floor.cu")
        with open(src, "w") as f:
            f.write(FLOOR_CU)
        for name, defines in (("floor_empty", ["-DEMPTY"]), ("floor_read", [])):
            ptx = Path(tmp) / (name + ".ptx")
            subprocess.check_call(["nvcc", "-ptx", f"-arch={arch}", "-O3", *defines, "-o", str(ptx), src])
            modules[name] = ptx.read_bytes()
    return modules


# Blocks of each floor kernel: 4 a SM of an H100 / H200 (any count reads it all).
FLOOR_BLOCKS = {"floor_empty": 1, "floor_read": 4 * 132}


def floor_attention(modules, name):
    """Floor kernel `name` as an attention function (q, k, v) -> q-shaped
    output, launched through MLX's custom-kernel path as ours are."""
    def attention(q, k, v, scale=None, mask=None):
        return mx.fast.precompiled_cuda_kernel(
            name=name, compiled_source=modules[name], inputs=[q, k, v], output_shapes=[q.shape],
            output_dtypes=[q.dtype], scalars=[k.nbytes // 16, q.nbytes // 4],
            grid=(FLOOR_BLOCKS[name] * 256, 1, 1), threadgroup=(256, 1, 1))[0]
    return attention


def floors_32k():
    """The qwen05b S = 32768 bfloat16 decode, chained on K / V copies: ours,
    MLX's SDPA and the two floor kernels, best and median of 20 evaluations,
    in one run."""
    H, H_kv, E = QWEN05B
    S, dtype = 32768, mx.bfloat16
    q = mx.random.normal((1, H, 1, E)).astype(dtype)
    k, v = (mx.random.normal((1, H_kv, S, E)).astype(dtype) for _ in range(2))
    mx.eval(q, k, v)
    kv = kv_copies(k, v)
    n = len(kv)
    modules = floor_modules()

    def floor(name):
        attention = floor_attention(modules, name)
        return lambda i, p: attention(q if p is None else p, *kv[i % n])

    impls = {
        "MLX SDPA": lambda i, p: mx.fast.scaled_dot_product_attention(q if p is None else p, *kv[i % n],
                                                                      scale=E**-0.5),
        "flash_attention": lambda i, p: flash_attention(q if p is None else p, *kv[i % n]),
        "floor: empty kernel": floor("floor_empty"),
        "floor: reads K, V once": floor("floor_read"),
    }
    print(f"qwen05b decode S = {S} bfloat16, chained on {n} K/V copies, {BATCH} calls an evaluation; "
          f"module bytes: empty {len(modules['floor_empty'])}, read {len(modules['floor_read'])}; "
          f"read grid {FLOOR_BLOCKS['floor_read']} blocks")
    rows = {}
    for rnd in range(3):  # interleaved rounds: the same drift for all
        for name, fn in impls.items():
            # best and median of the same evaluations
            both = phases(fn, stat=lambda x: (min(x), statistics.median(x)))
            rows.setdefault(name, []).append(([b for b, _ in both], [m for _, m in both]))
    mlx_best = [r[0][3] for r in rows["MLX SDPA"]]
    mlx_med = [r[1][3] for r in rows["MLX SDPA"]]
    for name, runs in rows.items():
        for rnd, (best, med) in enumerate(runs):
            show(f"round {rnd} {name} best", best)
            print(f"{'':44s} median total {med[3]:6.1f} us; of MLX's: best {best[3] / mlx_best[rnd]:.2f}x, "
                  f"median {med[3] / mlx_med[rnd]:.2f}x")


def bench_floor_32k(rounds=3):
    """floor32k's four calls timed exactly as `flash-eval kernel` times the
    decode (measure.measure: batches of 20 chained calls an evaluation, on
    the benchmark's K / V copies, medians), interleaved rounds: how close
    to half MLX's time a kernel launched through MLX's custom-kernel path
    can come as the benchmark measures it."""
    from flash_eval.impls import make_inputs, mlx_call
    from flash_eval.kernel import kv_sets_for
    from flash_eval.measure import measure
    from flash_eval.shapes import SHAPES, KernelCase

    case = KernelCase(SHAPES["qwen05b"], "decode", 32768, "bfloat16")
    inp = make_inputs(case, 0, kv_sets_for(case, 0, True))
    modules = floor_modules()
    fns = {"MLX SDPA": mx.fast.scaled_dot_product_attention, "flash_attention": flash_attention,
           "floor: empty kernel": floor_attention(modules, "floor_empty"),
           "floor: reads K, V once": floor_attention(modules, "floor_read")}
    print(f"{case.label} bfloat16 as flash-eval kernel times it: {len(inp.kv_sets)} K/V sets, chained")
    medians = {name: [] for name in fns}
    for rnd in range(rounds):
        for name, fn in fns.items():
            call = mlx_call(inp, fn)
            _, m = measure(lambda: call(inp.q), repeats=10, chain=call)
            medians[name].append(m.median_s * 1e6)
    for name, us in medians.items():
        ratios = " ".join(f"{a / b:.2f}x" for a, b in zip(us, medians["MLX SDPA"]))
        print(f"{name:28s} " + " ".join(f"{u:6.1f}" for u in us) + f" us a call; of MLX's: {ratios}")


DECODE = [("qwen05b", QWEN05B, 1, 8192, mx.bfloat16), ("qwen05b", QWEN05B, 1, 32768, mx.bfloat16),
          ("qwen05b", QWEN05B, 1, 32768, mx.float32), ("hd128", HD128, 1, 32768, mx.bfloat16)]
PREFILL = [("qwen05b", QWEN05B, 8192, 8192, mx.bfloat16), ("hd128", HD128, 4096, 4096, mx.bfloat16)]
# Phi-2's and Phi-3-mini's heads (flash-eval's hd80, hd96).
PREFILL_DIMS = [("hd80", (32, 32, 80), 2048, 2048, mx.bfloat16), ("hd96", (32, 32, 96), 2048, 2048, mx.bfloat16),
                ("hd96", (32, 32, 96), 8192, 8192, mx.bfloat16)]

DECODE_32K = [c for c in DECODE if c[3] == 32768 and c[0] == "qwen05b"]
# Decode at the other head dims (flash-eval's hd80, hd96, hd256) and with a
# boolean mask: the patch's float32 attention on a 16-bit model among them.
DECODE_DIMS = [(name, heads, 1, S, mx.bfloat16) for name, heads in (("hd80", (32, 32, 80)), ("hd96", (32, 32, 96)),
                                                                    ("hd256", (8, 4, 256))) for S in (8192, 32768)]
DECODE_DIMS += [("qwen05b", QWEN05B, 1, 32768, mx.bfloat16, "bool"), ("hd128", HD128, 1, 32768, mx.bfloat16, "bool")]

mode = sys.argv[1] if len(sys.argv) > 1 else "all"
if mode == "floor32k":
    floors_32k()
if mode == "bench-floor":
    bench_floor_32k()
if mode == "decode32k":
    attention(DECODE_32K)
if mode in ("all", "floors"):
    custom_kernel_costs()
if mode in ("all", "decode"):
    attention(DECODE)
if mode in ("all", "prefill"):
    attention(PREFILL)
if mode == "prefill-dims":
    attention(PREFILL_DIMS)
if mode == "decode-dims":
    attention(DECODE_DIMS)
