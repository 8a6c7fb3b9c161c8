"""Counts of what the patch did: calls through flash_attention and fallbacks
per reason, each reason logged once; and how gradients through
flash_attention were taken (flashattn_core's counts). No MLX import at module
level: the startup hook imports this package."""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("mlxlm_flash_patch")

_lock = threading.Lock()
_flash_calls = 0
_windowed_calls = 0
_fallbacks: Counter = Counter()
_logged: set[str] = set()


def count_flash_call(windowed: bool = False) -> None:
    global _flash_calls, _windowed_calls
    with _lock:
        _flash_calls += 1
        _windowed_calls += windowed


def count_fallback(reason: str, detail: str = "") -> None:
    with _lock:
        _fallbacks[reason] += 1
        first = reason not in _logged
        _logged.add(reason)
    if first:
        log.warning("attention falls back to mlx-lm's own path: %s%s", reason, f" ({detail})" if detail else "")


def stats() -> dict:
    """Calls routed through flash_attention (of them, "windowed_calls": a
    sliding-window layer's band mask passed as a window), fallbacks per
    reason, and the gradients taken through it: "fused" (the FlashAttention-2 backward) or
    "recomputed" per reason (MLX operations over the L x S probabilities)."""
    from flashattn_core import gradient_stats

    with _lock:
        return {"flash_calls": _flash_calls, "windowed_calls": _windowed_calls, "fallbacks": dict(_fallbacks),
                "gradients": gradient_stats()}


def reset_stats() -> None:
    from flashattn_core import reset_gradient_stats

    global _flash_calls, _windowed_calls
    with _lock:
        _flash_calls = 0
        _windowed_calls = 0
        _fallbacks.clear()
        _logged.clear()
    reset_gradient_stats()
