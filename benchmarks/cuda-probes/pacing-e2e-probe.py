"""Would pacing every prefill call (not only a quantized cache's) speed up the
patch's prefill end to end? One process; mlx-lm's prefill loop (steps of
2,048, a fresh KVCache, the cache evaluated after each step); the patch off,
on unpaced and on paced (MLX_FLASH_ATTENTION_PACING=all[:N]) in alternation.

    python3 benchmarks/cuda-probes/pacing-e2e-probe.py MODEL_FOLDER [ROUNDS] [PRECISION]
"""

import os
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import mlxlm_flash_patch

SETTINGS = {"off": None, "unpaced": "0", "paced": "all", "paced8k": "all:8192"}


def prefill(model, tokens, step=2048):
    cache = make_prompt_cache(model)
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    for i in range(0, tokens.shape[1], step):
        model(tokens[:, i:i + step], cache=cache)
        mx.eval([c.state for c in cache])
    mx.synchronize()
    return time.perf_counter() - start, mx.get_peak_memory() / 1e9


def main():
    model, _ = load(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    precision = sys.argv[3] if len(sys.argv) > 3 else "float32"
    print(mx.device_info().get("device_name"), f"{precision} attention, bfloat16 model, {rounds} rounds")
    for n in (2048, 4096, 8192, 16384):
        tokens = mx.random.randint(0, 30000, (1, n))
        seen = {s: [] for s in SETTINGS}
        names = list(SETTINGS)
        for r in range(rounds + 1):
            for name in (names if r % 2 == 0 else names[::-1]):
                if SETTINGS[name] is None:
                    mlxlm_flash_patch.disable()
                else:
                    mlxlm_flash_patch.enable(precision)
                    os.environ["MLX_FLASH_ATTENTION_PACING"] = SETTINGS[name]
                seconds, peak = prefill(model, tokens)
                mx.clear_cache()
                if r:
                    seen[name].append((seconds, peak))
        off = seen["off"]
        print(f"{n} tokens (ms; speed against off: median of the rounds' ratios, min-max)")
        for name, runs in seen.items():
            times = sorted(s for s, _ in runs)
            ratio = sorted(o[0] / x[0] for x, o in zip(runs, off))
            print(f"  {name:8s} median {1e3 * statistics.median(times):8.2f} (min {1e3 * times[0]:7.2f})"
                  f"  peak {statistics.median(p for _, p in runs):.3f} GB"
                  f"  vs off {statistics.median(ratio):.3f} ({ratio[0]:.3f}-{ratio[-1]:.3f})")


if __name__ == "__main__":
    main()
