"""Timing and memory of one MLX computation, measured the same way everywhere."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx


@dataclass
class Measurement:
    times_s: list[float]
    peak_extra_bytes: int  # MLX's peak memory above what was live before the call

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def measure(fn: Callable[[], mx.array], repeats: int = 3, warmup: int = 1) -> tuple[mx.array, Measurement]:
    """Run fn (which returns a lazy array) to completion repeatedly."""
    out = None
    for _ in range(warmup):
        out = fn()
        mx.eval(out)
        del out
    mx.synchronize()
    times = []
    peak = 0
    for _ in range(repeats):
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        start = time.perf_counter()
        out = fn()
        mx.eval(out)
        mx.synchronize()
        times.append(time.perf_counter() - start)
        peak = max(peak, mx.get_peak_memory() - before)
    return out, Measurement(times, peak)


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"
