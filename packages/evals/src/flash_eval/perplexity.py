"""`flash-eval perplexity`: perplexity of a model on a text with the patch off
and on, side by side.

Protocol: the text is tokenized once and its first `--tokens` tokens are cut
into windows of `--context` tokens, `--stride` apart. With the default stride
(= context) the windows do not overlap and each scores all its tokens but the
first (what `mlx_lm.perplexity` does, in order rather than sampled); a smaller
stride gives Hugging Face's sliding window: each window scores only its last
`stride` tokens, with the rest as context. Perplexity = exp(mean negative
log-likelihood), ± its standard error (exp of the mean's standard error,
linearised: ppl x SE(nll)), over the same scored tokens for every setting.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import click
import mlx.core as mx
import mlx.nn as nn
import numpy as np

import mlxlm_flash_patch

from . import blas, distributed, kv_cache
from .distributed import Ranks
from .kv_cache import KVCacheSetting, kv_cache_options
from .models import EMBEDDED, MODEL_HELP, ModelError, load_model
from .options import comma_list
from .progress import progress_bar
from .setting import patch_setting
from .texts import TextError, load_text


@dataclass
class Window:
    start: int  # first token of the window in the text
    length: int
    scored_from: int  # index inside the window of the first scored target


def windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows over tokens[0:n_tokens]. Non-overlapping (stride = context):
    each scores all its tokens but the first. Sliding (stride < context): each
    scores only the tokens no earlier window scored, so every token but the
    text's first is scored exactly once."""
    if stride >= context:
        return [Window(s, min(context, n_tokens - s), 1) for s in range(0, n_tokens - 1, context)]
    out, start, scored_until = [], 0, 1
    while scored_until < n_tokens:
        end = min(start + context, n_tokens)
        out.append(Window(start, end - start, scored_until - start))
        scored_until = end
        start += stride
    return out


def tokenize(tokenizer, text: str) -> np.ndarray:
    """The whole text at once; transformers' warning that it is longer than
    the model's context is moot here (it is cut into windows)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return np.array(tokenizer.encode(text), dtype=np.int32)
    finally:
        hf_logging.set_verbosity(verbosity)


def window_nll(model, tokens: np.ndarray, w: Window, kv: KVCacheSetting) -> np.ndarray:
    """Negative log-likelihoods of the window's scored tokens. With a
    quantized KV cache the window goes through a fresh one, so that attention
    reads the quantized keys and values as generation's prefill would; the
    ordinary run needs no cache (as mlx_lm.perplexity)."""
    x = mx.array(tokens[w.start : w.start + w.length][None])
    cache = kv_cache.make_cache(model, kv) if kv.quantized else None
    logits = model(x[:, :-1], cache=cache).astype(mx.float32)
    nll = nn.losses.cross_entropy(logits, x[:, 1:], reduction="none")[0]
    return np.array(nll[w.scored_from - 1 :])  # target j predicts token j + 1


def run_setting(lm, tokens, plan, patch: str, precision: str, kv: KVCacheSetting, quiet: bool,
                ranks: Ranks) -> dict:
    """This rank's windows (every size-th one), then the sums of all ranks."""
    mine = plan[ranks.rank :: ranks.size]
    with patch_setting(patch, precision):  # warm-up, untimed: lazy weight loading, kernel loading, allocator
        if mine:
            window_nll(lm.model, tokens, mine[0], kv)
    mlxlm_flash_patch.reset_stats()
    ctx = patch_setting(patch, precision)
    nll = [np.zeros(0)]
    ranks.barrier()
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    with ctx, progress_bar(len(mine), f"patch {patch}", quiet or not ranks.is_main) as advance:
        for w in mine:
            nll.append(window_nll(lm.model, tokens, w, kv))
            advance()
    seconds = time.perf_counter() - start
    nll = np.concatenate(nll).astype(np.float64)
    stats = mlxlm_flash_patch.stats()
    # Every reason the patch counted on any rank, in one order on all ranks
    # (sum64 adds position by position).
    reasons = ranks.union(stats["fallbacks"])
    fallbacks = [stats["fallbacks"].get(r, 0) for r in reasons]
    n, total, squares, processed, calls, *falls = ranks.sum64(
        [nll.size, nll.sum(), np.square(nll).sum(), sum(w.length for w in mine), stats["flash_calls"], *fallbacks])
    seconds, peak = ranks.max([seconds, mx.get_peak_memory() / 1e9])
    mean = total / n
    var = (squares - n * mean * mean) / (n - 1) if n > 1 else float("nan")
    se = math.sqrt(max(var, 0.0) / n) if n > 1 else float("nan")
    ppl = math.exp(mean)
    return {
        "patch": patch,
        "perplexity": ppl,
        "perplexity_se": ppl * se,
        "mean_nll": mean,
        "tokens_scored": int(round(n)),
        "tokens_processed": int(round(processed)),
        "seconds": float(seconds),
        "tokens_per_second": float(processed / seconds),
        "peak_memory_gb": float(peak),  # the largest of any rank
        "flash_calls": int(round(calls)),
        "fallbacks": {r: int(round(c)) for r, c in zip(reasons, falls) if c},
    }


