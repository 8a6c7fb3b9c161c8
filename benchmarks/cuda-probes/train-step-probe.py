"""LoRA steps of flash-eval train's protocol (eager; COMPILE=1 compiled, as
flash-eval train runs them by default), patch off or on, under PyTorch's profiler (CUPTI: every kernel of the process, MLX's too), to
compare where a step's GPU time goes (train-step-profile.sh):

    python3 train-step-probe.py MODEL off|on native|float32 LENGTH OUT.tsv

Three warm-up steps, five timed (wall ms a step, and of it the host's
graph build before `mx.eval`), then `STEPS` (default 3) profiled; OUT.tsv: ms a
step, launches a step and name of each kernel; printed: the GPU's busy time
a profiled step (the union of its kernels' and copies' intervals) against
the step's wall time, so that time outside the kernels shows as idle."""

import os
import statistics
import sys
import time

import mlx.core as mx
import mlx.optimizers as optim

from flash_eval.models import load_model
from flash_eval.setting import patch_setting
from flash_eval.train import make_step, prepare

model_dir, patch, precision, length = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
lm = load_model(model_dir, "bfloat16", quiet=True)
prepare(lm.model, "lora", 16, 0)
batch = mx.random.randint(0, 1000, (1, length + 1))
optimizer = optim.Adam(learning_rate=1e-5)
step = make_step(lm.model, optimizer, compiled=os.environ.get("COMPILE") == "1")


def one_step():
    start = time.perf_counter()
    loss = step(batch)
    built = time.perf_counter()
    mx.eval(loss, lm.model.trainable_parameters(), optimizer.state)
    mx.synchronize()
    return built - start, time.perf_counter() - start


def busy_ms(prof) -> float:
    """The union of the GPU activities' intervals (kernels, copies, fills)."""
    import torch

    spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0)
    total, end = 0, None
    for a, b in spans:
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total / 1e6


with patch_setting(patch, precision):
    for _ in range(3):
        one_step()
    timed = [one_step() for _ in range(5)]
    print(f"{patch} {precision} {length}: wall ms a step (median of 5) {statistics.median(t for _, t in timed) * 1e3:.2f}"
          f" (runs {', '.join(f'{t * 1e3:.1f}' for _, t in timed)}), graph build {statistics.median(b for b, _ in timed) * 1e3:.2f}")
    from torch.profiler import ProfilerActivity, profile

    steps = int(os.environ.get("STEPS", "3"))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            one_step()
        wall = (time.perf_counter() - start) / steps * 1e3
    busy = busy_ms(prof) / steps
    print(f"{patch} {precision} {length}: profiled step {wall:.2f} ms, GPU busy {busy:.2f}, idle {wall - busy:.2f}")
    # Every kernel of the process (CUPTI), MLX's included: ms a step by name.
    with open(sys.argv[5], "w") as f:
        for e in prof.key_averages():
            if e.device_time_total > 0:
                f.write(f"{e.device_time_total / 1e3 / steps:.4f}\t{e.count // steps}\t{e.key}\n")
print(f"{patch} {precision} {length}: done")
