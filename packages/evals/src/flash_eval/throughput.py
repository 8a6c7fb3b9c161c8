"""`flash-eval throughput`: prompt and generation tokens/s and peak memory with
the patch off and on, over prompt lengths, on `mlx_lm.benchmark`'s
conventions (a random prompt of `-p` tokens, `-g` generated tokens with
end-of-sequence ignored), measured so that the on/off ratio can be quoted:

- Each prompt length runs two phases. The prompt phase times the prompt's
  forward pass itself: mlx-lm's prefill steps (`generate_step`'s loop:
  `--prefill-step-size` tokens a step, each step's cache state evaluated) over
  the whole prompt with a fresh cache, every queued evaluation synchronised
  before the clock starts and after it stops. The generation phase runs
  mlx-lm's own `stream_generate` and keeps its `generation_tps` (and its
  `prompt_tps`, as `mlx_lm_prompt_tps`, for comparison).
- Each phase starts with `--warmup` rounds, then `--trials` timed rounds; a
  round runs every setting once, in the `--patch` order (off, on, off, on,
  ...), so that the two settings share the machine's state and drift.
- A prompt round runs `--prompt-repeats` passes of each setting, interleaved
  pass by pass (off, on, off, on, ...), and takes each setting's interquartile
  mean: a short pass (a few ms of a small model on a GPU) is host-bound and
  jumps between speeds from one pass to the next; many passes, shared alike
  by both settings, average that out, and the trimmed quarters drop stray
  stalls.
- The on/off ratio of a prompt length is the median of the per-round ratios
  (on_i / off_i, the two settings run next to each other), with their min-max
  range; each setting's figure is the median of its trials.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from contextlib import contextmanager

import click
import mlx.core as mx

import mlxlm_flash_patch

from . import blas, distributed, kv_cache
from .kv_cache import KVCacheSetting, kv_cache_options
from .models import EMBEDDED, MODEL_HELP, ModelError, load_model
from .options import comma_list, int_list
from .progress import progress_bar
from .report import emit
from .setting import patch_setting

KEYS = ("prompt_tps", "generation_tps", "peak_memory")
RATIO_KEYS = ("prompt_tps", "generation_tps")
SUMMED = ("prompt_tps", "generation_tps", "mlx_lm_prompt_tps", "flash_calls")  # added over ranks
# A warm-up round of the generation phase generates at most this many tokens:
# decode's one-time costs come with its first steps.
WARMUP_GENERATION_TOKENS = 16

# Why warm-up rounds, several, at every prompt length and in each setting (on
# a GPU; on a CPU they cost little): the first pass of a shape pays one-time
# costs the trials must not carry. MLX's CUDA build compiles its fused kernels
# (mx.compile'd functions such as mlx-lm's activations) with NVRTC on first
# use, and our kernels' modules are loaded on their first launch (on a GPU
# other than Hopper the driver compiles their PTX then);
# cuDNN builds an execution plan per attention shape; MLX records the kernels
# of an evaluation as CUDA graphs, instantiated the first time a graph's
# topology is seen and updated in place afterwards where the new graph allows
# it, and another prompt length can choose other kernels (matrix-product
# algorithms, cuDNN plans, our kernels' variants), so every length needs its
# own warm-up; the memory a pass needs comes from the device the first time,
# from MLX's buffer cache afterwards. One round pays most of this, but the
# pass after it still finds a buffer cache the other setting has just
# reshaped (and `stream_generate` empties it at every prefill step), and a GPU
# coming out of host-bound work (model loading, the previous length's
# generation) that may not be at its working clocks yet: so two rounds by
# default, each running both settings.
DEFAULT_WARMUP = 2
DEFAULT_TRIALS = 5
# --prompt-repeats auto: enough passes for each setting's share of a round to
# take this long (from the warm-up rounds' passes), at least MIN_REPEATS so
# that the interquartile mean drops a stray pass on either side, at most
# MAX_REPEATS. On an H100, a 0.5B model's passes (10-100 ms) jump by up to 80%
# now and then, both settings alike; with 0.2 s and no minimum (two passes at
# 16K) two runs of scripts/gpu-end-to-end differed by up to 9%.
AUTO_REPEAT_SECONDS = 0.5
MIN_REPEATS = 5
MAX_REPEATS = 64


def _drain():
    """Wait for everything queued so far: mlx-lm computes on a stream of its
    own (`generation_stream`), the rest on the default stream."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


