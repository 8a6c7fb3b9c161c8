"""Suites that could crash the interpreter if the kernel were wrong, each run
in a fresh interpreter: a segfault there fails this test, not the whole run."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_random_invalid_inputs_raise_instead_of_crashing():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "isolated" / "invalid_inputs.py")],
        capture_output=True, text=True, cwd=HERE.parent.parent, timeout=900,
    )
    assert result.returncode == 0, (
        f"exit {result.returncode} (negative: killed by a signal)\n" + result.stdout[-4000:] + result.stderr[-2000:]
    )
