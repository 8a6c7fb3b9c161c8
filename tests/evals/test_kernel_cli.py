"""flash-eval kernel and demo on tiny shapes, through click's test runner."""

import json
import os

import pytest
from click.testing import CliRunner

from flash_eval import blas
from flash_eval.cli import main

TINY = ["kernel", "--shape", "qwen05b", "--prefill", "64", "--decode", "128", "-n", "1"]


def run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_kernel_json_has_every_case_and_impl():
    result = run([*TINY, "--prefill", "64,96", "--dtype", "float32,bfloat16", "--impl", "flash,mlx", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = data["results"]
    assert {(r["kind"], r["dtype"], r["impl"]) for r in rows} == {
        (kind, dtype, impl)
        for kind in ("prefill", "decode")
        for dtype in ("float32", "bfloat16")
        for impl in ("flash", "mlx")
    }
    for r in rows:
        tol = 1e-5 if r["dtype"] == "float32" else 2e-2
        assert r["max_abs_error"] <= tol, r
        assert r["median_ms"] > 0 and r["gflops"] > 0
    flash = [r for r in rows if r["impl"] == "flash"]
    assert all("mlx" in r["speedup"] for r in flash)
    assert data["machine"]["flashattn_cpu"]["threads"] >= 1
    assert data["machine"]["copy_bandwidth_GBps"] > 0
    # MLX's BLAS named (its float32 times depend on it), as this process maps it.
    assert data["machine"]["blas"].startswith(blas.describe()["name"])
    # On the CPU each decode case's flash timing has a copy of its own moment.
    assert all(("copy_GBps" in r) == (r["kind"] == "decode" and r["impl"] == "flash") for r in rows)
    assert all(r["copy_GBps"] > 0 for r in rows if "copy_GBps" in r)
    # The dtypes of one case run back to back.
    order = [(r["kind"], r["case"]) for r in rows]
    assert order == sorted(order, key=order.index)


@pytest.mark.parametrize("pass_", ["both", "backward"])
def test_kernel_gradient_passes(pass_):
    result = run([*TINY, "--dtype", "float32,bfloat16", "--impl", "flash,mlx", "--pass", pass_, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["machine"]["pass"] == pass_
    rows = data["results"]
    assert {(r["kind"], r["dtype"], r["impl"]) for r in rows} == {
        (kind, dtype, impl) for kind in ("prefill", "decode") for dtype in ("float32", "bfloat16")
        for impl in ("flash", "mlx")}
    suffix = " fwd+bwd" if pass_ == "both" else " backward"
    for r in rows:
        assert r["pass"] == pass_ and r["case"].endswith(suffix)
        # dQ on sampled rows against float64.
        assert r["max_abs_error"] <= (1e-5 if r["dtype"] == "float32" else 5e-2), r
        assert ("forward_ms" in r) == (pass_ == "backward")
    assert all("mlx" in r["speedup"] for r in rows if r["impl"] == "flash")


def test_kernel_table_and_plot(tmp_path):
    png = tmp_path / "kernel.png"
    result = run([*TINY, "--dtype", "float32", "--impl", "flash,mlx", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "qwen05b prefill L=64" in result.output and "flash vs mlx" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kernel_markdown():
    result = run([*TINY, "--dtype", "float32", "--impl", "flash", "--markdown"])
    assert result.exit_code == 0, result.output
    # The machine first (the copy bandwidth that decode is read against),
    # then the table.
    assert "copy on all cores" in result.output
    assert "\n| case | dtype | impl |" in result.output


def test_slow_reference_is_skipped_and_said_so():
    result = run([*TINY, "--prefill", "64,512", "--decode", "", "--dtype", "float32",
                  "--impl", "flash,mlx", "--max-call-seconds", "0.1", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    skipped = [r for r in rows if "skipped" in r]
    assert skipped and all(r["impl"] == "mlx" and "predicted" in r["skipped"] for r in skipped)
    assert all("median_ms" in r for r in rows if r["impl"] == "flash")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefill", "abc"], "comma-separated integers"),
        (["--prefill", "0"], "positive"),
        (["--shape", "gpt5"], "choose from"),
        (["--dtype", "int8"], "choose from"),
        (["--prefill", "", "--decode", ""], "no cases"),
        (["--chunk", "2048"], "must exceed its 2048 rows"),
        (["--chunk", "96", "--chunk-rows", "96"], "must exceed its 96 rows"),
        (["--chunk-rows", "0"], "--chunk-rows"),
        (["--kv-sets", "21"], "--kv-sets"),
        (["--impl", "flash,flash-dense"], "give --window"),
        (["--impl", "flash,flash-plain"], "give --kv-bits"),
        (["--kv-bits", "3"], "--kv-bits"),
        (["--kv-bits", "4", "--pass", "both"], "take no gradient"),
        (["--kv-bits", "4", "--kv-group-size", "128"], "128 does not divide head dim(s) [64]"),
        (["--window", "-1"], "--window"),
        (["--sinks", "--kv-bits", "4"], "takes no sinks"),
        (["--sinks", "--kv-bits", "4", "--impl", "flash,mlx"], "drop mlx from --impl"),
        (["--sinks", "--pass", "both"], "forward only"),
    ],
)
def test_kernel_bad_options(args, message):
    result = CliRunner().invoke(main, ["kernel", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_chunk_cases_are_the_last_rows_against_all_keys():
    # A chunk of mlx-lm's prefill: its L queries are the newest of S tokens,
    # so the float64 reference's bottom-right causal mask is what both
    # implementations must match (a top-left causal mask would leave the
    # first query rows with a few keys and miss by far more than these
    # tolerances).
    result = run(["kernel", "--shape", "qwen05b", "--prefill", "", "--decode", "", "--chunk", "96,160",
                  "--chunk-rows", "32", "--dtype", "float32,bfloat16", "--impl", "flash,mlx", "-n", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert {(r["case"], r["dtype"], r["impl"]) for r in rows} == {
        (f"qwen05b chunk L=32 S={s}", dtype, impl)
        for s in (96, 160) for dtype in ("float32", "bfloat16") for impl in ("flash", "mlx")}
    for r in rows:
        assert r["kind"] == "chunk" and r["length"] in (96, 160)
        assert r["max_abs_error"] <= (1e-5 if r["dtype"] == "float32" else 2e-2), r
    assert all("mlx" in r["speedup"] for r in rows if r["impl"] == "flash")


@pytest.mark.parametrize("kind, L, S", [("prefill", 64, 64), ("chunk", 32, 96), ("chunk", 2048, 8192)])
def test_case_flops_count_the_visible_pairs(kind, L, S):
    # The FlashAttention convention counts L^2 / 2 pairs for a causal L = S
    # triangle (its L / 2 diagonal pairs short of the count); a chunk adds its
    # rows' full view of the keys before them. Counted from the reference's
    # mask.
    from flashattn_core.reference import causal_mask

    from flash_eval.shapes import SHAPES, KernelCase

    shape = SHAPES["qwen05b"]
    case = KernelCase(shape, kind, S, "float32", rows=L)
    assert (case.L, case.S, case.causal) == (L, S, True)
    pairs = causal_mask(L, S).sum() - L / 2
    assert case.flops == 4.0 * shape.H_q * shape.E * pairs


def test_demo_runs():
    result = run(["demo", "--length", "64", "-n", "1"])
    assert result.exit_code == 0, result.output
    assert "flash_attention" in result.output and "mx.fast SDPA" in result.output


def test_short_calls_are_repeated_until_enough_is_timed():
    # A call of ~2 ms asked for 3 repeats is timed until a quarter second has
    # been measured; a call longer than that keeps the repeats asked for.
    import time

    import mlx.core as mx

    from flash_eval.measure import MAX_REPEATS, MIN_TIMED_S, measure

    def sleeper(seconds):
        def fn():
            time.sleep(seconds)
            return mx.array(1.0)

        return fn

    _, fast = measure(sleeper(0.002), repeats=3)
    assert len(fast.times_s) >= 3
    assert sum(fast.times_s) >= MIN_TIMED_S or len(fast.times_s) == MAX_REPEATS
    _, slow = measure(sleeper(0.3), repeats=2, warmup=0)
    assert len(slow.times_s) == 2



def test_batched_calls_chain_on_the_last_output(monkeypatch):
    # On a GPU short calls are batched; with a chain, each call after a
    # batch's first takes the last one's output (as a model's layers do), and
    # measure returns the first call's output (the one checked for errors).
    import mlx.core as mx

    import flash_eval.measure as measure_mod

    monkeypatch.setattr(measure_mod, "_batch", lambda first_s, on_gpu: 4)
    seen = []

    def chain(x):
        seen.append(x.item())
        return x + 1.0

    out, m = measure_mod.measure(lambda: mx.array(10.0), repeats=2, warmup=0, chain=chain)
    assert out.item() == 10.0
    assert len(m.times_s) >= 2
    assert seen[:3] == [10.0, 11.0, 12.0]  # one batch: fn(), then chained three times
    calls = []
    measure_mod.measure(lambda: calls.append(1) or mx.array(0.0), repeats=2, warmup=0)
    assert len(calls) > 1 and (len(calls) - 1) % 4 == 0  # independent: the first call, then fn() 4 a batch

def test_calls_take_the_key_value_copies_in_turn():
    # --kv-sets n: n buffers holding the same keys and values, which an
    # implementation's calls take in turn (so a batch of calls on a GPU reads
    # them from memory, not from the L2 cache); every call gives the same
    # output.
    import mlx.core as mx
    import numpy as np

    from flash_eval.impls import flash_impl, make_inputs, mlx_call
    from flash_eval.kernel import KV_ROTATION_BYTES, kv_sets_for
    from flash_eval.shapes import SHAPES, KernelCase

    case = KernelCase(SHAPES["qwen05b"], "decode", 256, "float32")
    inp = make_inputs(case, seed=3, kv_sets=3)
    assert len(inp.kv_sets) == 3
    buffers = {id(k) for k, _ in inp.kv_sets} | {id(v) for _, v in inp.kv_sets}
    assert len(buffers) == 6
    for k, v in inp.kv_sets:
        assert np.array_equal(np.array(k), np.array(inp.k)) and np.array_equal(np.array(v), np.array(inp.v))
    taken = []
    call = mlx_call(inp, lambda q, k, v, scale, mask: taken.append((id(k), id(v))) or q)
    for _ in range(7):
        call(inp.q)
    assert taken == [(id(k), id(v)) for k, v in inp.kv_sets * 3][:7]
    impl = flash_impl(inp)
    outs = [impl.run() for _ in range(3)]
    assert all(np.array_equal(np.array(o), np.array(outs[0])) for o in outs)
    # Automatic: one copy on the CPU; on a GPU enough for 256 MiB a batch, at most 20.
    assert kv_sets_for(case, 0, on_gpu=False) == 1 and kv_sets_for(case, 5, on_gpu=False) == 5
    assert kv_sets_for(case, 0, on_gpu=True) == 20
    big = KernelCase(SHAPES["hd128"], "decode", 32768, "float32")
    assert big.kv_bytes >= KV_ROTATION_BYTES and kv_sets_for(big, 0, on_gpu=True) == 1
    mid = KernelCase(SHAPES["qwen05b"], "decode", 32768, "bfloat16")
    assert kv_sets_for(mid, 0, on_gpu=True) == -(-KV_ROTATION_BYTES // mid.kv_bytes) == 16
    result = run([*TINY, "--dtype", "float32", "--impl", "flash,mlx", "--kv-sets", "2", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert all(r["kv_sets"] == 2 and r["max_abs_error"] <= 1e-5 for r in rows)
    mx.synchronize()


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.skipif(not os.path.exists(THP_SETTING),
                    reason=f"{THP_SETTING} (Linux transparent huge pages) is not on this machine")
def test_page_setting_says_which_pages_mlx_buffers_get(monkeypatch):
    # The copy (NumPy asks for huge pages) and MLX's buffers (glibc's malloc
    # asks only when told to) may stream through different page sizes.
    from flash_eval.measure import page_setting

    mode = open(THP_SETTING).read().split("[")[1].split("]")[0]
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    default = page_setting()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    told = page_setting()
    assert default.startswith(f"transparent huge pages: {mode};")
    expected = {"always": ("huge pages", "huge pages"), "never": ("4 KiB pages", "4 KiB pages"),
                "madvise": ("4 KiB pages", "huge pages")}[mode]
    assert default.endswith(f"MLX's buffers on {expected[0]}")
    assert told.endswith(f"MLX's buffers on {expected[1]}")


def test_windowed_cases_against_the_band_as_a_dense_mask():
    # flash_attention with window= and with the same band as a boolean mask,
    # MLX's SDPA with the boolean mask: all against the float64 reference on
    # the band; the pairs counted are the band's.
    from flashattn_core.reference import causal_mask

    from flash_eval.shapes import SHAPES, KernelCase

    result = run(["kernel", "--shape", "qwen05b", "--prefill", "96", "--chunk", "160", "--chunk-rows", "32",
                  "--decode", "200", "--window", "40", "--dtype", "float32", "--impl", "flash,flash-dense,mlx",
                  "-n", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert {(r["case"], r["impl"]) for r in rows} == {
        (case, impl)
        for case in ("qwen05b prefill L=96 window=40", "qwen05b chunk L=32 S=160 window=40",
                     "qwen05b decode S=200 window=40")
        for impl in ("flash", "flash-dense", "mlx")}
    for r in rows:
        assert r["max_abs_error"] <= 1e-5, r
    assert all({"flash-dense", "mlx"} <= set(r["speedup"]) for r in rows if r["impl"] == "flash")
    case = KernelCase(SHAPES["qwen05b"], "chunk", 160, "float32", rows=32, window=40)
    assert case.flops == 4.0 * 14 * 64 * causal_mask(32, 160, 40).sum()


@pytest.mark.parametrize("bits", ["4", "8"])
def test_quantized_cases_against_mlx_lm_quantized_attention(bits):
    # flash reads the quantized triples, mlx is mlx-lm's own quantized
    # attention, both against the float64 reference on the dequantized keys
    # and values; flash-plain on the unquantized ones.
    result = run(["kernel", "--shape", "qwen05b", "--prefill", "64", "--decode", "300", "--kv-bits", bits,
                  "--kv-group-size", "32", "--dtype", "float32", "--impl", "flash,flash-plain,mlx", "-n", "1",
                  "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = data["results"]
    assert {(r["case"], r["impl"]) for r in rows} == {
        (f"qwen05b {kind} {bits}-bit KV", impl)
        for kind in ("prefill L=64", "decode S=300") for impl in ("flash", "flash-plain", "mlx")}
    for r in rows:
        if r["impl"] != "flash-plain":
            assert r["max_abs_error"] <= 1e-5, r
    assert "quantized_scaled_dot_product_attention" in data["machine"]["impls"]["mlx"]
    assert all({"flash-plain", "mlx"} <= set(r["speedup"]) for r in rows if r["impl"] == "flash")


@pytest.mark.parametrize("pass_", ["forward", "both"])
def test_float32_attention_over_16_bit_inputs_beside_the_others(pass_):
    # flash-f32 is the patch's default call on a 16-bit model, dtype=float32
    # with out_dtype the inputs' dtype: timed on the bfloat16 case against MLX (its
    # ratios leave flash's own out), skipped on the float32 one, where it is
    # flash's call; its output (or dQ) is the inputs' dtype, so its error is
    # bfloat16's rounding against the float64 reference.
    result = run(["kernel", "--shape", "qwen05b", "--prefill", "64", "--decode", "", "--dtype", "bfloat16,float32",
                  "--impl", "flash,flash-f32,mlx", "--pass", pass_, "-n", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = {(r["dtype"], r["impl"]): r for r in data["results"]}
    assert set(rows) == {(dt, impl) for dt in ("bfloat16", "float32") for impl in ("flash", "flash-f32", "mlx")}
    assert "float32 inputs" in rows["float32", "flash-f32"]["skipped"]
    widened = rows["bfloat16", "flash-f32"]
    assert widened["max_abs_error"] <= 1e-2
    assert set(widened["speedup"]) == {"mlx"}
    assert set(rows["bfloat16", "flash"]["speedup"]) == {"flash-f32", "mlx"}
    assert "dtype=mx.float32, out_dtype=" in data["machine"]["impls"]["flash-f32"]


def test_cases_with_sinks_against_mlx_sdpa_with_sinks():
    # flash_attention and MLX's SDPA take the same sinks; both against the
    # float64 reference with them; torch (no sinks) is left out.
    result = run(["kernel", "--shape", "qwen05b", "--prefill", "96", "--decode", "200", "--sinks",
                  "--dtype", "float32", "--impl", "flash,mlx,torch", "-n", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert {(r["case"], r["impl"]) for r in rows} == {
        (case, impl) for case in ("qwen05b prefill L=96 sinks", "qwen05b decode S=200 sinks")
        for impl in ("flash", "mlx")}
    for r in rows:
        assert r["max_abs_error"] <= 1e-5, r


def test_quantized_cases_with_sinks_leave_mlx_lm_out():
    # mlx-lm's quantized attention takes no sinks: flash reads the quantized
    # triples with the sinks, flash-plain the unquantized keys and values,
    # both against the float64 reference with the sinks on the dequantized
    # ones (flash-plain's error is the quantization's own).
    result = run(["kernel", "--shape", "qwen05b", "--prefill", "64", "--decode", "300", "--kv-bits", "4",
                  "--kv-group-size", "32", "--sinks", "--dtype", "float32", "--impl", "flash,flash-plain", "-n", "1",
                  "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert {(r["case"], r["impl"]) for r in rows} == {
        (f"qwen05b {kind} 4-bit KV sinks", impl)
        for kind in ("prefill L=64", "decode S=300") for impl in ("flash", "flash-plain")}
    for r in rows:
        if r["impl"] == "flash":
            assert r["max_abs_error"] <= 1e-5, r
        else:
            assert r["max_abs_error"] > 1e-4, r  # the 4-bit rounding, which flash-plain does not see
