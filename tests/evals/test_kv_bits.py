"""flash-eval perplexity / throughput --kv-bits on tiny random models: every
pass of both settings runs on mlx-lm's QuantizedKVCache with the bits and
group size asked for; the patch off gives mlx-lm's own numbers on that cache,
the patch on agrees with it; the report names the cache; bad input is refused
naming the option. The patch's handling of quantized caches (fallback today,
a flash call once the kernels take them) is read from its counts, never
assumed."""

import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from tiny_models import FAMILIES, save_model_folder, tiny_tokenizer

import mlxlm_flash_patch
from flash_eval.cli import main

TEXT = (
    "A generator function returns an iterator; each call of next resumes it where it left off, "
    "with its local variables as they were. "
) * 10
LAYERS = FAMILIES["qwen2"]["num_hidden_layers"]
HEAD_DIM = FAMILIES["qwen2"]["hidden_size"] // FAMILIES["qwen2"]["num_attention_heads"]  # 32
GROUP = 32  # mlx-lm's default of 64 does not divide the tiny model's head dim


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_text(TEXT)
    return p


def invoke(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


def as_json(*args):
    return json.loads(invoke(*args, "--json").stdout)


def attention_calls(row) -> int:
    """Every attention call the patch saw, through flash_attention or not."""
    return row["flash_calls"] + sum(row["fallbacks"].values())


def mlx_lm_perplexity(model_dir, context: int, budget: int, bits=None) -> tuple[float, int]:
    """mlx-lm alone, the patch off: non-overlapping windows of the text, each
    through a fresh QuantizedKVCache per layer (none when bits is None).
    Returns the perplexity and the number of windows."""
    from mlx_lm import load
    from mlx_lm.models.cache import QuantizedKVCache

    assert mlxlm_flash_patch.precision() is None
    model, tokenizer = load(str(model_dir))
    tokens = tokenizer.encode(TEXT)[:budget]
    nll = []
    starts = range(0, len(tokens) - 1, context)
    for s in starts:
        x = mx.array(tokens[s : s + context])[None]
        cache = [QuantizedKVCache(group_size=GROUP, bits=bits) for _ in model.layers] if bits else None
        logits = model(x[:, :-1], cache=cache).astype(mx.float32)
        nll.append(np.array(nn.losses.cross_entropy(logits, x[:, 1:], reduction="none")[0]))
    return math.exp(np.concatenate(nll).astype(np.float64).mean()), len(starts)


@pytest.mark.parametrize("bits", [4, 8])
def test_perplexity_on_the_quantized_cache(model_dir, text_file, bits):
    rep = as_json("perplexity", "--model", model_dir, "--dataset", text_file, "--context", 64, "--tokens", 300,
                  "--kv-bits", bits, "--kv-group-size", GROUP)
    off, on = rep["results"]
    expected, windows = mlx_lm_perplexity(model_dir, 64, 300, bits)
    plain, _ = mlx_lm_perplexity(model_dir, 64, 300)
    # the patch off is mlx-lm on the quantized cache, which is not the ordinary one's
    assert off["perplexity"] == pytest.approx(expected, rel=1e-6)
    assert abs(expected - plain) > 1e-6 * plain
    # the same cache for both settings: the patch on agrees, as it does on the ordinary cache
    assert off["tokens_scored"] == on["tokens_scored"] > 200
    assert abs(rep["difference"]["relative"]) <= 1e-5
    assert attention_calls(on) == windows * LAYERS  # whatever the patch did with them
    assert (rep["kv_bits"], rep["kv_group_size"]) == (bits, GROUP)
    assert rep["kv_cache"] == f"{bits}-bit, group {GROUP}"


def test_perplexity_table_names_the_cache(model_dir, text_file):
    args = ["perplexity", "--model", model_dir, "--dataset", text_file, "--context", 32, "--tokens", 100]
    quantized = " ".join(invoke(*args, "--kv-bits", 8, "--kv-group-size", GROUP).stdout.split())
    assert f"KV cache: 8-bit, group {GROUP}" in quantized
    plain = " ".join(invoke(*args, "--patch", "off").stdout.split())
    assert "KV cache: model dtype" in plain and "-bit" not in plain
    rep = as_json(*args, "--patch", "off")
    assert (rep["kv_bits"], rep["kv_group_size"], rep["kv_cache"]) == (None, None, "model dtype")


@pytest.fixture
def cache_updates(monkeypatch):
    """Every update of an mlx-lm KV cache: its kind, bits, group size, and
    whether the patch was on."""
    from mlx_lm.models import cache

    seen = []
    for kind in (cache.KVCache, cache.QuantizedKVCache):
        original = kind.update_and_fetch

        def spy(self, keys, values, original=original):
            seen.append((type(self).__name__, getattr(self, "bits", None), getattr(self, "group_size", None),
                         mlxlm_flash_patch.precision() is not None))
            return original(self, keys, values)

        monkeypatch.setattr(kind, "update_and_fetch", spy)
    return seen


@pytest.mark.parametrize("bits", [4, 8])
def test_throughput_runs_every_pass_on_the_quantized_cache(model_dir, cache_updates, bits):
    rep = as_json("throughput", "--model", model_dir, "-p", "24,40", "-g", 3, "--trials", 1, "--warmup", 0,
                  "--prefill-step-size", 16, "--prompt-repeats", 1, "--kv-bits", bits, "--kv-group-size", GROUP)
    rows = {(r["prompt_tokens"], r["patch"]): r for r in rep["results"]}
    for r in rows.values():
        assert r["prompt_tps"] > 0 and r["generation_tps"] > 0 and r["peak_memory"] > 0
    assert {k for k, r in rows.items() if "ratio_vs_off" in r} == {(24, "on"), (40, "on")}
    on = [u for u in cache_updates if u[3]]
    off = [u for u in cache_updates if not u[3] and u[0] == "QuantizedKVCache"]
    # with the patch on, every cache update was a quantized one with the settings asked for ...
    assert on and set(on) == {("QuantizedKVCache", bits, GROUP, True)}
    assert {u[1:3] for u in off} == {(bits, GROUP)} and len(off) >= len(on)
    # ... and every attention call is in the report, flash or fallback as the patch counted it
    assert sum(attention_calls(rows[(p, "on")]) for p in (24, 40)) == len(on)
    assert (rep["kv_bits"], rep["kv_group_size"], rep["kv_cache"]) == (bits, GROUP, f"{bits}-bit, group {GROUP}")


def test_throughput_table_names_the_cache(model_dir):
    args = ["throughput", "--model", model_dir, "-p", 16, "-g", 2, "--trials", 1, "--warmup", 0]
    quantized = invoke(*args, "--kv-bits", 4, "--kv-group-size", GROUP).stdout
    assert f"KV cache: 4-bit, group {GROUP}" in quantized
    assert "KV cache: model dtype" in invoke(*args).stdout
    rep = as_json(*args, "--patch", "off")
    assert (rep["kv_bits"], rep["kv_group_size"], rep["kv_cache"]) == (None, None, "model dtype")
    # The patch paces a quantized prefill on CUDA alone: not here, and the report says so.
    assert as_json(*args, "--kv-bits", 4, "--kv-group-size", GROUP)["kv_pacing"] is False
    assert rep["kv_pacing"] is False and "paces" not in quantized


def test_a_paced_run_says_so(model_dir, monkeypatch):
    from mlxlm_flash_patch import pacing

    monkeypatch.setattr(pacing, "enabled", lambda: True)
    args = ["throughput", "--model", model_dir, "-p", 16, "-g", 2, "--trials", 1, "--warmup", 0,
            "--kv-bits", 4, "--kv-group-size", GROUP]
    assert as_json(*args)["kv_pacing"] is True
    printed = " ".join(invoke(*args).stdout.split())  # the console wraps long lines
    assert "the patch paces its prefill steps (MLX_FLASH_ATTENTION_PACING=0: unpaced)" in printed
    assert as_json("throughput", "--model", model_dir, "-p", 16, "-g", 2, "--trials", 1, "--warmup", 0)["kv_pacing"] \
        is False  # no quantized cache, nothing paced


def save_mamba_folder(path):
    """A tiny Mamba: state-space layers only, no KV cache."""
    from mlx_lm.models import mamba

    tokenizer = tiny_tokenizer()
    config = dict(model_type="mamba", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                  state_size=8, num_hidden_layers=1, conv_kernel=4, use_bias=False, use_conv_bias=True,
                  time_step_rank=4, tie_word_embeddings=True)
    model = mamba.Model(mamba.ModelArgs.from_dict(config))
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def other_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("other-models")
    return {"mamba": save_mamba_folder(root / "mamba"), "gpt_oss": save_model_folder(root / "gpt-oss", "gpt_oss")}


@pytest.mark.parametrize("command", ["perplexity", "throughput"])
@pytest.mark.parametrize(
    "model, args, option, message",
    [
        ("qwen2", ["--kv-bits", "3"], "--kv-bits", "'3' is not one of '4', '8'"),
        ("qwen2", ["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size", "'48' is not one of '32', '64', '128'"),
        ("qwen2", ["--kv-bits", "4"], "--kv-group-size",  # mlx-lm's default group of 64
         f"64 does not divide the model's head dim ({HEAD_DIM}): mlx-lm quantizes keys and values in groups along it; "
         "choose 32"),
        ("qwen2", ["--kv-bits", "8", "--kv-group-size", "128"], "--kv-group-size", "128 does not divide"),
        ("qwen2", ["--kv-group-size", "32"], "--kv-group-size", "32 was given without --kv-bits"),
        ("mamba", ["--kv-bits", "4"], "--kv-bits", "4 needs a KV cache to quantize, and this model has none"),
        # sliding-window layers: mlx-lm's RotatingKVCache has no quantized form
        ("gpt_oss", ["--kv-bits", "8", "--kv-group-size", "16"], "--kv-group-size", "'16' is not one of"),
        ("gpt_oss", ["--kv-bits", "8", "--kv-group-size", "32"], "--kv-bits", "RotatingKVCache Quantization NYI"),
    ],
)
def test_bad_input(model_dir, text_file, other_models, command, model, args, option, message):
    folder = model_dir if model == "qwen2" else other_models[model]
    extra = ["--dataset", str(text_file), "--context", "32"] if command == "perplexity" else ["-p", "16"]
    r = CliRunner().invoke(main, [command, "--model", str(folder), *extra, *args])
    assert r.exit_code == 2, r.output  # click's usage error, before anything is measured
    text = " ".join(r.output.split())
    assert f"Invalid value for '{option}'" in text and message in text
    assert "patch" not in r.stdout.replace("--patch", "")  # no table


def test_a_quantized_cache_mlx_lm_cannot_run_is_refused_unless_only_ours_is_asked(model_dir, monkeypatch):
    # On CUDA mlx-lm's quantized attention has no kernel for some head shapes
    # (mx.quantized_matmul raises): the patch-off pass is refused up front,
    # and --patch on alone measures ours.
    from mlx_lm.models import base

    def no_kernel(*args, **kwargs):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape")

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", no_kernel)
    args = ["throughput", "--model", model_dir, "-p", 16, "-g", 2, "--trials", 1, "--warmup", 0,
            "--kv-bits", 4, "--kv-group-size", GROUP]
    r = CliRunner().invoke(main, [str(a) for a in args])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "mlx-lm cannot run this model on a quantized KV cache" in text
    assert "--patch on alone measures ours" in text
    rep = as_json(*args, "--patch", "on")
    assert [row["patch"] for row in rep["results"]] == ["on"]
    assert all(not row["fallbacks"] for row in rep["results"])
