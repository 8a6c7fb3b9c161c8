"""Switches the patch on from the environment, for scripts and console
commands that never import this package themselves.

The ``mlxlm_flash_patch.pth`` file installed next to the package imports this
module at interpreter start only when MLX_FLASH_ATTENTION is set:

    MLX_FLASH_ATTENTION=1         patch on (float32, as the design asks)
    MLX_FLASH_ATTENTION=native    patch on, model dtype kept
    MLX_FLASH_ATTENTION=verbose   patch on, and its statistics printed at exit
    MLX_FLASH_ATTENTION=0 / off   patch off

Nothing heavy is imported here: the patch is applied when mlx-lm's
``mlx_lm.models.base`` is first imported (or at once if it already is).
"""

from __future__ import annotations

import atexit
import importlib.abc
import os
import sys

VARIABLE = "MLX_FLASH_ATTENTION"
ON = {"1", "true", "on", "yes", "float32"}
OFF = {"", "0", "false", "off", "no"}
TARGET = "mlx_lm.models.base"


def parse(value: str):
    """(enabled, precision, verbose) for a value of the variable, or None."""
    v = value.strip().lower()
    if v in OFF:
        return (False, None, False)
    if v in ON:
        return (True, "float32", False)
    if v == "native":
        return (True, "native", False)
    if v == "verbose":
        return (True, "float32", True)
    return None


def _apply(precision: str, verbose: bool) -> None:
    import mlxlm_flash_patch

    mlxlm_flash_patch.enable(precision)
    if verbose:
        print(f"mlxlm_flash_patch: enabled ({precision}) by {VARIABLE}", file=sys.stderr)
        atexit.register(_report)


def _report() -> None:
    import mlxlm_flash_patch

    s = mlxlm_flash_patch.stats()
    fallbacks = ", ".join(f"{k}: {n}" for k, n in s["fallbacks"].items()) or "none"
    print(f"mlxlm_flash_patch: {s['flash_calls']} attention calls through flash_attention; "
          f"fallbacks: {fallbacks}", file=sys.stderr)
    g = s["gradients"]
    if g["fused"] or g["recomputed"]:
        recomputed = ", ".join(f"{k}: {n}" for k, n in g["recomputed"].items()) or "none"
        print(f"mlxlm_flash_patch: backward passes: {g['fused']} fused; recomputed: {recomputed}", file=sys.stderr)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies the patch right after mlx_lm.models.base has been executed."""

    def __init__(self, precision: str, verbose: bool):
        self.precision, self.verbose = precision, verbose

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, finder = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                _apply(finder.precision, finder.verbose)

        spec.loader = _Loader()
        return spec


def install(environ=os.environ) -> None:
    value = environ.get(VARIABLE, "")
    parsed = parse(value)
    if parsed is None:
        print(f"mlxlm_flash_patch: ignoring {VARIABLE}={value!r} (use 1, native, verbose or 0); "
              "the patch stays off", file=sys.stderr)
        return
    enabled, precision, verbose = parsed
    if not enabled:
        return
    if TARGET in sys.modules:
        _apply(precision, verbose)
    else:
        sys.meta_path.insert(0, _PatchOnImport(precision, verbose))


install()
