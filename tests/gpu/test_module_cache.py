"""The CUDA launches' modules in MLX's PTX cache (csrc/cuda/module_cache.h):
a launch hands MLX a stand-in of a few bytes where the module is in place on
disk. Each case runs in a process of its own (the cache directory and the
switches are read once a process), on fresh inputs, against float64."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

pytestmark = pytest.mark.skipif(
    not (mx.is_available(mx.gpu) and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend and an NVIDIA GPU",
)

# A decode, a prefill (a Hopper wgmma one where there is one) and a float32
# prefill, each twice (a module is read from disk once, then kept loaded),
# then the cache's state.
CALLS = r"""
import json
import mlx.core as mx
import numpy as np
from flashattn_core import _ext, flash_attention
from flashattn_core.reference import attention_reference, relative_error

errors = []
for dtype, L, S, E in [(mx.bfloat16, 1, 4096, 64), (mx.bfloat16, 300, 300, 128), (mx.float32, 200, 260, 64)]:
    for _ in range(2):
        q = mx.random.normal((1, 8, L, E)).astype(dtype)
        k = mx.random.normal((1, 2, S, E)).astype(dtype)
        v = mx.random.normal((1, 2, S, E)).astype(dtype)
        out = flash_attention(q, k, v, mask="causal")
        mx.eval(out)
        mask = np.tril(np.ones((L, S), bool), S - L)
        errors.append((str(dtype), relative_error(out, attention_reference(q, k, v, mask=mask))))
print(json.dumps({"errors": errors, "state": _ext._cuda_module_cache()}))
"""

TOLERANCE = {"mlx.core.bfloat16": 2e-2, "mlx.core.float32": 2e-5}


def run_calls(**env_vars):
    env = {**os.environ, **env_vars}
    done = subprocess.run([sys.executable, "-c", CALLS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for dtype, error in result["errors"]:
        assert error <= TOLERANCE[dtype], result["errors"]
    return result["state"]


def on_disk_files(directory: Path):
    """Our modules' files there (MLX keeps its own run-time compiled ones beside them)."""
    return sorted(p.name for p in directory.iterdir() if p.suffix in (".ptx", ".txt") and p.name.startswith("fa_"))


def test_modules_are_read_from_mlx_ptx_cache(tmp_path):
    mlx_dir = tmp_path / "mlx-ptx"
    state = run_calls(MLX_PTX_CACHE_DIR=str(mlx_dir))
    assert state["wanted"] and not state["refused"]
    assert Path(state["dir"]) == mlx_dir
    assert len(state["on_disk"]) >= 3  # one module a call kind at least
    files = on_disk_files(mlx_dir)
    for name in state["on_disk"]:
        assert any(f.startswith(name + "_") and f.endswith(".ptx") for f in files), (name, files)
        assert any(f.startswith(name + "_") and f.endswith(".txt") for f in files), (name, files)
    assert not [p for p in mlx_dir.iterdir() if p.suffix == ".tmp"]


def test_a_damaged_module_on_disk_is_written_again(tmp_path):
    mlx_dir = tmp_path / "mlx-ptx"
    run_calls(MLX_PTX_CACHE_DIR=str(mlx_dir))
    modules = [mlx_dir / f for f in on_disk_files(mlx_dir) if f.endswith(".ptx")]
    assert modules
    for p in modules:  # cut short, as a full disk or a killed writer might leave it
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    state = run_calls(MLX_PTX_CACHE_DIR=str(mlx_dir))
    assert not state["refused"] and len(state["on_disk"]) >= 3


def test_a_refused_stand_in_falls_back_to_the_module(tmp_path):
    # The modules go where MLX does not look: its first launch with a stand-in
    # fails, that launch is made again with the module, and so is every later
    # one; every result is checked.
    state = run_calls(MLX_PTX_CACHE_DIR=str(tmp_path / "mlx-ptx"), FLASHATTN_CUDA_MODULE_DIR=str(tmp_path / "elsewhere"))
    assert state["refused"]


def test_turned_off(tmp_path):
    mlx_dir = tmp_path / "mlx-ptx"
    state = run_calls(MLX_PTX_CACHE_DIR=str(mlx_dir), FLASHATTN_CUDA_MODULE_CACHE="0")
    assert not state["wanted"] and state["on_disk"] == []
    assert not mlx_dir.exists() or on_disk_files(mlx_dir) == []


def test_no_usable_cache_directory(tmp_path):
    # MLX_PTX_CACHE_DIR under a file: neither MLX nor we can make it.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    state = run_calls(MLX_PTX_CACHE_DIR=str(blocker / "ptx"))
    assert state["on_disk"] == [] and not state["refused"]
