"""`flash-eval demo`: flash_attention next to MLX's SDPA on one Qwen2-0.5B-shaped
causal prefill, with the error of each against a float64 reference."""

from __future__ import annotations

import math

import click
import mlx.core as mx
import numpy as np
from threadpoolctl import threadpool_limits
from rich.console import Console
from rich.table import Table

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, relative_error, to_float64

from .measure import measure, milliseconds, mib

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@click.command()
@click.option("-L", "--length", default=1024, show_default=True, type=click.IntRange(1, 65536),
              help="Prompt length (L = S).")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True)
@click.option("-n", "--repeats", default=3, show_default=True, type=click.IntRange(1, 100))
@click.option("--seed", default=0, show_default=True)
def demo(length, dtype, repeats, seed):
    """Qwen2-0.5B attention (14 query heads, 2 KV heads, E = 64), causal."""
    H_q, H_kv, E = 14, 2, 64
    key = mx.random.key(seed)
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((1, H_q, length, E), key=kq).astype(DTYPES[dtype])
    k = mx.random.normal((1, H_kv, length, E), key=kk).astype(DTYPES[dtype])
    v = mx.random.normal((1, H_kv, length, E), key=kv).astype(DTYPES[dtype])
    mx.eval(q, k, v)
    scale = 1 / math.sqrt(E)

    console = Console()
    console.print(
        f"Qwen2-0.5B-shaped causal prefill: queries (1, {H_q}, {length}, {E}), "
        f"keys/values (1, {H_kv}, {length}, {E}), {dtype}, device {mx.default_device()}"
    )
    # One BLAS thread: NumPy's OpenBLAS workers spin after a call and would
    # steal the cores from the timings that follow.
    with console.status("float64 reference"), threadpool_limits(limits=1, user_api="blas"):
        ref = attention_reference(q, k, v, scale=scale, mask="causal")
    runs = {
        "flash_attention": lambda: flash_attention(q, k, v, scale=scale, mask="causal"),
        "mx.fast SDPA": lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask="causal"
        ),
    }
    table = Table(title=f"median of {repeats}")
    for column in ("implementation", "max abs error", "rel. error", "time", "peak extra memory"):
        table.add_column(column, justify="left" if column == "implementation" else "right")
    for name, fn in runs.items():
        with console.status(name):
            out, m = measure(fn, repeats=repeats)
        err = np.abs(to_float64(out) - ref).max()
        table.add_row(name, f"{err:.2e}", f"{relative_error(out, ref):.2e}",
                      milliseconds(m.median_s), mib(m.peak_extra_bytes))
    console.print(table)
