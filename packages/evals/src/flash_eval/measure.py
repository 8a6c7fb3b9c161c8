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


# On a GPU an evaluation carries a fixed overhead (graph building, launch,
# synchronisation: 0.3-1.3 ms on an H200) that a model's forward pass
# spreads over many calls: calls shorter than BATCH_BELOW_S are timed in
# batches of up to MAX_BATCH that fill about BATCH_BELOW_S, their outputs
# evaluated together, and the time divided by the batch. A batch's calls are
# chained when a `chain` is given (each call's queries the last one's output,
# as a model's layers follow one another); independent calls MLX's CUDA graph
# may run side by side, which times their throughput, not a call's latency
# (up to ~15% less time a call).
BATCH_BELOW_S = 0.02
MAX_BATCH = 20
# Short calls are noisy: they are repeated until at least MIN_TIMED_S has been
# timed (at most MAX_REPEATS times); slow ones run the repeats asked for.
MIN_TIMED_S = 0.25
MAX_REPEATS = 100


def _batch(first_s: float, on_gpu: bool) -> int:
    if not on_gpu or first_s >= BATCH_BELOW_S:
        return 1
    return min(MAX_BATCH, max(2, int(BATCH_BELOW_S / max(first_s, 1e-6))))


def _more(times: list[float], repeats: int) -> bool:
    """Whether to time another repeat: until `repeats` are timed and, for
    short calls, until MIN_TIMED_S has been (at most MAX_REPEATS)."""
    return len(times) < repeats or (sum(times) < MIN_TIMED_S and len(times) < MAX_REPEATS)


def measure(fn: Callable[[], mx.array], repeats: int = 3, warmup: int = 1,
            chain: Callable[[mx.array], mx.array] | None = None) -> tuple[mx.array, Measurement]:
    """Run fn (which returns a lazy MLX array) to completion repeatedly. The
    first timed call runs alone: it gives the peak-memory figure and decides
    the batch; when later calls are batched, its time (which carries a whole
    evaluation's overhead) is not kept. Repeats follow _more(). chain(x): the
    call again on the output x of the one before (a batch's calls after the
    first); without it a batch's calls are independent. Returns fn()'s
    output."""
    out = None
    for _ in range(warmup):
        out = fn()
        mx.eval(out)
        del out
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    start = time.perf_counter()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    first = time.perf_counter() - start
    peak = mx.get_peak_memory() - before
    batch = _batch(first, mx.default_device() == mx.gpu)
    times = [first] if batch == 1 else []
    while _more(times, repeats):
        mx.synchronize()
        start = time.perf_counter()
        outs = [fn()]
        for _ in range(batch - 1):
            outs.append(chain(outs[-1]) if chain else fn())
        mx.eval(outs)
        mx.synchronize()
        times.append((time.perf_counter() - start) / batch)
        out = outs[0]
        del outs
    return out, Measurement(times, peak)


def measure_host(fn: Callable[[], object], repeats: int = 3, warmup: int = 1,
                 sync: Callable[[], None] = lambda: None, on_gpu: bool = False) -> tuple[object, Measurement]:
    """Time another library's calls (e.g. PyTorch); sync() waits for its
    device. No MLX memory figure. Short calls on a GPU are batched and fast
    calls repeated as in measure()."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    first = time.perf_counter() - start
    batch = _batch(first, on_gpu)
    times = [first] if batch == 1 else []
    while _more(times, repeats):
        start = time.perf_counter()
        for _ in range(batch):
            out = fn()
        sync()
        times.append((time.perf_counter() - start) / batch)
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


def page_setting() -> str | None:
    """On Linux, which page size the copy and MLX's buffers stream through.
    Transparent huge pages in "madvise" mode (a common default) go only to
    memory that asks for them: NumPy asks for its large arrays (so the copy
    above gets them), MLX's CPU buffers ask only when glibc's malloc is told
    to (GLIBC_TUNABLES=glibc.malloc.hugetlb=1). A decode that streams its
    keys and values through 4 KiB pages is held to a copy that did not."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None
    try:  # NumPy 2, then NumPy 1 (1.20 on)
        from numpy._core.multiarray import _get_madvise_hugepage
    except ImportError:
        try:
            from numpy.core.multiarray import _get_madvise_hugepage
        except ImportError:
            _get_madvise_hugepage = lambda: False  # noqa: E731 (older NumPy cannot say: assumed not)
    numpy_asks = _get_madvise_hugepage()
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    mlx_asks = any(t in tunables for t in ("glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=2"))

    def pages(asks: bool) -> str:
        return "huge pages" if mode == "always" or (mode == "madvise" and asks) else "4 KiB pages"

    return f"transparent huge pages: {mode}; the copy on {pages(numpy_asks)}, MLX's buffers on {pages(mlx_asks)}"


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.1f} MiB"


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms" if seconds < 0.01 else f"{seconds * 1e3:,.1f} ms"
