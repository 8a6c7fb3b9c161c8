"""What the Python probes share: flash_attention and MLX's SDPA on the same
random inputs of one benchmark shape (ncu-probe.py, host-probe.py), and how
host-probe.py and prefill-chunk-probe.py time a batch of calls, phase by
phase."""

import time

import mlx.core as mx

from flashattn_core import flash_attention

# (query heads, KV heads, head dim) of flash-eval's benchmark shapes.
QWEN05B, HD128 = (14, 2, 64), (32, 8, 128)


def calls(heads, L, S, dtype):
    """(flash, mlx): zero-argument calls of flash_attention and
    mx.fast.scaled_dot_product_attention on random (1, H, L, E) queries and
    (1, H_kv, S, E) keys and values (evaluated once here), causal when L > 1
    (prefill), unmasked for decode."""
    H, H_kv, E = heads
    q = mx.random.normal((1, H, L, E)).astype(dtype)
    k = mx.random.normal((1, H_kv, S, E)).astype(dtype)
    v = mx.random.normal((1, H_kv, S, E)).astype(dtype)
    mx.eval(q, k, v)
    mask = "causal" if L > 1 else None
    return (lambda: flash_attention(q, k, v, mask=mask),
            lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=E**-0.5, mask=mask))


BATCH, REPS = 20, 20


def phases(make, stat=min, reps=REPS):
    """Per-call us of (build, host evaluation, GPU wait, total) for BATCH
    calls an evaluation (as flash-eval times them), each phase's `stat` (the
    best, or e.g. statistics.median) over `reps` evaluations: building the
    graph (the calls' Python and C++ up to the lazy output), evaluating it on
    the host (mx.async_eval: every node's eval_gpu, MLX's CUDA graph built and
    launched) and waiting for the device (mx.synchronize). make(i, prev)
    returns the i-th call's output (prev: the last one's, None for the
    first)."""
    samples = [[] for _ in range(4)]
    mx.eval(make(0, None))
    mx.synchronize()
    for _ in range(reps):
        t0 = time.perf_counter()
        outs, prev = [], None
        for i in range(BATCH):
            prev = make(i, prev)
            outs.append(prev)
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.synchronize()
        t3 = time.perf_counter()
        for j, x in enumerate((t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            samples[j].append(x / BATCH * 1e6)
    return [stat(s) for s in samples]
