"""Pacing a quantized-cache prefill on CUDA: the host waits for the GPU every
few layers instead of running a whole prefill step ahead of it.

MLX's CUDA backend keeps every array a queued kernel reads until that kernel
completes, and lets the host queue up to ten command buffers ahead of the
GPU: a whole prefill step's arrays at once. Unpaced, a 16K-token prompt over
a 4-bit cache then held more than the 4-bit cache saved (docs/cuda.md,
quantized caches). Here each attention call of a quantized cache's prefill
step is scheduled as soon as it is built and the host waits for the call
DEPTH calls back: at most DEPTH + 1 layers are queued on the GPU.
"""

from __future__ import annotations

import os
import threading
from collections import deque

import mlx.core as mx

from ._startup import OFF

# Attention calls (layers) queued ahead of the host: two keep the GPU busy
# while the host builds the next layer. (Scheduling every second or fourth
# call instead held more and was no faster.)
DEPTH = 2
# Prefill steps only: a decode (or a speculative step of a few rows) keeps
# mlx-lm's own overlap of building the next token with running this one.
MIN_ROWS = 64
# MLX_FLASH_ATTENTION_PACING=0 (or any of MLX_FLASH_ATTENTION's off values)
# turns it off: measurements, or a user who prefers the host to run ahead.
ENV = "MLX_FLASH_ATTENTION_PACING"

_local = threading.local()


def enabled() -> bool:
    """Whether this thread's quantized-cache prefill calls are paced now."""
    off = os.environ.get(ENV, "1").strip().lower() in OFF
    return not off and mx.default_device() == mx.gpu and mx.cuda.is_available()


def pace(out: mx.array, rows: int) -> None:
    """Schedule out (an attention call's output) now; wait for the call DEPTH
    calls back on this thread. Calls that are not paced end the run."""
    queued = getattr(_local, "queued", None)
    if rows < MIN_ROWS or not enabled():
        if queued:
            queued.clear()
        return
    try:
        mx.async_eval(out)
    except ValueError:  # under mx.compile, grad or vmap: MLX schedules the whole graph itself
        return
    if queued is None:
        queued = _local.queued = deque()
    queued.append(out)
    if len(queued) > DEPTH:
        mx.eval(queued.popleft())
