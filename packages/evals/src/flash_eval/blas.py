"""Which BLAS MLX runs on, and getting a fast one on Linux.

The Linux `mlx-cpu` wheel links a bundled reference BLAS: float32 matrix
products at 1-6 GFLOP/s, which makes a 0.5B model ~12x slower than it needs
to be. An optimised BLAS preloaded (LD_PRELOAD) takes its place, as MLX calls
`cblas_sgemm` & co. by name. flash-eval's model commands restart themselves
with one preloaded, the first found of:

1. Debian's OpenBLAS (`apt-get install libopenblas0-pthread`), when installed;
2. Intel's MKL from the `mkl` wheel on PyPI (`libmkl_rt.so.*` in the Python
   environment), which the workspace installs on x86-64 Linux through the
   `flashattn-evals[mkl]` extra: no apt step.

FLASH_EVAL_BLAS picks: `auto` (the default, the order above), `openblas`,
`mkl`, or `off` (also `0`: keep MLX's BLAS as installed). The older
FLASH_EVAL_OPENBLAS=0 still turns preloading off.
"""

from __future__ import annotations

import glob
import os
import platform
import sys
from dataclasses import dataclass

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
]
# libmkl_rt: MKL's single dynamic library (it loads the rest itself); .so.2
# in the 2022-2023 wheels, .so.3 since.
MKL_NAMES = ["libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"]

SETTING = "FLASH_EVAL_BLAS"
LEGACY_SETTING = "FLASH_EVAL_OPENBLAS"  # =0 turned preloading off before MKL came
SETTINGS = ("auto", "openblas", "mkl", "off")
REEXEC_MARK = "FLASH_EVAL_BLAS_REEXEC"  # set in the restarted process: the library preloaded

# Settings MKL is run with unless the environment has them. None so far: on a
# 2-core x86-64 machine (AMD EPYC; MKL takes its generic code path there),
# `flash-eval perplexity` ran as fast with MKL's defaults (Intel OpenMP, one
# thread a core) as with KMP_BLOCKTIME=0 (its workers' 200 ms spin after each
# call could have taken the cores from flashattn-core's own threads).
# There, the default `flash-eval perplexity` (4,096 tokens, off and on) took
# 127.6 s with MKL and 122.6 s with Debian's OpenBLAS (medians of 3; 1.04x).
MKL_DEFAULTS: dict[str, str] = {}

INSTALL = (
    "`uv sync` in the workspace (or `pip install 'flashattn-evals[mkl]'`) installs Intel's MKL, "
    "or `apt-get install libopenblas0-pthread` Debian's OpenBLAS"
)
FIX = f"{INSTALL}; flash-eval then preloads it by itself"


@dataclass(frozen=True)
class Choice:
    name: str  # "OpenBLAS" or "MKL"
    path: str


def setting(environ=None) -> str:
    """FLASH_EVAL_BLAS as one of SETTINGS; FLASH_EVAL_OPENBLAS=0 is `off`."""
    environ = os.environ if environ is None else environ
    value = environ.get(SETTING, "").strip().lower()
    if not value:
        return "off" if environ.get(LEGACY_SETTING, "").strip() == "0" else "auto"
    if value in ("0", "off", "none", "no", "false"):
        return "off"
    if value not in SETTINGS:
        raise ValueError(f"{SETTING}={environ.get(SETTING)!r}: use one of {', '.join(SETTINGS)} (or 0)")
    return value


def find_openblas() -> str | None:
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def find_mkl(prefixes: list[str] | None = None) -> str | None:
    """libmkl_rt from the `mkl` wheel: it installs into the environment's
    lib/ (the wheel's data), beside bin/ and the site-packages."""
    if prefixes is None:
        prefixes = list(dict.fromkeys([sys.prefix, sys.exec_prefix]))
    for prefix in prefixes:
        for name in MKL_NAMES:
            path = os.path.join(prefix, "lib", name)
            if os.path.exists(path):
                return path
    for prefix in prefixes:  # a later soname than this module knows
        found = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so.*")))
        if found:
            return found[-1]
    return None


