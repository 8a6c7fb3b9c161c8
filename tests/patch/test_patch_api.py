"""enable / disable / patched: what is swapped, what is restored."""

import subprocess
import sys
import threading

import pytest
from mlx_lm.models import base, llama, qwen2

import mlxlm_flash_patch

ORIGINAL = base.scaled_dot_product_attention


def test_enable_patches_base_and_imported_model_modules():
    mlxlm_flash_patch.enable()
    assert mlxlm_flash_patch.is_enabled()
    for module in (base, qwen2, llama):
        assert module.scaled_dot_product_attention is not ORIGINAL
        assert module.scaled_dot_product_attention.__wrapped__ is ORIGINAL


def test_disable_restores_the_original_function_objects():
    mlxlm_flash_patch.enable()
    mlxlm_flash_patch.disable()
    assert not mlxlm_flash_patch.is_enabled()
    for module in (base, qwen2, llama):
        assert module.scaled_dot_product_attention is ORIGINAL


def test_enable_is_idempotent():
    mlxlm_flash_patch.enable()
    first = qwen2.scaled_dot_product_attention
    mlxlm_flash_patch.enable()
    assert qwen2.scaled_dot_product_attention is first
    mlxlm_flash_patch.disable()
    mlxlm_flash_patch.disable()
    assert qwen2.scaled_dot_product_attention is ORIGINAL


def test_switching_precision_replaces_the_wrapper():
    mlxlm_flash_patch.enable("native")
    assert mlxlm_flash_patch.precision() == "native"
    mlxlm_flash_patch.enable("float32")
    assert mlxlm_flash_patch.precision() == "float32"
    assert qwen2.scaled_dot_product_attention.__wrapped__ is ORIGINAL


def test_bad_precision():
    with pytest.raises(ValueError, match="precision"):
        mlxlm_flash_patch.enable("float64")
    assert not mlxlm_flash_patch.is_enabled()


def test_context_manager_restores_previous_state():
    with mlxlm_flash_patch.patched():
        assert mlxlm_flash_patch.is_enabled()
    assert qwen2.scaled_dot_product_attention is ORIGINAL
    mlxlm_flash_patch.enable("native")
    with mlxlm_flash_patch.patched("float32"):
        assert mlxlm_flash_patch.precision() == "float32"
    assert mlxlm_flash_patch.precision() == "native"


def test_modules_imported_after_enable_are_patched_and_restored():
    # A fresh interpreter, so that the model module is imported for the first time.
    code = """
import sys
import mlxlm_flash_patch
from mlx_lm.models import base
original = base.scaled_dot_product_attention
mlxlm_flash_patch.enable()
assert "mlx_lm.models.ministral3" not in sys.modules
import mlx_lm.models.ministral3 as late
assert late.scaled_dot_product_attention is not original
mlxlm_flash_patch.disable()
assert late.scaled_dot_product_attention is original
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_enable_disable_from_many_threads():
    errors = []

    def flip(n):
        try:
            for i in range(200):
                (mlxlm_flash_patch.enable if (i + n) % 2 else mlxlm_flash_patch.disable)()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=flip, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    mlxlm_flash_patch.disable()
    for module in (base, qwen2, llama):
        assert module.scaled_dot_product_attention is ORIGINAL
