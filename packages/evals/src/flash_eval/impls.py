"""The attention implementations a kernel benchmark compares, on one input set."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from flashattn_core import flash_attention

from .shapes import KernelCase

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class Inputs:
    case: KernelCase
    q: mx.array
    k: mx.array
    v: mx.array

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.case.shape.E)

    @property
    def mask(self):
        return "causal" if self.case.causal else None


def make_inputs(case: KernelCase, seed: int = 0) -> Inputs:
    s = case.shape
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    dtype = DTYPES[case.dtype]
    q = mx.random.normal((1, s.H_q, case.L, s.E), key=kq).astype(dtype)
    k = mx.random.normal((1, s.H_kv, case.S, s.E), key=kk).astype(dtype)
    v = mx.random.normal((1, s.H_kv, case.S, s.E), key=kv).astype(dtype)
    mx.eval(q, k, v)
    return Inputs(case, q, k, v)


@dataclass
class Impl:
    name: str  # short: "flash", "mlx", "torch", "torch-flash", "torch-cudnn"
    description: str
    on_mlx: bool  # timed with MLX's evaluation and memory counters
    run: Callable[[], object]
    to_numpy: Callable[[object], np.ndarray]
    sync: Callable[[], None] = lambda: None
    # run again on the given queries (the last call's output): MLX calls
    # chained in one evaluation, as a model's layers are (measure.py)
    chain: Callable[[object], object] | None = None


def mlx_to_numpy(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def flash_impl(inp: Inputs) -> Impl:
    return Impl(
        "flash",
        "flashattn_core.flash_attention",
        True,
        lambda: flash_attention(inp.q, inp.k, inp.v, scale=inp.scale, mask=inp.mask),
        mlx_to_numpy,
        chain=lambda q: flash_attention(q, inp.k, inp.v, scale=inp.scale, mask=inp.mask),
    )


def mlx_impl(inp: Inputs) -> Impl:
    return Impl(
        "mlx",
        f"mx.fast.scaled_dot_product_attention (MLX {mx.__version__})",
        True,
        lambda: mx.fast.scaled_dot_product_attention(inp.q, inp.k, inp.v, scale=inp.scale, mask=inp.mask),
        mlx_to_numpy,
        chain=lambda q: mx.fast.scaled_dot_product_attention(q, inp.k, inp.v, scale=inp.scale, mask=inp.mask),
    )


def torch_impls(inp: Inputs) -> list[Impl]:
    """PyTorch's scaled_dot_product_attention, when installed: on the CPU when
    MLX runs there; on CUDA, its flash and cuDNN backends separately."""
    try:
        import torch
    except ImportError:
        return []
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[inp.case.dtype]
    on_gpu = mx.default_device() == mx.gpu
    if on_gpu and not torch.cuda.is_available():
        return []
    device = "cuda" if on_gpu else "cpu"
    q, k, v = (torch.from_numpy(mlx_to_numpy(x)).to(device=device, dtype=tdtype) for x in (inp.q, inp.k, inp.v))
    # PyTorch's is_causal is top-left aligned; for L = S that is MLX's mask.
    causal = inp.case.causal
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def make(backend):
        def run():
            with torch.no_grad():
                if backend is None:
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal, scale=inp.scale, enable_gqa=True)
                from torch.nn.attention import sdpa_kernel

                with sdpa_kernel(backend):
                    # The fused backends take no GQA: repeat K/V heads outside
                    # the timing (as a caller of them would have to).
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, kr, vr, is_causal=causal, scale=inp.scale)
        return run

    version = torch.__version__
    if not on_gpu:
        text = f"torch.nn.functional.scaled_dot_product_attention (PyTorch {version}, {torch.get_num_threads()} threads)"
        return [Impl("torch", text, False, make(None), lambda t: t.float().cpu().numpy(), sync)]
    from torch.nn.attention import SDPBackend

    ratio = q.shape[-3] // k.shape[-3]
    kr, vr = k.repeat_interleave(ratio, dim=-3), v.repeat_interleave(ratio, dim=-3)
    return [
        Impl(f"torch-{name}", f"PyTorch {version} SDPA, {name} backend (K/V heads repeated for GQA)", False,
             make(backend), lambda t: t.float().cpu().numpy(), sync)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
    ]
