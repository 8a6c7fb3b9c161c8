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


# On a GPU one call can be shorter than the launch and graph overhead around
# it: calls that take less than this are timed in batches, their outputs
# evaluated together, and the time divided by the batch.
BATCH_BELOW_S = 0.002
MAX_BATCH = 20


def measure(fn: Callable[[], mx.array], repeats: int = 3, warmup: int = 1) -> tuple[mx.array, Measurement]:
    """Run fn (which returns a lazy MLX array) to completion repeatedly; the
    peak-memory figure comes from single calls."""
    out = None
    for _ in range(warmup):
        out = fn()
        mx.eval(out)
        del out
    times = []
    peak = 0
    batch = 1
    for i in range(repeats):
        mx.synchronize()
        if batch == 1:
            mx.reset_peak_memory()
            before = mx.get_active_memory()
        start = time.perf_counter()
        outs = [fn() for _ in range(batch)]
        mx.eval(outs)
        mx.synchronize()
        elapsed = (time.perf_counter() - start) / batch
        if batch == 1:
            peak = max(peak, mx.get_peak_memory() - before)
        times.append(elapsed)
        out = outs[-1]
        del outs
        if i == 0 and mx.default_device() == mx.gpu and elapsed < BATCH_BELOW_S:
            batch = min(MAX_BATCH, max(2, int(BATCH_BELOW_S / max(elapsed, 1e-6))))
    return out, Measurement(times, peak)


def measure_host(fn: Callable[[], object], repeats: int = 3, warmup: int = 1,
                 sync: Callable[[], None] = lambda: None) -> tuple[object, Measurement]:
    """Time another library's calls (e.g. PyTorch); sync() waits for its
    device. No MLX memory figure. Short calls are batched as in measure()."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync()
    times = []
    batch = 1
    for i in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            out = fn()
        sync()
        elapsed = (time.perf_counter() - start) / batch
        times.append(elapsed)
        if i == 0 and elapsed < BATCH_BELOW_S:
            batch = min(MAX_BATCH, max(2, int(BATCH_BELOW_S / max(elapsed, 1e-6))))
    return out, Measurement(times, None)


def device_copy_bandwidth(nbytes: int = 1 << 31, repeats: int = 5) -> float:
    """Read + write bytes per second of a large copy on MLX's default device."""
    x = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(x)
    best = float("inf")
    for _ in range(repeats + 1):
        mx.synchronize()
        start = time.perf_counter()
        y = mx.add(x, 0.0)
        mx.eval(y)
        mx.synchronize()
        best = min(best, time.perf_counter() - start)
        del y
    return 2 * x.nbytes / best


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
