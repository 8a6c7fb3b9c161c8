"""Short bfloat16 prefills, where cuDNN is ahead (docs/cuda.md, Limits):
a chained call's wall time as flash-eval kernel takes it (batches of 20,
each call on the last one's output, K/V copies) beside the GPU time of its
kernels (PyTorch's profiler: CUPTI sees MLX's kernels too), for ours, MLX's
SDPA and PyTorch's cuDNN SDPA. Tells kernel time from time between kernels.

    python3 benchmarks/cuda-probes/prefill-short-probe.py"""

import statistics
import time

import mlx.core as mx
import torch
from torch.profiler import ProfilerActivity, profile

from flash_eval.impls import flash_impl, make_inputs, mlx_impl, torch_impls
from flash_eval.shapes import KernelCase, SHAPES

BATCH, REPS = 20, 15


def timed(impl):
    """(wall us a call, median of REPS batches; GPU us a call by kernel name)."""
    if impl.on_mlx:
        def batch():
            outs = [impl.run()]
            for _ in range(BATCH - 1):
                outs.append(impl.chain(outs[-1]))
            mx.eval(outs)
            mx.synchronize()
    else:
        def batch():
            for _ in range(BATCH):
                impl.run()
            impl.sync()
    for _ in range(3):
        batch()
    walls = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        batch()
        walls.append((time.perf_counter() - t0) / BATCH * 1e6)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            batch()
    kernels = sorted(((e.device_time_total / REPS / BATCH, e.key) for e in prof.key_averages()
                      if e.device_time_total > 0), reverse=True)
    return statistics.median(walls), kernels


for shape, L in (("qwen05b", 2048), ("qwen05b", 4096), ("hd128", 2048), ("hd128", 4096)):
    case = KernelCase(SHAPES[shape], "prefill", L, "bfloat16")
    inp = make_inputs(case, kv_sets=BATCH)
    impls = [flash_impl(inp), mlx_impl(inp)] + [i for i in torch_impls(inp) if i.name == "torch-cudnn"]
    for impl in impls:
        wall, kernels = timed(impl)
        gpu = sum(t for t, _ in kernels)
        print(f"{shape} causal {L} {impl.name}: wall {wall:.1f} us a call, GPU {gpu:.1f}")
        for t, key in kernels[:4]:
            print(f"    {t:7.1f}  {key[:90]}")