@click.command()
@click.option("--model", "model_spec", default=EMBEDDED, show_default=True, help=MODEL_HELP)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Model dtype [default: float32 for the embedded model, the model's own otherwise].")
@click.option("--dataset", default="wikitext", show_default=True,
              help="wikitext (WikiText-2 raw, test split: from the Hugging Face hub when it answers, else "
                   "the copy shipped with flash-eval), pydocs (ships with CPython), or a local text/parquet "
                   "file or folder.")
@click.option("--context", "--sequence-length", "context", default=512, show_default=True,
              type=click.IntRange(2), help="Tokens per window.")
@click.option("--stride", default=None, type=click.IntRange(1),
              help="Tokens between window starts [default: the context, no overlap].")
@click.option("--tokens", "budget", default=4096, show_default=True, type=click.IntRange(2),
              help="Tokens of the text to use (the budget).")
@click.option("--patch", "patches", default="off,on", show_default=True,
              callback=comma_list(["off", "on"]), help="Settings to run, in order.")
@click.option("--precision", type=click.Choice(["float32", "native"]), default="float32", show_default=True,
              help="The patch's precision (float32 casts as the design asks).")
@kv_cache_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def perplexity(model_spec, dtype, dataset, context, stride, budget, patches, precision, kv_bits, kv_group_size,
               as_json):
    """Perplexity with the patch off and on, side by side.

    Under mlx.launch the windows are split across the processes and only
    rank 0 prints.
    """
    ranks = distributed.init()
    quiet = as_json or not ranks.is_main
    stride = stride or context
    if stride > context:
        raise click.BadParameter(f"stride {stride} is larger than the context {context}", param_hint="--stride")
    kv = kv_cache.from_options(kv_bits, kv_group_size)
    try:
        text = load_text(dataset)
        lm = load_model(model_spec, dtype, quiet, ranks)
    except (TextError, ModelError) as e:
        raise click.ClickException(str(e))
    kv_cache.check(lm.model, kv, patches)
    tokens = tokenize(lm.tokenizer, text.content)
    if len(tokens) < context + 1:
        raise click.ClickException(
            f"the text has {len(tokens):,} tokens, fewer than the context ({context}) + 1"
        )
    n = min(budget, len(tokens))
    plan = windows(n, context, stride)

    results = [run_setting(lm, tokens, plan, p, precision, kv, quiet, ranks) for p in patches]
    report = {
        "model": {"name": lm.name, "path": lm.path, "dtype": str(_model_dtype(lm)), "parameters": lm.parameters},
        "text": {"name": text.name, "note": text.note, "characters": len(text.content),
                 "tokens": int(len(tokens)), "tokens_used": int(n)},
        "protocol": _protocol(context, stride, plan),
        "device": str(mx.default_device()),
        "processes": ranks.size,
        "blas": blas.summary(),
        "precision": precision,
        **kv.as_json(),
        "results": results,
    }
    if {"off", "on"} <= set(patches):
        off = next(r for r in results if r["patch"] == "off")
        on = next(r for r in results if r["patch"] == "on")
        report["difference"] = {
            "perplexity_on_minus_off": on["perplexity"] - off["perplexity"],
            "relative": (on["perplexity"] - off["perplexity"]) / off["perplexity"],
            "speed_ratio_on_over_off": on["tokens_per_second"] / off["tokens_per_second"],
        }
    if not ranks.is_main:
        return
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print(report)


def _model_dtype(lm):
    from mlx.utils import tree_flatten

    return next(v.dtype for _, v in tree_flatten(lm.model.parameters()) if mx.issubdtype(v.dtype, mx.floating))


def _protocol(context: int, stride: int, plan) -> str:
    if stride == context:
        return (f"{len(plan)} non-overlapping windows of {context} tokens in text order; "
                f"each scores every token but its first")
    return (f"{len(plan)} sliding windows of {context} tokens, stride {stride}; "
            f"each scores its last {stride} tokens (the first window all but its first)")


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    t = report["text"]
    m = report["model"]
    console.print(f"model: {m['name']} ({m['parameters'] / 1e6:,.0f}M parameters, {m['dtype']})")
    console.print(f"text: {t['name']}: {t['characters']:,} characters, {t['tokens']:,} tokens; "
                  f"{t['tokens_used']:,} used")
    if t["note"]:
        console.print(f"[yellow]note: {t['note']}[/yellow]")
    console.print(f"protocol: {report['protocol']}")
    procs = f"; {report['processes']} processes (mx.distributed)" if report["processes"] > 1 else ""
    console.print(f"device: {report['device']}{procs}; BLAS: {report['blas']}; patch precision: {report['precision']}")
    kv = KVCacheSetting(report["kv_bits"], report["kv_group_size"])
    console.print(kv.header_line(report.get("kv_pacing", False)))
    table = Table()
    for col in ("patch", "perplexity", "± SE", "tokens scored", "tokens/s", "peak memory", "attention calls"):
        table.add_column(col, justify="left" if col == "patch" else "right")
    for r in report["results"]:
        calls = "-" if r["patch"] == "off" else f"{r['flash_calls']} flash" + "".join(
            f", {n} {k}" for k, n in r["fallbacks"].items())
        table.add_row(r["patch"], f"{r['perplexity']:.6f}", f"{r['perplexity_se']:.4f}", f"{r['tokens_scored']:,}",
                      f"{r['tokens_per_second']:,.1f}", f"{r['peak_memory_gb']:.2f} GB", calls)
    console.print(table)
    if "difference" in report:
        d = report["difference"]
        console.print(f"on - off: {d['perplexity_on_minus_off']:+.3e} ({d['relative']:+.2e} relative); "
                      f"speed on/off: {d['speed_ratio_on_over_off']:.2f}x")
