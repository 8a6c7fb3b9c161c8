"""`flash-eval kernel`: flash_attention against MLX's SDPA (and PyTorch's, when
installed) on the same inputs, over causal prefill, chunked prefill and decode
shapes."""

from __future__ import annotations

import json
import platform
import time
import sys

import click
import mlx.core as mx
import numpy as np
from threadpoolctl import threadpool_limits

import flashattn_core
from flashattn_core.reference import attention_gradients_reference, attention_reference, causal_mask

from . import blas, report
from .impls import (Inputs, cotangent, flash_dense_grad_impl, flash_dense_impl, flash_f32_grad_impl, flash_f32_impl,
                    flash_grad_impl, flash_impl, flash_plain_impl, make_inputs, mlx_grad_impl, mlx_impl, torch_impls)
from .measure import MAX_BATCH, copy_bandwidth, device_copy_bandwidth, measure, measure_host, page_setting
from .options import comma_list, int_list
from .progress import progress_bar
from .shapes import CHUNK_ROWS, SHAPES, KernelCase

# Repetitions get fewer as calls get slower: about this many seconds per impl.
TIME_BUDGET_S = 8.0
# On a GPU a batch of calls (measure.py) takes copies of the keys and values
# in turn, enough that the batch reads at least this many distinct bytes of
# them (up to one copy a call): a model's layers each read their own cache,
# and one copy read again and again would be timed from the GPU's L2 cache
# (H200: 60 MB; qwen05b's decode at S = 32768 reads 16.8 MB a call).
KV_ROTATION_BYTES = 256 * 2**20


