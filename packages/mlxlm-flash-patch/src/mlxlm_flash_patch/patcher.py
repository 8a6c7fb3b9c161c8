"""Swapping mlx-lm's shared attention function in and out.

mlx-lm's model files do ``from .base import scaled_dot_product_attention``, so
each imported model module holds its own reference: the patch replaces the
name in ``mlx_lm.models.base`` (which model modules imported later then pick
up) and in every model module already imported. Nothing on disk changes.
"""

from __future__ import annotations

import sys
import threading

NAME = "scaled_dot_product_attention"
PACKAGE = "mlx_lm.models."
PRECISIONS = ("float32", "native")

_lock = threading.RLock()
_state: dict = {"original": None, "replacement": None, "precision": None}


def _model_modules():
    for name, module in list(sys.modules.items()):
        if module is not None and (name.startswith(PACKAGE) or name == "mlx_lm.models"):
            yield module


def enable(precision: str = "float32") -> None:
    """Route mlx-lm's attention through flash_attention (idempotent)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    from mlx_lm.models import base

    from .attention import make_attention

    with _lock:
        if _state["replacement"] is not None:
            if _state["precision"] == precision:
                return
            disable()
        original = getattr(base, NAME)
        replacement = make_attention(original, precision)
        for module in _model_modules():
            if getattr(module, NAME, None) is original:
                setattr(module, NAME, replacement)
        _state.update(original=original, replacement=replacement, precision=precision)


def disable() -> None:
    """Put mlx-lm's own function objects back everywhere (idempotent)."""
    with _lock:
        original, replacement = _state["original"], _state["replacement"]
        if replacement is None:
            return
        for module in _model_modules():
            if getattr(module, NAME, None) is replacement:
                setattr(module, NAME, original)
        _state.update(original=None, replacement=None, precision=None)


def is_enabled() -> bool:
    with _lock:
        return _state["replacement"] is not None


def precision() -> str | None:
    with _lock:
        return _state["precision"]
