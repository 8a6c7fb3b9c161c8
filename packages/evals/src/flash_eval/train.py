"""`flash-eval train`: fine-tuning steps with the patch off and on, on the same
model, data and seed: the loss at every step, step time, tokens/s and peak
memory, over sequence lengths.

Protocol: the text is tokenized once and cut into consecutive windows of
length + 1 tokens; step i of every setting trains on the same `--batch-size`
windows (inputs the first `length` tokens, targets the next token of each).
LoRA (`mlx_lm.tuner`, the default) or full fine-tuning with Adam. The LoRA
adapters are made once, from `--seed`, and every setting starts from the same
weights and a fresh optimizer. The step (forward, backward and the
optimizer's update) is `mx.compile`d with the model's and optimizer's state,
as `mlx_lm.lora`'s trainer does, unless `--no-compile`: compiled, it is traced
once a setting and length, so the patch's counts are of the traced graph's
calls. The first step of each setting carries one-time costs (tracing, kernel
loading, the allocator's first buffers): step time and tokens/s are medians
over the steps after it.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import click
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

import mlxlm_flash_patch

from . import blas
from .report import emit
from .models import EMBEDDED, MODEL_HELP, ModelError, load_model
from .options import comma_list, int_list
from .perplexity import tokenize
from .progress import progress_bar
from .setting import patch_setting
from .texts import TextError, load_text

LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}  # mlx_lm.lora's defaults


def batches(tokens: np.ndarray, length: int, batch_size: int, steps: int) -> list[mx.array]:
    """Step i's (batch_size, length + 1) windows, consecutive in the text."""
    need = steps * batch_size * (length + 1)
    if len(tokens) < need:
        raise click.ClickException(
            f"the text has {len(tokens):,} tokens; {steps} steps of {batch_size} x {length + 1} need {need:,}")
    windows = tokens[:need].reshape(steps, batch_size, length + 1)
    return [mx.array(w) for w in windows]


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits.astype(mx.float32), batch[:, 1:], reduction="mean")


def prepare(model, fine_tune: str, lora_layers: int, seed: int):
    """Freeze what is not trained; LoRA adapters from the seed."""
    if fine_tune == "lora":
        from mlx_lm.tuner.utils import linear_to_lora_layers

        mx.random.seed(seed)
        model.freeze()
        linear_to_lora_layers(model, lora_layers, LORA)
    else:
        model.unfreeze()
    mx.eval(model.parameters())


def make_step(model, optimizer, compiled: bool):
    """One training step: returns the loss, the update applied. compiled:
    mx.compile'd with the state it updates, as mlx_lm.lora's trainer does.
    Made anew for every setting, so that no trace outlives the patch setting
    it was made under."""
    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step(batch):
        loss, grads = loss_and_grad(model, batch)
        optimizer.update(model, grads)
        return loss

    if not compiled:
        return step
    state = [model.state, optimizer.state, mx.random.state]
    return partial(mx.compile, inputs=state, outputs=state)(step)


def run_setting(model, initial, data: list[mx.array], patch: str, precision: str, learning_rate: float,
                advance, compiled: bool = True) -> dict:
    """Training steps from the initial weights with a fresh Adam."""
    model.update(initial)
    optimizer = optim.Adam(learning_rate=learning_rate)
    step = make_step(model, optimizer, compiled)
    losses, seconds, peaks = [], [], []
    mlxlm_flash_patch.reset_stats()
    with patch_setting(patch, precision):
        for batch in data:
            mx.synchronize()
            mx.reset_peak_memory()
            start = time.perf_counter()
            loss = step(batch)
            mx.eval(loss, model.trainable_parameters(), optimizer.state)
            mx.synchronize()
            seconds.append(time.perf_counter() - start)
            peaks.append(mx.get_peak_memory() / 1e9)
            losses.append(loss.item())
            advance()
    stats = mlxlm_flash_patch.stats()
    timed = seconds[1:] or seconds
    tokens = data[0].shape[0] * (data[0].shape[1] - 1)
    return {
        "patch": patch,
        "losses": losses,
        "step_seconds": seconds,
        "median_step_seconds": statistics.median(timed),
        "tokens": tokens,
        "tokens_per_second": tokens / statistics.median(timed),
        "peak_memory_gb": max(peaks),
        "flash_calls": stats["flash_calls"],
        "fallbacks": stats["fallbacks"],
        "gradients": stats["gradients"],
    }


