"""LoRA steps of flash-eval train's protocol, patch off or on, under
PyTorch's profiler (CUPTI: every kernel of the process, MLX's too), to
compare where a step's GPU time goes (train-step-profile.sh):

    python3 train-step-probe.py MODEL off|on native|float32 LENGTH OUT.tsv

Three warm-up steps, then `STEPS` (default 3) profiled; OUT.tsv: ms a step,
launches a step and name of each kernel."""

import os
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from flash_eval.models import load_model
from flash_eval.setting import patch_setting
from flash_eval.train import loss_fn, prepare

model_dir, patch, precision, length = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
lm = load_model(model_dir, "bfloat16", quiet=True)
prepare(lm.model, "lora", 16, 0)
batch = mx.random.randint(0, 1000, (1, length + 1))
optimizer = optim.Adam(learning_rate=1e-5)
step = nn.value_and_grad(lm.model, loss_fn)


def one_step():
    loss, grads = step(lm.model, batch)
    optimizer.update(lm.model, grads)
    mx.eval(loss, lm.model.trainable_parameters(), optimizer.state)
    mx.synchronize()


with patch_setting(patch, precision):
    for _ in range(3):
        one_step()
    from torch.profiler import ProfilerActivity, profile

    steps = int(os.environ.get("STEPS", "3"))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step()
    # Every kernel of the process (CUPTI), MLX's included: ms a step by name.
    with open(sys.argv[5], "w") as f:
        for e in prof.key_averages():
            if e.device_time_total > 0:
                f.write(f"{e.device_time_total / 1e3 / steps:.4f}\t{e.count // steps}\t{e.key}\n")
print(f"{patch} {precision} {length}: done")
