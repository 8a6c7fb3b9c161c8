"""The switch from outside: MLX_FLASH_ATTENTION and the installed .pth hook,
exercised on the real `mlx_lm.generate` command in fresh interpreters."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_model_folder

BIN = Path(sys.executable).parent
GENERATE = BIN / "mlx_lm.generate"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(tmp_path_factory.mktemp("tiny-qwen2"))


def run(args, value=None, **kw):
    env = {k: v for k, v in os.environ.items() if k != "MLX_FLASH_ATTENTION"}
    if value is not None:
        env["MLX_FLASH_ATTENTION"] = value
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, **kw)


def generated_text(stdout: str) -> str:
    # mlx_lm.generate prints the text between two "==========" lines.
    parts = stdout.split("==========")
    assert len(parts) >= 3, stdout
    return parts[1]


def test_mlx_lm_generate_command_same_text_with_patch(model_dir):
    assert GENERATE.exists(), f"mlx_lm.generate console script not found in {BIN}"
    args = [str(GENERATE), "--model", str(model_dir), "--prompt", "The function", "--max-tokens", "32"]
    off = run(args)
    on = run(args, "verbose")
    assert off.returncode == 0 and on.returncode == 0, off.stderr + on.stderr
    assert generated_text(on.stdout) == generated_text(off.stdout)
    assert "mlxlm_flash_patch: enabled" in on.stderr
    assert "attention calls through flash_attention; fallbacks: none" in on.stderr
    calls = int(on.stderr.split("mlxlm_flash_patch: ")[-1].split()[0])
    assert calls > 0
    assert "mlxlm_flash_patch" not in off.stderr


def test_script_gains_the_patch_with_two_lines(model_dir):
    script = f"""
import mlxlm_flash_patch; mlxlm_flash_patch.enable()
from mlx_lm import load, generate
model, tokenizer = load({str(model_dir)!r})
print(generate(model, tokenizer, "Loops", max_tokens=8))
print("calls", mlxlm_flash_patch.stats()["flash_calls"])
"""
    result = run([sys.executable, "-c", script])
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split("calls")[-1]) > 0


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_unset_or_off_imports_and_changes_nothing(value):
    code = "import sys; print(sorted(m for m in ('mlxlm_flash_patch', 'mlx', 'mlx_lm') if m in sys.modules))"
    result = run([sys.executable, "-c", code], value)
    assert result.returncode == 0, result.stderr
    # Unset: not even this package is imported. Off: only its light startup
    # module reads the value; neither MLX nor mlx-lm is imported.
    assert result.stdout.strip() == ("[]" if value is None else "['mlxlm_flash_patch']")


def test_unknown_value_warns_and_stays_off():
    code = "from mlx_lm.models import base; print(hasattr(base.scaled_dot_product_attention, '_mlxlm_flash_patch'))"
    result = run([sys.executable, "-c", code], "maybe")
    assert result.stdout.strip() == "False"
    assert "ignoring MLX_FLASH_ATTENTION='maybe'" in result.stderr


@pytest.mark.parametrize("value, precision", [("1", "float32"), ("native", "native")])
def test_on_values_patch_lazily_at_mlx_lm_import(value, precision):
    code = (
        "import sys; assert 'mlx_lm' not in sys.modules\n"
        "from mlx_lm.models import qwen2\n"
        "import mlxlm_flash_patch\n"
        "print(mlxlm_flash_patch.is_enabled(), mlxlm_flash_patch.precision(),"
        " hasattr(qwen2.scaled_dot_product_attention, '_mlxlm_flash_patch'))"
    )
    result = run([sys.executable, "-c", code], value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", precision, "True"]