def pool_rounds(runs: list[dict]) -> dict:
    """One setting's rounds as one row: the first round's losses and steps,
    step time and tokens/s the median over every round's steps after its
    first, each round's median beside it (the spread a ratio meets)."""
    row = dict(runs[0])
    timed = [t for r in runs for t in (r["step_seconds"][1:] or r["step_seconds"])]
    row["median_step_seconds"] = statistics.median(timed)
    row["tokens_per_second"] = row["tokens"] / row["median_step_seconds"]
    row["peak_memory_gb"] = max(r["peak_memory_gb"] for r in runs)
    row["round_median_step_seconds"] = [r["median_step_seconds"] for r in runs]
    return row


def compare(rows: list[dict]) -> None:
    """Beside the "on" row: its losses against the "off" row's, step by step,
    and the speed and memory ratios."""
    by_patch = {r["patch"]: r for r in rows}
    if not {"off", "on"} <= set(by_patch):
        return
    off, on = by_patch["off"], by_patch["on"]
    rel = [abs(b - a) / max(abs(a), 1e-30) for a, b in zip(off["losses"], on["losses"])]
    on["loss_relative_difference"] = rel
    on["max_loss_relative_difference"] = max(rel)
    on["speed_ratio_on_over_off"] = on["tokens_per_second"] / off["tokens_per_second"]
    on["peak_memory_ratio_on_over_off"] = on["peak_memory_gb"] / off["peak_memory_gb"]


@click.command()
@click.option("--model", "model_spec", default=EMBEDDED, show_default=True, help=MODEL_HELP)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Model dtype [default: float32 for the embedded model, the model's own otherwise].")
@click.option("-l", "--lengths", default="512", show_default=True, callback=int_list,
              help="Sequence lengths (comma-separated), one run of every setting each.")
@click.option("--steps", default=20, show_default=True, type=click.IntRange(1), help="Training steps a run.")
@click.option("--batch-size", default=1, show_default=True, type=click.IntRange(1))
@click.option("--fine-tune", type=click.Choice(["lora", "full"]), default="lora", show_default=True)
@click.option("--lora-layers", default=16, show_default=True, type=click.IntRange(1),
              help="Transformer blocks given LoRA adapters, from the last (mlx_lm.lora's default).")
@click.option("--learning-rate", default=1e-5, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--dataset", default="wikitext", show_default=True,
              help="wikitext (WikiText-2 raw, test split: the hub, else the copy shipped with flash-eval), "
                   "pydocs, or a local text/parquet file or folder.")
@click.option("--patch", "patches", default="off,on", show_default=True,
              callback=comma_list(["off", "on"]), help="Settings to run, in order.")
@click.option("--precision", type=click.Choice(["float32", "native"]), default="float32", show_default=True,
              help="The patch's precision (float32 casts as the design asks).")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1),
              help="Run the settings in alternation this many times a length (each from the same weights): "
                   "step times pooled, so that a ratio does not meet one state of a drifting machine.")
@click.option("--seed", default=0, show_default=True, help="Seeds the LoRA adapters.")
@click.option("--compile/--no-compile", "compiled", default=True, show_default=True,
              help="mx.compile the step, as mlx_lm.lora does (the patch's counts are then the traced graph's).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every step) instead of a table.")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True),
              help="Write a PNG chart here: the losses step by step, time and memory per length.")
