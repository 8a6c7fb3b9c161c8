"""Which BLAS MLX runs on, and getting a fast one on Linux.

The Linux `mlx-cpu` wheel links a bundled reference BLAS: float32 matrix
products at 1-2.5 GFLOP/s, which makes a 0.5B model ~12x slower than it needs
to be. Debian's OpenBLAS, preloaded, replaces it (~96 GFLOP/s on 2 cores).
"""

from __future__ import annotations

import os
import platform
import sys

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
]
FIX = (
    "apt-get install libopenblas0-pthread; flash-eval then preloads it by itself "
    "(or run with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0)"
)
REEXEC_MARK = "FLASH_EVAL_BLAS_REEXEC"


def describe() -> dict:
    """{'name': ..., 'path': ..., 'slow': bool} for the BLAS in this process."""
    if platform.system() == "Darwin":
        return {"name": "Accelerate", "path": None, "slow": False}
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return {"name": "unknown", "path": None, "slow": False}
    for p in sorted(paths):
        if "openblas" in os.path.basename(p).lower() and "scipy_openblas" not in p:
            return {"name": "OpenBLAS", "path": p, "slow": False}
    for p in sorted(paths):
        base = os.path.basename(p)
        if "mkl" in base.lower():
            return {"name": "MKL", "path": p, "slow": False}
    for p in sorted(paths):
        base = os.path.basename(p)
        if base.startswith("libblas") and "mlx" in p:
            return {"name": "reference BLAS bundled with mlx-cpu", "path": p, "slow": True}
    return {"name": "unknown", "path": None, "slow": False}


def find_openblas() -> str | None:
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def maybe_reexec_with_openblas(argv: list[str]) -> None:
    """Restart this command with Debian's OpenBLAS preloaded when MLX would run
    on the reference BLAS and OpenBLAS is installed. FLASH_EVAL_OPENBLAS=0
    turns this off."""
    if platform.system() != "Linux" or os.environ.get("FLASH_EVAL_OPENBLAS", "1") == "0":
        return
    if os.environ.get(REEXEC_MARK) or "openblas" in os.environ.get("LD_PRELOAD", ""):
        return
    lib = find_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    env[REEXEC_MARK] = lib
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "flash_eval", *argv], env)


def summary() -> str:
    info = describe()
    text = info["name"]
    if os.environ.get(REEXEC_MARK) and info["name"] == "OpenBLAS":
        text += " (preloaded by flash-eval)"
    if info["slow"]:
        text += f" -- slow; to fix: {FIX}"
    return text
