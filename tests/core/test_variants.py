"""The kernel suite again under every instruction set this CPU runs and
under other thread counts, each in a fresh interpreter (the kernels are
chosen once per process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashattn_core

HERE = Path(__file__).parent
SUITES = [str(HERE / name) for name in
          ("test_correctness.py", "test_decode.py", "test_backward.py", "test_window.py", "test_quantized.py")]
BEST_ISA = flashattn_core.cpu_info()["isa"]
ORDER = ["baseline", "avx2", "avx512"]

VARIANTS = [
    pytest.param({"FLASHATTN_ISA": isa}, id=f"isa-{isa}")
    for isa in ORDER
    if isa != BEST_ISA and (BEST_ISA not in ORDER or ORDER.index(isa) < ORDER.index(BEST_ISA))
] + [
    pytest.param({"FLASHATTN_NUM_THREADS": "1"}, id="threads-1"),
    pytest.param({"FLASHATTN_NUM_THREADS": "5"}, id="threads-5"),
]


@pytest.mark.parametrize("env", VARIANTS)
def test_suite_under_variant(env):
    run_env = {**os.environ, **env, "PYTHONDONTWRITEBYTECODE": "1"}
    check = "import flashattn_core as f; info = f.cpu_info(); print(info)"
    info = subprocess.run([sys.executable, "-c", check], env=run_env, capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    if "FLASHATTN_ISA" in env:
        assert f"'isa': '{env['FLASHATTN_ISA']}'" in info.stdout
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITES],
        env=run_env,
        capture_output=True,
        text=True,
        cwd=HERE.parent.parent,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