@contextmanager
def _clean_slate():
    """A timed region: nothing queued before it runs inside it, Python's
    garbage collector does not, and MLX's peak memory counts from its start."""
    _drain()
    gc.collect()
    gc.disable()
    mx.reset_peak_memory()
    try:
        yield
    finally:
        gc.enable()


def prompt_pass(model, prompt: mx.array, prefill_step_size: int, kv: KVCacheSetting) -> float:
    """Seconds of the prompt's forward pass: mlx-lm's prefill steps (as in
    `generate_step`) over every token of the prompt, with a fresh cache (of
    the kind `kv` asks for), each
    step's cache state evaluated (so, as in mlx-lm's prefill, the logits are
    not computed), synchronised before and after. Unlike `stream_generate`'s
    `prompt_tps`, the time leaves out the buffer cache emptied after every
    step, the last prompt token's separate decode-sized step and the start of
    generation."""
    from mlx_lm.generate import generation_stream

    cache = kv_cache.make_cache(model, kv)
    _drain()
    start = time.perf_counter()
    with mx.stream(generation_stream):
        for i in range(0, prompt.size, prefill_step_size):
            model(prompt[i : i + prefill_step_size][None], cache=cache)
            mx.eval([c.state for c in cache])
    _drain()
    return time.perf_counter() - start


def interquartile_mean(values: list[float]) -> float:
    """The mean of the middle half (all values when fewer than four)."""
    v = sorted(values)
    q = len(v) // 4
    middle = v[q : len(v) - q] if len(v) >= 4 else v
    return sum(middle) / len(middle)


def auto_repeats(pass_seconds: float) -> int:
    """Passes a setting a prompt round for `--prompt-repeats auto`."""
    if pass_seconds <= 0:
        return MAX_REPEATS
    return max(MIN_REPEATS, min(MAX_REPEATS, math.ceil(AUTO_REPEAT_SECONDS / pass_seconds)))


def _repeats_from_warmup(sequence: list[dict], p: int, warmup: int, ranks) -> int:
    """--prompt-repeats auto at prompt length p: sized by the slowest pass of
    the last warm-up round (1 without warm-up), the same on every rank."""
    warm = [r["prompt_seconds"] for r in sequence
            if (r["prompt_tokens"], r["phase"], r["warmup"], r["round"]) == (p, "prompt", True, warmup - 1)]
    return int(ranks.max([auto_repeats(max(warm)) if warm else 1])[0])


def generation_run(lm, prompt: mx.array, generation_tokens: int, prefill_step_size: int,
                   kv: KVCacheSetting) -> dict:
    """One `stream_generate` run, as `mlx_lm.benchmark` times it, on a fresh
    cache of the kind `kv` asks for (the one stream_generate would make when
    the cache is not quantized)."""
    from mlx_lm import stream_generate

    response = None
    for response in stream_generate(lm.model, lm.tokenizer, prompt, max_tokens=generation_tokens,
                                    prefill_step_size=prefill_step_size,
                                    prompt_cache=kv_cache.make_cache(lm.model, kv)):
        pass
    _drain()  # generate_step runs a step ahead: one decode step is still queued when it stops
    return {"generation_tps": response.generation_tps, "mlx_lm_prompt_tps": response.prompt_tps}


def rounds(warmup: int, trials: int):
    """(round, warm-up?) in the order run: warm-up rounds, then timed ones."""
    for i in range(warmup + trials):
        yield (i if i < warmup else i - warmup), i < warmup


