"""Where a long prompt's time goes with the patch off and on: mlx-lm
prefills a prompt in chunks of 2048 tokens (`prefill_step_size`), each
chunk's attention L = 2048 queries against the cache so far. For a
random-weight model of the given folder's architecture and dtype: the
model's forward of one chunk at cache offsets 0, 2048, 4096 and 6144 (ms,
median of REPS), patch off / on (float32 attention, the default) / on
(native); then the attention calls alone in the same shapes, as the model
makes them (queries transposed from the projection's layout, keys and
values the cache's), us a call (20 chained calls an evaluation, median).

    python3 benchmarks/cuda-probes/prefill-chunk-probe.py MODEL_FOLDER [--dtype bfloat16]

(or scripts/cuda-check probe prefill-chunk-probe.py .gpu2, which builds first)
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

import mlxlm_flash_patch
from flashattn_core import flash_attention
from gpu_probe_calls import phases

CHUNK, REPS = 2048, 7


def model_of(folder, dtype):
    config = json.loads((Path(folder) / "config.json").read_text())
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, config


def forward_ms(model, tokens, offset):
    """One chunk's forward at `offset` cached tokens, ms (median of REPS);
    the cache is filled once, then wound back to `offset` before each rep."""
    cache = make_prompt_cache(model)
    for start in range(0, offset, CHUNK):
        mx.eval(model(tokens[None, start:start + CHUNK], cache=cache), [c.state for c in cache])
    chunk = tokens[None, offset:offset + CHUNK]
    times = []
    for rep in range(REPS + 1):
        for c in cache:
            c.offset = offset
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(model(chunk, cache=cache), [c.state for c in cache])
        mx.synchronize()
        if rep:  # the first rep loads the kernels
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    model, config = model_of(args.folder, dtype)
    tokens = mx.random.randint(0, config["vocab_size"], (4 * CHUNK,))
    print(f"{mx.device_info().get('device_name', '')} model {config['model_type']} {args.dtype}, chunks of {CHUNK}")
    modes = {"off": None, "on float32": "float32", "on native": "native"}
    for offset in range(0, 4 * CHUNK, CHUNK):
        row = []
        for name, precision in modes.items():
            if precision is None:
                row.append(f"{name} {forward_ms(model, tokens, offset):7.2f}")
            else:
                with mlxlm_flash_patch.patched(precision):
                    row.append(f"{name} {forward_ms(model, tokens, offset):7.2f}")
        print(f"forward, offset {offset:5d}: " + "  ".join(row) + " ms")

    H, H_kv = config["num_attention_heads"], config["num_key_value_heads"]
    E = config["hidden_size"] // H
    for offset in range(0, 4 * CHUNK, CHUNK):
        S = offset + CHUNK
        # The projection's layout (B, L, H, E), transposed as the model does.
        q = mx.random.normal((1, CHUNK, H, E)).astype(dtype).transpose(0, 2, 1, 3)
        k, v = (mx.random.normal((1, H_kv, S, E)).astype(dtype) for _ in range(2))
        mx.eval(q, k, v)
        scale = E**-0.5

        def chained(fn):
            return lambda i, p: fn(q if p is None else p)

        impls = {
            "mlx sdpa": lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=scale, mask="causal"),
            "flash dtype=float32": lambda x: flash_attention(x, k, v, scale=scale, mask="causal",
                                                             dtype=mx.float32).astype(dtype),
            "flash cast": lambda x: flash_attention(x.astype(mx.float32), k.astype(mx.float32),
                                                    v.astype(mx.float32), scale=scale,
                                                    mask="causal").astype(dtype),
            "flash native": lambda x: flash_attention(x, k, v, scale=scale, mask="causal"),
        }
        # Total us a call (20 chained calls an evaluation), median of REPS.
        row = [f"{name} {phases(chained(fn), statistics.median, REPS)[3]:8.1f}" for name, fn in impls.items()]
        print(f"attention L={CHUNK} S={S:5d}: " + "  ".join(row) + " us")


if __name__ == "__main__":
    main()
