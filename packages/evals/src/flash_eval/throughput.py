"""`flash-eval throughput`: prompt and generation tokens/s and peak memory with
the patch off and on, over prompt lengths, following `mlx_lm.benchmark`: a
random prompt of `-p` tokens, `-g` generated tokens (end-of-sequence ignored),
`-n` timed trials after a warm-up, medians of mlx-lm's own figures (a
shape's first run may include kernel compilation, as MLX's CUDA build does)."""

from __future__ import annotations

import json
import statistics

import click
import mlx.core as mx

import mlxlm_flash_patch

from . import blas, distributed
from .models import EMBEDDED, ModelError, load_model
from .options import comma_list, int_list
from .setting import patch_setting
from .progress import progress_bar

KEYS = ("prompt_tps", "generation_tps", "peak_memory")


def one_run(lm, prompt: list[int], generation_tokens: int, prefill_step_size: int):
    from mlx_lm import stream_generate

    response = None
    for response in stream_generate(lm.model, lm.tokenizer, prompt, max_tokens=generation_tokens,
                                    prefill_step_size=prefill_step_size):
        pass
    return {k: getattr(response, k) for k in KEYS}


@click.command()
@click.option("--model", "model_spec", default=EMBEDDED, show_default=True,
              help="'embedded' (Qwen2.5-Coder-0.5B-Instruct from PyPI, cached), an mlx-lm model folder, or a hub id.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Model dtype [default: float32 for the embedded model, the model's own otherwise].")
@click.option("-p", "--prompt-tokens", "prompt_lengths", default="512,2048,4096", show_default=True,
              callback=int_list, help="Prompt lengths (comma-separated).")
@click.option("-g", "--generation-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("-n", "--num-trials", default=3, show_default=True, type=click.IntRange(1))
@click.option("--prefill-step-size", default=2048, show_default=True, type=click.IntRange(1))
@click.option("--patch", "patches", default="off,on", show_default=True, callback=comma_list(["off", "on"]))
@click.option("--precision", type=click.Choice(["float32", "native"]), default="float32", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True), help="Write a PNG chart here.")
def throughput(model_spec, dtype, prompt_lengths, generation_tokens, num_trials, prefill_step_size,
               patches, precision, seed, as_json, plot):
    """Prompt and generation tokens/s, patch off vs on.

    Under mlx.launch every process runs the benchmark on its own device (data
    parallel); rank 0 reports the tokens/s of all processes together and the
    largest peak memory.
    """
    ranks = distributed.init()
    quiet = as_json or not ranks.is_main
    try:
        lm = load_model(model_spec, dtype, quiet, ranks)
    except ModelError as e:
        raise click.ClickException(str(e))
    lm.tokenizer._eos_token_ids = {}  # always generate -g tokens, as mlx_lm.benchmark does
    vocab = lm.config.get("vocab_size") or lm.config["text_config"]["vocab_size"]
    mx.random.seed(seed)
    prompts = {p: mx.random.randint(0, vocab, (p,)).tolist() for p in prompt_lengths}

    results = []
    total = len(patches) * (1 + len(prompt_lengths) * num_trials)
    with progress_bar(total, "throughput", quiet) as advance:
        for patch in patches:  # warm-up once per setting
            with patch_setting(patch, precision):
                one_run(lm, prompts[min(prompt_lengths)][:64], 8, prefill_step_size)
            advance()
        for p in prompt_lengths:  # settings interleaved per length: drift hits both alike
            for patch in patches:
                mlxlm_flash_patch.reset_stats()
                trials = []
                ranks.barrier()
                with patch_setting(patch, precision):
                    for _ in range(num_trials):
                        trials.append(one_run(lm, prompts[p], generation_tokens, prefill_step_size))
                        advance()
                stats = mlxlm_flash_patch.stats()
                row = {"prompt_tokens": p, "generation_tokens": generation_tokens, "patch": patch,
                       "trials": trials, "flash_calls": stats["flash_calls"], "fallbacks": stats["fallbacks"]}
                median = {k: statistics.median(t[k] for t in trials) for k in KEYS}
                tps = ranks.sum64([median["prompt_tps"], median["generation_tps"], stats["flash_calls"]])
                row.update(prompt_tps=float(tps[0]), generation_tps=float(tps[1]), flash_calls=int(round(tps[2])),
                           peak_memory=float(ranks.max([median["peak_memory"]])[0]))
                results.append(row)
    _add_ratios(results)
    report = {"model": {"name": lm.name, "path": lm.path}, "device": str(mx.default_device()),
              "processes": ranks.size, "blas": blas.summary(), "precision": precision, "results": results}
    if not ranks.is_main:
        return
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print(report)
    if plot:
        _plot(results, plot)
        if not as_json:
            click.echo(f"chart written to {plot}")


def _add_ratios(results):
    for r in results:
        if r["patch"] != "on":
            continue
        off = next((o for o in results if o["patch"] == "off" and o["prompt_tokens"] == r["prompt_tokens"]), None)
        if off:
            r["ratio_vs_off"] = {k: r[k] / off[k] for k in KEYS if off[k]}


def _print(report):
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    procs = f" x {report['processes']} processes (tokens/s summed)" if report["processes"] > 1 else ""
    console.print(f"model: {report['model']['name']}; device: {report['device']}{procs}; BLAS: {report['blas']}; "
                  f"patch precision: {report['precision']}")
    table = Table()
    cols = ("prompt", "patch", "prompt tok/s", "generation tok/s", "peak memory", "on/off prompt",
            "on/off generation", "attention calls")
    for c in cols:
        table.add_column(c, justify="left" if c in ("patch",) else "right")
    for r in report["results"]:
        ratio = r.get("ratio_vs_off", {})
        calls = "-" if r["patch"] == "off" else f"{r['flash_calls']} flash" + "".join(
            f", {n} {k}" for k, n in r["fallbacks"].items())
        table.add_row(str(r["prompt_tokens"]), r["patch"], f"{r['prompt_tps']:,.1f}", f"{r['generation_tps']:,.1f}",
                      f"{r['peak_memory']:.2f} GB",
                      f"{ratio['prompt_tps']:.2f}x" if "prompt_tps" in ratio else "",
                      f"{ratio['generation_tps']:.2f}x" if "generation_tps" in ratio else "", calls)
    console.print(table)


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label in zip(axes, KEYS, ("prompt tokens/s", "generation tokens/s", "peak memory (GB)")):
        for patch in dict.fromkeys(r["patch"] for r in results):
            rows = [r for r in results if r["patch"] == patch]
            ax.plot([r["prompt_tokens"] for r in rows], [r[key] for r in rows], marker="o", label=f"patch {patch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
