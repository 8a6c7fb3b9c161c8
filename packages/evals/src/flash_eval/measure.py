"""Timing, memory and bandwidth, measured the same way everywhere."""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np


@dataclass
class Measurement:
    times_s: list[float]
    peak_extra_bytes: int | None  # MLX's peak memory above what was live before

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def measure(fn: Callable[[], mx.array], repeats: int = 3, warmup: int = 1) -> tuple[mx.array, Measurement]:
    """Run fn (which returns a lazy MLX array) to completion repeatedly."""
    out = None
    for _ in range(warmup):
        out = fn()
        mx.eval(out)
        del out
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


def measure_host(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> tuple[object, Measurement]:
    """Time a synchronous call (e.g. PyTorch on the CPU); no MLX memory figure."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return out, Measurement(times, None)


def copy_bandwidth(nbytes: int = 1 << 29, threads: int | None = None, repeats: int = 5) -> float:
    """The machine's memory bandwidth as a STREAM-style copy on every core:
    bytes read plus bytes written per second, best of `repeats`."""
    threads = threads or len(os.sched_getaffinity(0))
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    chunks = np.array_split(np.arange(src.size), threads)
    bounds = [(c[0], c[-1] + 1) for c in chunks if c.size]

    def part(b):
        np.copyto(dst[b[0] : b[1]], src[b[0] : b[1]])

    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, bounds))  # fault the pages in
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(part, bounds))
            best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.1f} MiB"


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms" if seconds < 0.01 else f"{seconds * 1e3:,.1f} ms"
