"""Does pacing (mlxlm_flash_patch/pacing.py) cost a quantized-cache prefill
time? One process, the patch on, a 4-bit cache; paced and unpaced passes in
alternation over the same prompt, mlx-lm's prefill loop (steps of 2,048).

    python3 benchmarks/cuda-probes/pacing-probe.py MODEL_FOLDER [ROUNDS]
"""

import os
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import QuantizedKVCache

import mlxlm_flash_patch
from mlxlm_flash_patch import pacing


def prefill(model, tokens, step=2048):
    cache = [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    for i in range(0, tokens.shape[1], step):
        model(tokens[:, i:i + step], cache=cache)
        mx.eval([c.state for c in cache])
    mx.synchronize()
    return time.perf_counter() - start, mx.get_peak_memory() / 1e9


VARIANTS = {  # name: (GROUP, DEPTH, MIN_KEYS), None: unpaced
    "unpaced": None, "g1d2": (1, 2, 0), "g1d4": (1, 4, 0), "g2d2": (2, 2, 0), "g4d1": (4, 1, 0),
    "g1d2k8k": (1, 2, 8192), "g2d2k8k": (2, 2, 8192),
}


def run(model, n, rounds, precision):
    mlxlm_flash_patch.enable(precision)
    tokens = mx.random.randint(0, 30000, (1, n))
    seen = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    for r in range(rounds + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            knobs = VARIANTS[name]
            os.environ[pacing.ENV] = "0" if knobs is None else "1"
            if knobs:
                pacing.GROUP, pacing.DEPTH, pacing.MIN_KEYS = knobs
            seconds, peak = prefill(model, tokens)
            mx.clear_cache()
            if r:  # the first round warms up
                seen[name].append((seconds, peak))
    print(f"{n} tokens, {precision} attention, 4-bit cache, {rounds} rounds (ms, GB; speed against unpaced by round)")
    base = seen["unpaced"]
    for name, runs in seen.items():
        times = sorted(s for s, _ in runs)
        ratio = sorted(u[0] / p[0] for p, u in zip(runs, base))
        print(f"  {name:8s} median {1e3 * statistics.median(times):8.2f} (min {1e3 * times[0]:7.2f}, max {1e3 * times[-1]:7.2f})"
              f"  peak median {statistics.median(p for _, p in runs):.3f} max {max(p for _, p in runs):.3f}"
              f"  speed {statistics.median(ratio):.3f} ({ratio[0]:.3f}-{ratio[-1]:.3f})")


def main():
    path = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    model, _ = load(path)
    print(mx.device_info().get("device_name"))
    configs = ((4096, "float32"), (16384, "float32"), (16384, "native"), (8192, "float32"), (2048, "float32"))
    if "PROBE_N" in os.environ:  # one length, float32 attention
        configs = ((int(os.environ["PROBE_N"]), "float32"),)
    for n, precision in configs:
        run(model, n, rounds, precision)


if __name__ == "__main__":
    main()