def pair_ratios(off: list[float], on: list[float]) -> dict:
    """On/off ratios of the rounds (on_i / off_i), their median and min-max."""
    ratios = [b / a for a, b in zip(off, on) if a]
    if not ratios:
        return {}
    return {"pairs": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _repeats_option(ctx, param, value):
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise click.BadParameter(f"{value!r} is neither 'auto' nor a whole number >= 1")
    return n


@click.command()
@click.option("--model", "model_spec", default=EMBEDDED, show_default=True, help=MODEL_HELP)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Model dtype [default: float32 for the embedded model, the model's own otherwise].")
@click.option("-p", "--prompt-tokens", "prompt_lengths", default="512,2048,4096", show_default=True,
              callback=int_list, help="Prompt lengths (comma-separated).")
@click.option("-g", "--generation-tokens", default=128, show_default=True, type=click.IntRange(0),
              help="Tokens generated a trial (0: time the prompt only).")
@click.option("--trials", "-n", "--num-trials", "trials", default=DEFAULT_TRIALS, show_default=True,
              type=click.IntRange(1), help="Timed rounds per prompt length and phase; each runs every setting once.")
@click.option("--warmup", default=DEFAULT_WARMUP, show_default=True, type=click.IntRange(0),
              help="Untimed rounds before them, at every prompt length.")
@click.option("--prompt-repeats", default="auto", show_default=True, callback=_repeats_option,
              help="Prompt passes of each setting a round, interleaved (a number, or 'auto': about "
                   f"{AUTO_REPEAT_SECONDS} s of passes a setting, {MIN_REPEATS} to {MAX_REPEATS}, sized by the "
                   "warm-up).")
@click.option("--prefill-step-size", default=2048, show_default=True, type=click.IntRange(1))
@click.option("--patch", "patches", default="off,on", show_default=True, callback=comma_list(["off", "on"]),
              help="Settings, in the order each round runs them.")
@click.option("--precision", type=click.Choice(["float32", "native"]), default="float32", show_default=True)
@click.option("--seed", default=0, show_default=True)
@kv_cache_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (with every pass, in the order run) instead of a table.")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True), help="Write a PNG chart here.")
def throughput(model_spec, dtype, prompt_lengths, generation_tokens, trials, warmup, prompt_repeats,
               prefill_step_size, patches, precision, seed, kv_bits, kv_group_size, as_json, plot):
    """Prompt and generation tokens/s and peak memory, patch off vs on.

    \b
    At every prompt length, two phases, each of --warmup untimed rounds and
    --trials timed ones, a round running each setting once (off, on, off, on,
    ...):
    - prompt: the prompt's forward pass (mlx-lm's prefill steps, fresh cache),
      timed directly, evaluated and synchronised; --prompt-repeats passes of
      each setting a round, interleaved, their interquartile mean;
    - generation: mlx-lm's stream_generate, its generation_tps.
    Each setting's figures are medians of its trials; peak memory is MLX's,
    per trial. On/off: the median of the per-round ratios on_i / off_i (the
    two passes run back to back, so slow drift largely cancels), with their
    min-max range.

    With --kv-bits, every prompt pass and generation of both settings runs on
    mlx-lm's QuantizedKVCache.

    Under mlx.launch every process runs the benchmark on its own device (data
    parallel); rank 0 reports the tokens/s of all processes together and the
    largest peak memory.
    """
    ranks = distributed.init()
    quiet = as_json or not ranks.is_main
    kv = kv_cache.from_options(kv_bits, kv_group_size)
    try:
        lm = load_model(model_spec, dtype, quiet, ranks)
    except ModelError as e:
        raise click.ClickException(str(e))
    kv_cache.check(lm.model, kv, patches)
    lm.tokenizer._eos_token_ids = {}  # always generate -g tokens, as mlx_lm.benchmark does
    vocab = lm.config.get("vocab_size") or lm.config["text_config"]["vocab_size"]
    mx.random.seed(seed)
    prompts = {p: mx.random.randint(0, vocab, (p,)) for p in prompt_lengths}
    mx.eval(list(prompts.values()))

    phases = ["prompt"] + (["generation"] if generation_tokens else [])
    passes = len(prompt_lengths) * len(phases) * (warmup + trials) * len(patches)
    sequence = []  # every pass, in the order run
    mlxlm_flash_patch.reset_stats()
    repeats_used = {}
    with progress_bar(passes, "throughput", quiet) as advance:
        for p in prompt_lengths:
            for phase in phases:
                repeats = prompt_repeats or 1
                for i, is_warmup in rounds(warmup, trials):
                    if phase == "prompt" and prompt_repeats is None and (i, is_warmup) == (0, False):
                        repeats = repeats_used[p] = _repeats_from_warmup(sequence, p, warmup, ranks)
                    if phase == "prompt":
                        records = prompt_round(lm, prompts[p], patches, precision, 1 if is_warmup else repeats,
                                               prefill_step_size, kv, ranks)
                    else:
                        g = min(generation_tokens, WARMUP_GENERATION_TOKENS) if is_warmup else generation_tokens
                        records = generation_round(lm, prompts[p], patches, precision, g, prefill_step_size, kv,
                                                   ranks)
                    for record in records:
                        record.update({"prompt_tokens": p, "phase": phase, "warmup": is_warmup, "round": i})
                        sequence.append(record)
                        advance()
    _combine_ranks(sequence, ranks)
    results = summarize(sequence, prompt_lengths, patches, generation_tokens)
    method = {
        "warmup_rounds": warmup, "trials": trials, "prefill_step_size": prefill_step_size,
        "order": "per prompt length: the prompt phase, then the generation phase; each: warm-up rounds, then "
                 "timed rounds, a round running every setting once in the --patch order",
        "prompt_repeats": ({str(k): v for k, v in repeats_used.items()} if prompt_repeats is None
                           else prompt_repeats),
        "prompt_tps": "prompt tokens / seconds of the prompt's forward pass in mlx-lm's prefill steps, fresh "
                      "cache, evaluated and synchronised; a trial's seconds: the interquartile mean of its "
                      "passes (prompt_passes; a round interleaves the settings pass by pass); median of the "
                      "trials",
        "generation_tps": f"mlx-lm's stream_generate generation_tps over {generation_tokens} tokens (median of the "
                          "trials)" if generation_tokens else None,
        "peak_memory": "MLX's peak memory in GB (weights included) during a trial, reset before each; median",
        "ratio": "median of the per-round ratios on_i / off_i; range: their min and max",
    }
    report = {"model": {"name": lm.name, "path": lm.path}, "device": str(mx.default_device()),
              "processes": ranks.size, "blas": blas.summary(), "precision": precision, **kv.as_json(),
              "method": method, "results": results, "sequence": sequence}
    if not ranks.is_main:
        return
    emit(report, as_json, _print, plot, _plot)


def prompt_round(lm, prompt: mx.array, patches: list[str], precision: str, repeats: int, prefill_step_size: int,
                 kv: KVCacheSetting, ranks) -> list[dict]:
    """One prompt round: `repeats` passes of each setting, interleaved pass by
    pass, so that both settings meet the machine's changing speed alike; a
    record per setting with its passes' seconds and their interquartile mean."""
    records = {patch: {"patch": patch, "prompt_passes": [], "peak_memory": 0.0, "flash_calls": 0, "fallbacks": {}}
               for patch in patches}
    start = time.perf_counter()
    with _clean_slate():  # once a round: a garbage collection takes tens of ms, as long as a short pass
        for _ in range(repeats):
            for patch in patches:
                record = records[patch]
                ranks.barrier()
                before = mlxlm_flash_patch.stats()
                with patch_setting(patch, precision):
                    mx.reset_peak_memory()
                    record["prompt_passes"].append(prompt_pass(lm.model, prompt, prefill_step_size, kv))
                    record["peak_memory"] = max(record["peak_memory"], mx.get_peak_memory() / 1e9)
                _add_stats(record, _stats_since(before))
    round_seconds = time.perf_counter() - start  # the passes and what runs between them
    for record in records.values():
        record["round_seconds"] = round_seconds
        record["prompt_seconds"] = interquartile_mean(record["prompt_passes"])
        record["prompt_tps"] = prompt.size / record["prompt_seconds"]
    return list(records.values())


def generation_round(lm, prompt: mx.array, patches: list[str], precision: str, generation_tokens: int,
                     prefill_step_size: int, kv: KVCacheSetting, ranks) -> list[dict]:
    """One generation round: one `stream_generate` run of each setting."""
    records = []
    for patch in patches:
        ranks.barrier()
        before = mlxlm_flash_patch.stats()
        with patch_setting(patch, precision):
            with _clean_slate():
                record = {"patch": patch, **generation_run(lm, prompt, generation_tokens, prefill_step_size, kv)}
                record["peak_memory"] = mx.get_peak_memory() / 1e9
        record.update(_stats_since(before))
        records.append(record)
    return records


def _add_stats(record: dict, stats: dict) -> None:
    record["flash_calls"] += stats["flash_calls"]
    for k, n in stats["fallbacks"].items():
        record["fallbacks"][k] = record["fallbacks"].get(k, 0) + n


def _stats_since(before: dict) -> dict:
    """The patch's counts of one pass (counted, not reset: a fallback's
    warning is logged once a run)."""
    now = mlxlm_flash_patch.stats()
    fallbacks = {k: n - before["fallbacks"].get(k, 0) for k, n in now["fallbacks"].items()}
    return {"flash_calls": now["flash_calls"] - before["flash_calls"],
            "fallbacks": {k: n for k, n in fallbacks.items() if n}}


def _combine_ranks(sequence: list[dict], ranks) -> None:
    """Under mlx.launch: tokens/s and attention calls added over the ranks
    (their passes ran together: a barrier precedes each), peak memory and
    seconds the largest. Every rank ran the same passes, in the same order."""
    if ranks.size == 1:
        return
    summed = [(r, k) for r in sequence for k in SUMMED if k in r]
    largest = [(r, k) for r in sequence for k in ("peak_memory", "prompt_seconds") if k in r]
    totals = ranks.sum64([r[k] for r, k in summed])
    tops = ranks.max([r[k] for r, k in largest])
    for (r, k), v in zip(summed, totals):
        r[k] = int(round(v)) if k == "flash_calls" else float(v)
    for (r, k), v in zip(largest, tops):
        r[k] = float(v)


def summarize(sequence: list[dict], prompt_lengths: list[int], patches: list[str], generation_tokens: int) -> list[dict]:
    """One row per prompt length and setting, from the timed passes: the
    trials (round i of both phases), medians, attention calls; an "on" row
    beside an "off" one gets the per-round ratios."""
    results = []
    for p in prompt_lengths:
        rows = {}
        for patch in patches:
            timed = [r for r in sequence if r["prompt_tokens"] == p and r["patch"] == patch and not r["warmup"]]
            rounds = sorted({r["round"] for r in timed})
            trials = []
            for i in rounds:
                trial = {"round": i, "generation_tps": None, "mlx_lm_prompt_tps": None}
                for r in (r for r in timed if r["round"] == i):
                    trial.update({k: r[k] for k in ("prompt_seconds", "prompt_tps", "generation_tps",
                                                    "mlx_lm_prompt_tps") if k in r})
                    trial["peak_memory"] = max(trial.get("peak_memory", 0.0), r["peak_memory"])
                trials.append(trial)
            fallbacks = {}
            for r in timed:
                for k, n in r["fallbacks"].items():
                    fallbacks[k] = fallbacks.get(k, 0) + n
            row = {"prompt_tokens": p, "generation_tokens": generation_tokens, "patch": patch, "trials": trials,
                   "flash_calls": sum(r["flash_calls"] for r in timed), "fallbacks": fallbacks}
            for k in KEYS + ("mlx_lm_prompt_tps",):
                values = [t[k] for t in trials if t.get(k) is not None]
                row[k] = statistics.median(values) if values else None
            rows[patch] = row
            results.append(row)
        if "off" in rows and "on" in rows:
            off, on = rows["off"], rows["on"]
            stats = {k: pair_ratios([t[k] for t in off["trials"]], [t[k] for t in on["trials"]])
                     for k in RATIO_KEYS if off[k] is not None}
            on["ratio_vs_off"] = {k: s["median"] for k, s in stats.items() if s}
            on["ratio_range"] = {k: [s["min"], s["max"]] for k, s in stats.items() if s}
            on["pair_ratios"] = {k: s["pairs"] for k, s in stats.items() if s}
            if off["peak_memory"]:
                on["ratio_vs_off"]["peak_memory"] = on["peak_memory"] / off["peak_memory"]
    return results


def _ratio_cell(r: dict, key: str) -> str:
    if key not in r.get("ratio_vs_off", {}):
        return ""
    low, high = r["ratio_range"][key]
    return f"{r['ratio_vs_off'][key]:.3f}x ({low:.3f}-{high:.3f})"


def _repeats_text(repeats) -> str:
    counts = sorted({repeats} if isinstance(repeats, int) else set(repeats.values())) or [1]
    if counts == [1]:
        return "1 pass"
    return "-".join(map(str, dict.fromkeys([counts[0], counts[-1]]))) + " passes"


def _print(report):
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    m = report["method"]
    procs = f" x {report['processes']} processes (tokens/s summed)" if report["processes"] > 1 else ""
    console.print(f"model: {report['model']['name']}; device: {report['device']}{procs}; BLAS: {report['blas']}; "
                  f"patch precision: {report['precision']}")
    kv = KVCacheSetting(report["kv_bits"], report["kv_group_size"])
    console.print(kv.header_line(report.get("kv_pacing", False)))
    gen = (f"generation tok/s: mlx-lm's stream_generate generation_tps over {report['results'][0]['generation_tokens']}"
           " tokens" if m["generation_tps"] else "generation: not run (-g 0)")
    console.print(f"prompt tok/s: the prompt's forward pass in mlx-lm's prefill steps of {m['prefill_step_size']}, "
                  f"timed directly (evaluated, synchronised), {_repeats_text(m['prompt_repeats'])} of each "
                  f"setting a trial, interleaved, their interquartile mean; {gen}; medians of {m['trials']} trials after "
                  f"{m['warmup_rounds']} warm-up rounds, off and on alternating")
    console.print(f"on/off: the median of the {m['trials']} per-round ratios on_i / off_i (min-max)")
    table = Table()
    cols = ("prompt", "patch", "prompt tok/s", "generation tok/s", "peak memory", "on/off prompt",
            "on/off generation", "attention calls")
    for c in cols:
        table.add_column(c, justify="left" if c == "patch" else "right")
    for r in report["results"]:
        calls = "-" if r["patch"] == "off" else f"{r['flash_calls']} flash" + "".join(
            f", {n} {k}" for k, n in r["fallbacks"].items())
        gen_tps = "-" if r["generation_tps"] is None else f"{r['generation_tps']:,.1f}"
        table.add_row(str(r["prompt_tokens"]), r["patch"], f"{r['prompt_tps']:,.1f}", gen_tps,
                      f"{r['peak_memory']:.2f} GB", _ratio_cell(r, "prompt_tps"), _ratio_cell(r, "generation_tps"),
                      calls)
    console.print(table)


def _plot(results, path):
    """Medians with the trials' min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = dict(zip(KEYS, ("prompt tokens/s", "generation tokens/s", "peak memory (GB)")))
    # A panel per measured quantity: with -g 0 there is no generation to draw.
    keys = [k for k in KEYS if any(r[k] is not None for r in results)]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        label = labels[key]
        for patch in dict.fromkeys(r["patch"] for r in results):
            rows = [r for r in results if r["patch"] == patch and r[key] is not None]
            if not rows:
                continue
            low = [r[key] - min(t[key] for t in r["trials"]) for r in rows]
            high = [max(t[key] for t in r["trials"]) - r[key] for r in rows]
            ax.errorbar([r["prompt_tokens"] for r in rows], [r[key] for r in rows], yerr=[low, high],
                        marker="o", capsize=3, label=f"patch {patch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        if ax.has_data():
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