def kv_sets_for(case: KernelCase, asked: int, on_gpu: bool) -> int:
    if asked:
        return asked
    if not on_gpu:
        return 1
    return max(1, min(MAX_BATCH, -(-KV_ROTATION_BYTES // case.kv_bytes)))


def sampled_rows_error(inp: Inputs, out: np.ndarray, rows: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(out[..., rows, :] - ref)))


def reference_rows(inp: Inputs, max_rows: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """float64 reference on a few query rows spread over the sequence (the
    whole L x S reference would not fit in memory at long lengths)."""
    case = inp.case
    rows = np.unique(np.linspace(0, case.L - 1, min(case.L, max_rows)).astype(int))
    mask = causal_mask(case.L, case.S, case.window or None)[rows] if case.causal else None
    # One BLAS thread: NumPy's OpenBLAS workers spin after a call and would
    # steal the cores from the timings that follow.
    with threadpool_limits(limits=1, user_api="blas"):
        ref = attention_reference(inp.q[..., mx.array(rows), :], *inp.reference_kv(), scale=inp.scale, mask=mask,
                                  sinks=inp.sinks)
    return rows, ref


def reference_grad_rows(inp: Inputs, max_rows: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """float64 dQ on a few query rows: a row's dQ needs only that row's
    probabilities, output and cotangent."""
    case = inp.case
    rows = np.unique(np.linspace(0, case.L - 1, min(case.L, max_rows)).astype(int))
    mask = causal_mask(case.L, case.S, case.window or None)[rows] if case.causal else None
    pick = mx.array(rows)
    with threadpool_limits(limits=1, user_api="blas"):
        dq, _, _ = attention_gradients_reference(inp.q[..., pick, :], inp.k, inp.v, cotangent(inp)[..., pick, :],
                                                 scale=inp.scale, mask=mask)
    return rows, dq


# FlashAttention's convention: a backward does 2.5 times the forward's
# matrix work (five products of the forward's size against two).
PASS_FLOPS = {"forward": 1.0, "backward": 2.5, "both": 3.5}


def unfused_bytes(case: KernelCase) -> int:
    """What an unfused attention materialises: scores and probabilities."""
    itemsize = 4 if case.dtype == "float32" else 2
    return 2 * case.shape.H_q * case.L * case.S * itemsize


def total_memory_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@click.command()
@click.option("--shape", "shapes", default="qwen05b,hd128", show_default=True,
              callback=comma_list(list(SHAPES)), help="Head shapes (comma-separated).")
@click.option("--prefill", default="512,2048,8192", show_default=True, callback=int_list,
              help="Causal prefill lengths L = S (comma-separated; empty for none).")
@click.option("--chunk", default="", show_default=True, callback=int_list,
              help="Chunked prefill: key lengths S (comma-separated) that the last --chunk-rows queries "
                   "attend to, causal, as in mlx-lm's prefill steps after the first; empty for none.")
@click.option("--chunk-rows", default=CHUNK_ROWS, show_default=True, type=click.IntRange(1),
              help="Query rows of a --chunk case (mlx-lm's default prefill step).")
@click.option("--decode", default="2048,32768,131072", show_default=True, callback=int_list,
              help="Decode key lengths S, one query (comma-separated; empty for none).")
@click.option("--dtype", "dtypes", default="float32,bfloat16", show_default=True,
              callback=comma_list(["float32", "float16", "bfloat16"]))
@click.option("--window", default=0, show_default=True, type=click.IntRange(0),
              help="A sliding window of this many keys on every case (causal; decode sees the last W keys); "
                   "0: none. flash_attention takes it as window=, the others as a dense boolean mask.")
@click.option("--kv-bits", type=click.Choice(["2", "4", "8"]), default=None,
              help="Quantize the keys and values (mx.quantize): flash reads them in place, mlx is mlx-lm's "
                   "quantized attention (mx.quantized_matmul), torch is skipped.")
@click.option("--kv-group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True,
              help="Group size of --kv-bits.")
@click.option("--sinks", is_flag=True,
              help="An attention sink per query head (random logits; gpt-oss), given to flash and mlx as "
                   "sinks=; torch is skipped (its SDPA takes none).")
@click.option("--impl", "impls", default="flash,mlx,torch", show_default=True,
              callback=comma_list(["flash", "flash-f32", "flash-dense", "flash-plain", "mlx", "torch"]),
              help="Implementations; torch is skipped when PyTorch is not installed. flash-f32: "
                   "flash_attention(..., dtype=mx.float32, out_dtype=<their dtype>) over float16 / bfloat16 "
                   "inputs (the patch's default on a 16-bit model; float32 cases skip it). flash-dense (with --window): "
                   "flash_attention given the window as a dense boolean mask. flash-plain (with --kv-bits): "
                   "flash_attention on the unquantized keys and values.")
@click.option("-n", "--repeats", default=5, show_default=True, type=click.IntRange(1, 1000),
              help="Timed calls per implementation at least (fewer for slow ones; calls shorter than "
                   "a quarter second are repeated until that much is timed, up to 100 times).")
@click.option("--max-call-seconds", default=60.0, show_default=True, type=click.FloatRange(0.1),
              help="Skip a reference whose single call would take longer than this.")
@click.option("--calls", type=click.Choice(["chained", "independent"]), default="chained", show_default=True,
              help="On a GPU, calls timed together in one evaluation: each on the last one's output (as a "
                   "model's layers), or independent (MLX's CUDA graph may then run them side by side).")
@click.option("--kv-sets", default=0, show_default=True, type=click.IntRange(0, MAX_BATCH),
              help="Copies of the keys and values that a batch's calls take in turn; 0: on a GPU enough "
                   "for a batch to read 256 MiB of distinct K/V (as a model's layers, each with its own "
                   "cache), 1 on the CPU. 1 re-reads one copy (from the GPU's L2 cache when it fits).")
@click.option("--pass", "pass_", type=click.Choice(["forward", "backward", "both"]), default="forward",
              show_default=True,
              help="What is timed: the forward; forward and backward together (mx.vjp, PyTorch's autograd; "
                   "calls not chained); or the backward alone, as both minus forward (medians of one run). "
                   "The error is then dQ's, on sampled rows.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--markdown", is_flag=True, help="Print a markdown table instead.")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True), help="Write a PNG chart here.")
def kernel(shapes, prefill, chunk, chunk_rows, decode, dtypes, window, kv_bits, kv_group_size, sinks, impls,
           repeats, max_call_seconds, calls, kv_sets, pass_, seed, as_json, markdown, plot):
    """Time flash_attention, mx.fast.scaled_dot_product_attention and PyTorch's SDPA."""
    if "flash-dense" in impls and not window:
        raise click.BadParameter("flash-dense times a window passed as a dense mask: give --window",
                                 param_hint="--impl")
    if "flash-plain" in impls and not kv_bits:
        raise click.BadParameter("flash-plain times the unquantized keys and values: give --kv-bits",
                                 param_hint="--impl")
    kv_bits, kv_group_size = int(kv_bits or 0), int(kv_group_size)
    if kv_bits and pass_ != "forward":
        raise click.BadParameter("quantized keys and values take no gradient: use --pass forward",
                                 param_hint="--kv-bits")
    if sinks and kv_bits and "mlx" in impls:
        raise click.BadParameter("mlx-lm's quantized attention takes no sinks: drop mlx from --impl, or --kv-bits "
                                 "or --sinks", param_hint="--sinks")
    if sinks and pass_ != "forward":
        raise click.BadParameter("--sinks times the forward only: use --pass forward", param_hint="--sinks")
    odd = sorted({SHAPES[s].E for s in shapes if SHAPES[s].E % kv_group_size}) if kv_bits else []
    if odd:
        raise click.BadParameter(f"{kv_group_size} does not divide head dim(s) {odd}", param_hint="--kv-group-size")
    short = [n for n in chunk if n <= chunk_rows]
    if short:
        raise click.BadParameter(
            f"a chunk's key length must exceed its {chunk_rows} rows (--chunk-rows), got {short}; "
            "time L = S with --prefill", param_hint="--chunk")
    cases = [
        KernelCase(SHAPES[s], kind, n, dt, chunk_rows, window, kv_bits, kv_group_size, sinks)
        for s in shapes
        for kind, lengths in (("prefill", prefill), ("chunk", chunk), ("decode", decode))
        for n in lengths
        for dt in dtypes
    ]
    if not cases:
        raise click.UsageError("no cases: give --prefill, --chunk and/or --decode lengths")
    # The dtypes of one case back to back, so that a ratio between them (and
    # between the implementations of one dtype) meets one state of a noisy
    # machine rather than states minutes apart.
    cases.sort(key=lambda c: (c.kind, c.shape.name, c.length, c.dtype))
    quiet = as_json or markdown or not sys.stderr.isatty()

    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "flashattn_cpu": flashattn_core.cpu_info(),
    }
    on_gpu = mx.default_device() == mx.gpu
    if on_gpu:
        machine["gpu"] = mx.device_info().get("device_name", "GPU") if hasattr(mx, "device_info") else "GPU"
        machine["copy_bandwidth_GBps"] = device_copy_bandwidth() / 1e9
        machine["calls"] = calls
        machine["kv_sets"] = kv_sets or "auto"
    else:
        machine["blas"] = blas.kernel_note()
        if any(c.kind == "decode" for c in cases):
            machine["copy_bandwidth_GBps"] = copy_bandwidth() / 1e9
            machine["pages"] = page_setting()
    machine["pass"] = pass_

    results = []
    rate = {}  # (impl, kind) -> FLOP/s of its last case: predicts the next call
    with progress_bar(len(cases), "kernel cases", quiet) as advance:
        for case in cases:
            sets = kv_sets_for(case, kv_sets, on_gpu)
            inp = make_inputs(case, seed, sets)
            grad = pass_ != "forward"
            rows, ref = reference_grad_rows(inp) if grad else reference_rows(inp)
            flops = case.flops * PASS_FLOPS[pass_]
            candidates = {"flash": lambda i: [flash_impl(i)], "flash-f32": lambda i: [flash_f32_impl(i)],
                          "flash-dense": lambda i: [flash_dense_impl(i)],
                          "flash-plain": lambda i: [flash_plain_impl(i)], "mlx": lambda i: [mlx_impl(i)],
                          "torch": torch_impls}
            grad_candidates = {"flash": lambda i: [flash_grad_impl(i)], "flash-f32": lambda i: [flash_f32_grad_impl(i)],
                               "flash-dense": lambda i: [flash_dense_grad_impl(i)],
                               "mlx": lambda i: [mlx_grad_impl(i)], "torch": lambda i: torch_impls(i, grad=True)}
            chosen = grad_candidates if grad else candidates
            # --pass backward subtracts each implementation's forward, timed just after it.
            forwards = ({i.name: i for key in impls for i in candidates[key](inp)} if pass_ == "backward" else {})
            for key, impl in ((key, impl) for key in impls for impl in chosen[key](inp)):
                machine.setdefault("impls", {})[impl.name] = impl.description
                label = case.label + {"forward": "", "backward": " backward", "both": " fwd+bwd"}[pass_]
                row = {"case": label, "kind": case.kind, "shape": case.shape.name, "pass": pass_,
                       "length": case.length, "dtype": case.dtype, "impl": impl.name, "kv_sets": sets}
                seen = rate.get((impl.name, case.kind))
                predicted = flops / seen if seen else None
                if key == "flash-f32" and case.dtype == "float32":
                    row["skipped"] = "float32 inputs: flash is this call"
                elif key != "flash" and predicted and predicted > max_call_seconds:
                    row["skipped"] = f"predicted {predicted:,.0f} s per call"
                elif key == "mlx" and unfused_bytes(case) > 0.6 * total_memory_bytes():
                    row["skipped"] = f"needs ~{unfused_bytes(case) / 2**30:.0f} GiB (unfused)"
                if "skipped" in row:
                    results.append(row)
                    continue
                if key == "flash" and case.kind == "decode" and "pages" in machine:
                    # The copy again, just before the decode it measures: the
                    # share of bandwidth compares two figures of one moment.
                    row["copy_GBps"] = copy_bandwidth() / 1e9
                time.sleep(0.3)  # let other libraries' spinning worker threads go idle
                n = repeats if not predicted else int(min(repeats, max(1, TIME_BUDGET_S / predicted)))
                warmup = 0 if predicted and predicted > 2.0 else 1
                def timed(impl):
                    if impl.on_mlx:
                        return measure(impl.run, repeats=n, warmup=warmup,
                                       chain=impl.chain if calls == "chained" else None)
                    return measure_host(impl.run, repeats=n, warmup=warmup, sync=impl.sync, on_gpu=on_gpu)

                try:
                    out, m = timed(impl)
                    forward_s = timed(forwards[impl.name])[1].median_s if forwards else None
                except RuntimeError as e:  # e.g. a PyTorch backend that refuses float32
                    row["skipped"] = f"refused: {str(e).splitlines()[0][:80]}"
                    results.append(row)
                    continue
                err = sampled_rows_error(inp, impl.to_numpy(out), rows, ref)
                del out
                seconds = m.median_s - (forward_s or 0.0)
                times = [t - (forward_s or 0.0) for t in m.times_s]
                rate[(impl.name, case.kind)] = flops / max(seconds, 1e-9)
                row.update(
                    median_ms=seconds * 1e3,
                    times_ms=[t * 1e3 for t in times],
                    repeats=len(times),
                    gflops=flops / max(seconds, 1e-9) / 1e9,
                    kv_GBps=case.kv_bytes / max(seconds, 1e-9) / 1e9,
                    max_abs_error=err,
                    peak_extra_mib=None if m.peak_extra_bytes is None else m.peak_extra_bytes / 2**20,
                )
                if forward_s is not None:
                    row["forward_ms"] = forward_s * 1e3
                results.append(row)
            del inp
            advance()

    report.add_ratios(results)
    if as_json:
        click.echo(json.dumps({"machine": machine, "results": results}, indent=2))
    elif markdown:
        click.echo(report.kernel_markdown(results, machine))
    else:
        report.print_kernel_table(results, machine)
    if plot:
        report.plot_kernel(results, plot)
        if not as_json:
            click.echo(f"chart written to {plot}")
