"""mlx-lm's own fine-tuning command, `mlx_lm.lora`, unchanged with
MLX_FLASH_ATTENTION set from outside: LoRA and full fine-tuning train to the
same weights as with the patch off, through the fused backward."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import save_model_folder

LORA = Path(sys.executable).parent / "mlx_lm.lora"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-data")
    rng = random.Random(0)
    words = "attention tiles softmax keys values queries online merge exact memory gradient backward".split()
    for name, n in (("train", 16), ("valid", 4)):
        lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(12))}) for _ in range(n)]
        (path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return path


def fine_tune(model_dir, data_dir, adapters: Path, kind: str, value=None):
    env = {k: v for k, v in os.environ.items() if k != "MLX_FLASH_ATTENTION"}
    if value is not None:
        env["MLX_FLASH_ATTENTION"] = value
    args = [str(LORA), "--model", str(model_dir), "--train", "--data", str(data_dir), "--fine-tune-type", kind,
            "--iters", "4", "--batch-size", "2", "--num-layers", "2", "--steps-per-eval", "100",
            "--val-batches", "1", "--learning-rate", "1e-4", "--adapter-path", str(adapters)]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return mx.load(str(adapters / "adapters.safetensors")), result.stderr


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_mlx_lm_lora_trains_the_same_weights_with_the_patch(model_dir, data_dir, tmp_path, kind):
    assert LORA.exists(), f"mlx_lm.lora console script not found in {LORA.parent}"
    off, off_err = fine_tune(model_dir, data_dir, tmp_path / "off", kind)
    on, on_err = fine_tune(model_dir, data_dir, tmp_path / "on", kind, "verbose")
    assert sorted(on) == sorted(off) and len(off) > 0
    for name in off:
        a, b = np.array(off[name], dtype=np.float64), np.array(on[name], dtype=np.float64)
        assert np.linalg.norm(b - a) <= 1e-4 * max(np.linalg.norm(a), 1e-30), name
    assert "fallbacks: none" in on_err
    fused = int(on_err.split("backward passes: ")[1].split()[0])
    assert fused >= 4 and "recomputed: none" in on_err
    assert "mlxlm_flash_patch" not in off_err
