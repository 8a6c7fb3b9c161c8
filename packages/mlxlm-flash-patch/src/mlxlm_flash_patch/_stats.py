"""Counts of what the patch did: calls through flash_attention and fallbacks
per reason, each reason logged once. No MLX import here."""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("mlxlm_flash_patch")

_lock = threading.Lock()
_flash_calls = 0
_fallbacks: Counter = Counter()
_logged: set[str] = set()


def count_flash_call() -> None:
    global _flash_calls
    with _lock:
        _flash_calls += 1


def count_fallback(reason: str, detail: str = "") -> None:
    with _lock:
        _fallbacks[reason] += 1
        first = reason not in _logged
        _logged.add(reason)
    if first:
        log.warning("attention falls back to mlx-lm's own path: %s%s", reason, f" ({detail})" if detail else "")


def stats() -> dict:
    """Calls routed through flash_attention, and fallbacks per reason."""
    with _lock:
        return {"flash_calls": _flash_calls, "fallbacks": dict(_fallbacks)}


def reset_stats() -> None:
    global _flash_calls
    with _lock:
        _flash_calls = 0
        _fallbacks.clear()
        _logged.clear()