def choose(which: str, openblas: str | None, mkl: str | None) -> Choice | None:
    """The library to preload for setting `which`, given what is installed:
    Debian's OpenBLAS first (the faster of the two where measured), then MKL."""
    if which == "off":
        return None
    if which in ("auto", "openblas") and openblas:
        return Choice("OpenBLAS", openblas)
    if which in ("auto", "mkl") and mkl:
        return Choice("MKL", mkl)
    return None


def _preloaded(ld_preload: str) -> bool:
    base = [os.path.basename(p).lower() for p in ld_preload.replace(" ", ":").split(":") if p]
    return any("openblas" in b or b.startswith("libmkl_rt") for b in base)


def preload_env(environ, choice: Choice) -> dict:
    """The environment of the restarted process: the library first in
    LD_PRELOAD, MKL's thread settings unless given."""
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join(x for x in (choice.path, env.get("LD_PRELOAD", "")) if x)
    env[REEXEC_MARK] = choice.path
    if choice.name == "MKL":
        for key, value in MKL_DEFAULTS.items():
            env.setdefault(key, value)
    return env


def plan(environ=None, system: str | None = None, openblas: str | None = None, mkl: str | None = None,
         look: bool = True) -> Choice | None:
    """What maybe_reexec would preload (None: nothing). With look=False the
    given paths are all there is (for tests)."""
    environ = os.environ if environ is None else environ
    if (system or platform.system()) != "Linux":
        return None
    which = setting(environ)
    if which == "off" or environ.get(REEXEC_MARK) or _preloaded(environ.get("LD_PRELOAD", "")):
        return None
    if look:
        openblas = openblas or find_openblas()
        mkl = mkl or find_mkl()
    return choose(which, openblas, mkl)


def maybe_reexec(argv: list[str]) -> None:
    """Restart this command with an optimised BLAS preloaded when one is
    installed and none is preloaded yet (see the module's doc)."""
    try:
        choice = plan()
    except ValueError as e:
        print(f"flash-eval: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if choice is None:
        return
    env = preload_env(os.environ, choice)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "flash_eval", *argv], env)


maybe_reexec_with_openblas = maybe_reexec  # the former name


def describe(maps: list[str] | None = None, system: str | None = None) -> dict:
    """{'name': ..., 'path': ..., 'slow': bool} for the BLAS in this process
    (from the libraries mapped into it, or `maps`: their paths)."""
    if (system or platform.system()) == "Darwin":
        return {"name": "Accelerate", "path": None, "slow": False}
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = [line.split()[-1] for line in f if "/" in line]
        except OSError:
            return {"name": "unknown", "path": None, "slow": False}
    paths = sorted(set(maps))
    for p in paths:  # NumPy's bundled scipy-openblas serves NumPy only
        if "openblas" in os.path.basename(p).lower() and "scipy_openblas" not in p:
            return {"name": "OpenBLAS", "path": p, "slow": False}
    for p in paths:
        if os.path.basename(p).startswith("libmkl_rt"):
            return {"name": "MKL", "path": p, "slow": False}
    for p in paths:
        base = os.path.basename(p)
        if base.startswith("libblas") and "mlx" in p:
            return {"name": "reference BLAS bundled with mlx-cpu", "path": p, "slow": True}
    return {"name": "unknown", "path": None, "slow": False}


def kernel_note() -> str:
    """The BLAS MLX's CPU products run on in this process, for `flash-eval
    kernel`, which compares against MLX as installed and preloads nothing:
    with the mlx-cpu wheel's reference BLAS (which sets MLX's float32
    times), how to run it on an optimised one instead."""
    info = describe()
    if not info["slow"]:
        return info["name"]
    found = find_openblas() or find_mkl()
    how = f"LD_PRELOAD={found} flash-eval kernel ..." if found else INSTALL
    return f"{info['name']}, which sets MLX's float32 times (an optimised one: {how})"


def summary() -> str:
    info = describe()
    text = info["name"]
    if info["name"] == "MKL":
        wheel = ", the mkl wheel" if info["path"].startswith(os.path.join(sys.prefix, "lib", "")) else ""
        text += f" ({os.path.basename(info['path'])}{wheel})"
    if os.environ.get(REEXEC_MARK) and info["name"] in ("OpenBLAS", "MKL"):
        text += " (preloaded by flash-eval)"
    if info["slow"]:
        text += f" -- slow; to fix: {FIX}"
    return text