def train(model_spec, dtype, lengths, steps, batch_size, fine_tune, lora_layers, learning_rate, dataset, patches,
          precision, rounds, seed, compiled, as_json, plot):
    """Fine-tuning steps with the patch off and on: loss, step time, tokens/s
    and peak memory, on the same model, data and seed."""
    if not lengths:
        raise click.BadParameter("give at least one sequence length", param_hint="--lengths")
    quiet = as_json
    try:
        text = load_text(dataset)
        lm = load_model(model_spec, dtype, quiet)
    except (TextError, ModelError) as e:
        raise click.ClickException(str(e))
    tokens = tokenize(lm.tokenizer, text.content)
    data = {n: batches(tokens, n, batch_size, steps) for n in lengths}
    prepare(lm.model, fine_tune, lora_layers, seed)
    initial = lm.model.trainable_parameters()
    trainable = sum(v.size for _, v in _flatten(initial))

    results = []
    with progress_bar(len(lengths) * len(patches) * steps * rounds, "training steps", quiet) as advance:
        for n in lengths:
            runs = {p: [] for p in patches}
            for _ in range(rounds):
                for p in patches:
                    runs[p].append(run_setting(lm.model, initial, data[n], p, precision, learning_rate, advance,
                                               compiled))
            rows = [pool_rounds(runs[p]) for p in patches]
            for r in rows:
                r["length"] = n
            compare(rows)
            results.extend(rows)
    report = {
        "model": {"name": lm.name, "path": lm.path, "parameters": lm.parameters, "trainable": trainable},
        "text": {"name": text.name, "note": text.note, "tokens": int(len(tokens))},
        "protocol": {"fine_tune": fine_tune, "lora": LORA | {"layers": lora_layers} if fine_tune == "lora" else None,
                     "optimizer": "Adam", "learning_rate": learning_rate, "steps": steps, "batch_size": batch_size,
                     "seed": seed, "rounds": rounds, "compiled": compiled,
                     "timing": "step time and tokens/s: medians of the steps after the first"
                               + (f", over {rounds} rounds of the settings in alternation" if rounds > 1 else "")},
        "device": str(mx.default_device()),
        "blas": blas.summary(),
        "precision": precision,
        "results": results,
    }
    emit(report, as_json, _print, plot, _plot)


def _flatten(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    m, p = report["model"], report["protocol"]
    how = f"LoRA rank {p['lora']['rank']} on {p['lora']['layers']} blocks" if p["lora"] else "full fine-tune"
    console.print(f"model: {m['name']} ({m['parameters'] / 1e6:,.0f}M parameters, {m['trainable']:,} trained: {how})")
    console.print(f"text: {report['text']['name']}; {p['steps']} {'compiled' if p['compiled'] else 'eager'} Adam steps "
                  f"(lr {p['learning_rate']:g}) of "
                  f"{p['batch_size']} sequence(s) a length, the same for every setting; {p['timing']}")
    if report["text"]["note"]:
        console.print(f"[yellow]note: {report['text']['note']}[/yellow]")
    console.print(f"device: {report['device']}; BLAS: {report['blas']}; patch precision: {report['precision']}")
    table = Table()
    for col in ("length", "patch", "loss first -> last", "max |on - off| / off", "step time", "tokens/s",
                "peak memory", "attention"):
        table.add_column(col, justify="left" if col == "patch" else "right")
    for r in report["results"]:
        diff = f"{r['max_loss_relative_difference']:.1e}" if "max_loss_relative_difference" in r else ""
        attention = "-" if r["patch"] == "off" else (
            f"{r['flash_calls']} flash, backward {r['gradients']['fused']} fused"
            + "".join(f", {n} recomputed ({k})" for k, n in r["gradients"]["recomputed"].items())
            + "".join(f", {n} {k}" for k, n in r["fallbacks"].items()))
        table.add_row(str(r["length"]), r["patch"], f"{r['losses'][0]:.5f} -> {r['losses'][-1]:.5f}", diff,
                      f"{r['median_step_seconds']:.3f} s", f"{r['tokens_per_second']:,.1f}",
                      f"{r['peak_memory_gb']:.2f} GB", attention)
    console.print(table)


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in results})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for r in results:
        style = "-" if r["patch"] == "off" else "--"
        axes[0].plot(range(1, len(r["losses"]) + 1), r["losses"], style, marker="o", markersize=3,
                     label=f"{r['length']} tokens, patch {r['patch']}")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss")
    axes[0].legend(fontsize=8)
    width = 0.8 / max(1, len({r["patch"] for r in results}))
    for i, patch in enumerate(dict.fromkeys(r["patch"] for r in results)):
        rows = {r["length"]: r for r in results if r["patch"] == patch}
        xs = [j + i * width for j in range(len(lengths))]
        axes[1].bar(xs, [rows[n]["tokens_per_second"] if n in rows else 0 for n in lengths], width,
                    label=f"patch {patch}")
        axes[2].bar(xs, [rows[n]["peak_memory_gb"] if n in rows else 0 for n in lengths], width,
                    label=f"patch {patch}")
    for ax, label in ((axes[1], "training tokens/s"), (axes[2], "peak memory (GB)")):
        ax.set_xticks([j + width / 2 for j in range(len(lengths))])
        ax.set_xticklabels([str(n) for n in lengths])
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
