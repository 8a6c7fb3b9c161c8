"""flash-eval under mlx.launch with two local processes (ring backend): the
windows are split across ranks and the result equals one process's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_model_folder

LAUNCH = Path(sys.executable).parent / "mlx.launch"
TEXT = ("A generator function returns an iterator; each call of next resumes it. " * 40).strip()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model = save_model_folder(root / "model")
    text = root / "text.txt"
    text.write_text(TEXT)
    return model, text


def flash_eval(args, processes=1):
    cmd = [sys.executable, "-m", "flash_eval", *args]
    if processes > 1:
        assert LAUNCH.exists(), f"mlx.launch not found in {LAUNCH.parent}"
        cmd = [str(LAUNCH), "--backend", "ring", "-n", str(processes), "--python", sys.executable,
               "--", "-m", "flash_eval", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


def test_perplexity_split_across_two_processes_equals_one(setup):
    model, text = setup
    args = ["perplexity", "--model", str(model), "--dataset", str(text), "--context", "48", "--tokens", "500",
            "--json"]
    one = flash_eval(args)
    two = flash_eval(args, processes=2)
    assert one["processes"] == 1 and two["processes"] == 2
    for a, b in zip(one["results"], two["results"]):
        assert a["patch"] == b["patch"]
        assert a["tokens_scored"] == b["tokens_scored"]
        assert abs(a["perplexity"] - b["perplexity"]) <= 1e-9 * a["perplexity"]
        assert abs(a["perplexity_se"] - b["perplexity_se"]) <= 1e-6 * a["perplexity_se"]
    assert two["results"][1]["flash_calls"] == one["results"][1]["flash_calls"]


def test_throughput_under_two_processes(setup):
    model, _ = setup
    rep = flash_eval(["throughput", "--model", str(model), "-p", "16", "-g", "4", "-n", "1", "--json"],
                     processes=2)
    assert rep["processes"] == 2
    assert all(r["prompt_tps"] > 0 and r["generation_tps"] > 0 for r in rep["results"])


def test_perplexity_on_a_quantized_cache_across_two_processes(setup):
    # each rank's fallback reasons are gathered by name: the counts add up whatever the patch called them
    model, text = setup
    args = ["perplexity", "--model", str(model), "--dataset", str(text), "--context", "48", "--tokens", "300",
            "--kv-bits", "8", "--kv-group-size", "32", "--json"]
    one = flash_eval(args)
    two = flash_eval(args, processes=2)
    assert two["processes"] == 2 and two["kv_bits"] == 8
    for a, b in zip(one["results"], two["results"]):
        assert abs(a["perplexity"] - b["perplexity"]) <= 1e-9 * a["perplexity"]
        assert (a["flash_calls"], a["fallbacks"]) == (b["flash_calls"], b["fallbacks"])
    on = two["results"][1]
    assert on["flash_calls"] + sum(on["fallbacks"].values()) == 7 * 2  # 7 windows of 48 in 300 tokens, 2 layers
