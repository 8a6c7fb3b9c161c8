"""The attention implementations a kernel benchmark compares, on one input set."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
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
    # (k, v) and copies of them, which an implementation's calls take in
    # turn (make_inputs), so that a batch of calls reads its keys and values
    # from memory as a model's layers do, each from its own cache.
    kv_sets: list[tuple[mx.array, mx.array]] = field(default_factory=list)
    # A windowed case's band as a boolean (L, S) mask, for the implementations
    # that take no window.
    band: mx.array | None = None
    # A quantized case's keys and values, each (packed, scales, biases), one
    # pair per K/V set; the plain k, v above are what they were made from.
    quantized_sets: list[tuple[tuple, tuple]] = field(default_factory=list)
    # A case with sinks: one logit per query head, which every implementation takes as sinks=.
    sinks: mx.array | None = None

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.case.shape.E)

    @property
    def mask(self):
        if self.band is not None:
            return self.band
        return "causal" if self.case.causal else None

    @property
    def flash_args(self) -> dict:
        """flash_attention's mask arguments (a window where the case has one) and sinks."""
        args = {"mask": "causal", "window": self.case.window} if self.case.window else {"mask": self.mask}
        return {**args, **self.sink_args}

    @property
    def sink_args(self) -> dict:
        return {"sinks": self.sinks} if self.sinks is not None else {}

    def reference_kv(self) -> tuple:
        """The keys and values the float64 reference takes: a quantized case's
        dequantized in float64."""
        if not self.quantized_sets:
            return self.k, self.v
        from flashattn_core.reference import dequantize

        kq, vq = self.quantized_sets[0]
        return dequantize(kq, self.case.shape.E), dequantize(vq, self.case.shape.E)


def make_inputs(case: KernelCase, seed: int = 0, kv_sets: int = 1) -> Inputs:
    """Random inputs, with kv_sets - 1 copies of k and v (the same values in
    other buffers: every call computes the same function)."""
    s = case.shape
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    dtype = DTYPES[case.dtype]
    q = mx.random.normal((1, s.H_q, case.L, s.E), key=kq).astype(dtype)
    k = mx.random.normal((1, s.H_kv, case.S, s.E), key=kk).astype(dtype)
    v = mx.random.normal((1, s.H_kv, case.S, s.E), key=kv).astype(dtype)
    sets = [(k, v)] + [(k + 0, v + 0) for _ in range(kv_sets - 1)]
    band = None
    if case.window:
        from flashattn_core.reference import causal_mask

        band = mx.array(causal_mask(case.L, case.S, case.window))
    quantized = []
    if case.kv_bits:
        quantize = lambda x: tuple(mx.quantize(x, group_size=case.kv_group_size, bits=case.kv_bits))
        quantized = [(quantize(k_), quantize(v_)) for k_, v_ in sets]
    # Logits around the scores' own size, so that each sink takes a real share of its rows; in the
    # inputs' dtype, as MLX's SDPA wants them.
    sinks = mx.random.normal((s.H_q,), key=mx.random.key(seed + 1)).astype(dtype) if case.sinks else None
    mx.eval(q, sets, band, quantized, sinks)
    return Inputs(case, q, k, v, sets, band, quantized, sinks)


def kv_turns(inp: Inputs, quantized: bool = False) -> Callable[[], tuple]:
    """The next (k, v) of inp's sets at each call, round and round: the
    quantized triples where asked for."""
    turns = itertools.cycle(inp.quantized_sets if quantized else inp.kv_sets or [(inp.k, inp.v)])
    return lambda: next(turns)


@dataclass
class Impl:
    name: str  # short: "flash", "flash-f32", "mlx", "torch", "torch-flash", "torch-cudnn"
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


def mlx_call(inp: Inputs, attention: Callable, masking: dict | None = None,
             quantized: bool = False) -> Callable[[mx.array], mx.array]:
    """attention(q, k, v, scale=, **masking) on the given queries and the next
    K/V set (quantized: its triples); masking defaults to mask=inp.mask."""
    next_kv = kv_turns(inp, quantized)
    masking = {"mask": inp.mask} if masking is None else masking

    def call(q: mx.array) -> mx.array:
        k, v = next_kv()
        return attention(q, k, v, scale=inp.scale, **masking)

    return call


def flash_impl(inp: Inputs) -> Impl:
    quantized = bool(inp.quantized_sets)
    call = mlx_call(inp, flash_attention, inp.flash_args, quantized)
    text = "flashattn_core.flash_attention" + (", quantized keys and values read in place" if quantized else "")
    return Impl("flash", text, True, lambda: call(inp.q), mlx_to_numpy, chain=call)


def widened(inp: Inputs) -> Callable:
    """flash_attention(..., dtype=mx.float32, out_dtype=<the inputs' dtype>):
    float32 attention rounded once to the inputs' dtype, the call
    mlxlm-flash-patch makes by default on a 16-bit model."""
    dtype = inp.q.dtype
    return lambda q, k, v, **kw: flash_attention(q, k, v, dtype=mx.float32, out_dtype=dtype, **kw)


WIDENED_TEXT = ("flashattn_core.flash_attention(..., dtype=mx.float32, out_dtype=<the inputs' dtype>) over the "
                "16-bit inputs (mlxlm-flash-patch's default)")


def flash_f32_impl(inp: Inputs) -> Impl:
    quantized = bool(inp.quantized_sets)
    call = mlx_call(inp, widened(inp), inp.flash_args, quantized)
    return Impl("flash-f32", WIDENED_TEXT, True, lambda: call(inp.q), mlx_to_numpy, chain=call)


def flash_plain_impl(inp: Inputs) -> Impl:
    """flash_attention on the keys and values a quantized case was made from,
    in the case's dtype."""
    call = mlx_call(inp, flash_attention, inp.flash_args)
    return Impl("flash-plain", f"flashattn_core.flash_attention, unquantized {inp.case.dtype} keys and values "
                "(its |err| is against the dequantized ones: the quantization's own)", True,
                lambda: call(inp.q), mlx_to_numpy, chain=call)


def mlx_lm_quantized_impl(inp: Inputs) -> Impl:
    """mlx-lm's attention over a QuantizedKVCache (mx.quantized_matmul, the
    L x S scores materialised). It scales its queries argument in place: each
    call gets a copy."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    def attention(q, k, v, scale, mask):
        return quantized_scaled_dot_product_attention(q + 0, k, v, scale=scale, mask=mask,
                                                      group_size=inp.case.kv_group_size, bits=inp.case.kv_bits)

    call = mlx_call(inp, attention, quantized=True)
    return Impl("mlx", "mlx_lm.models.base.quantized_scaled_dot_product_attention", True, lambda: call(inp.q),
                mlx_to_numpy, chain=call)


def flash_dense_impl(inp: Inputs) -> Impl:
    """flash_attention given a windowed case's band as a boolean mask: what a
    caller that passes mlx-lm's sliding-window mask as it is gets."""
    call = mlx_call(inp, flash_attention, {"mask": inp.mask, **inp.sink_args})
    return Impl("flash-dense", "flashattn_core.flash_attention, the window as a dense boolean mask", True,
                lambda: call(inp.q), mlx_to_numpy, chain=call)


def mlx_impl(inp: Inputs) -> Impl:
    if inp.quantized_sets:
        return mlx_lm_quantized_impl(inp)
    call = mlx_call(inp, mx.fast.scaled_dot_product_attention, {"mask": inp.mask, **inp.sink_args})
    return Impl(
        "mlx",
        f"mx.fast.scaled_dot_product_attention (MLX {mx.__version__})",
        True,
        lambda: call(inp.q),
        mlx_to_numpy,
        chain=call,
    )


def torch_impls(inp: Inputs, grad: bool = False) -> list[Impl]:
    """PyTorch's scaled_dot_product_attention, when installed: on the CPU when
    MLX runs there; on CUDA, its flash and cuDNN backends separately. With
    grad, each call runs the forward and the backward (autograd, against the
    same cotangent as the MLX implementations) and returns dQ."""
    if inp.quantized_sets or inp.sinks is not None:
        return []  # PyTorch's SDPA takes no quantized keys and values, nor sinks
    try:
        import torch
    except ImportError:
        return []
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[inp.case.dtype]
    on_gpu = mx.default_device() == mx.gpu
    if on_gpu and not torch.cuda.is_available():
        return []
    device = "cuda" if on_gpu else "cpu"

    def to_torch(x: mx.array):
        return torch.from_numpy(mlx_to_numpy(x)).to(device=device, dtype=tdtype)

    q, k, v = to_torch(inp.q), to_torch(inp.k), to_torch(inp.v)
    sets = len(inp.kv_sets) or 1
    # PyTorch's is_causal is top-left aligned: MLX's mask for L = S only. A
    # chunk's queries are the last L of S (bottom-right aligned): on CUDA
    # PyTorch's lower-right causal bias (which its fused backends take
    # without a dense mask), on the CPU the boolean mask.
    L, S = inp.case.L, inp.case.S
    lower_right = inp.case.causal and L != S
    causal = inp.case.causal and not lower_right and not inp.case.window
    mask = None
    if inp.case.window:
        from flashattn_core.reference import causal_mask

        mask = torch.from_numpy(causal_mask(L, S, inp.case.window)).to(device)
    elif lower_right and on_gpu:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(L, S)
    elif lower_right:
        from flashattn_core.reference import causal_mask

        mask = torch.from_numpy(causal_mask(L, S))
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    cot = to_torch(cotangent(inp)) if grad else None

    def make(backend, kv):
        # Copies of kv, taken in turn as the MLX implementations take theirs.
        turns = itertools.cycle([kv] + [tuple(x.clone() for x in kv) for _ in range(sets - 1)])
        q_in = q.detach().clone().requires_grad_(True) if grad else q

        def attention(kt, vt):
            if backend is None:
                return torch.nn.functional.scaled_dot_product_attention(
                    q_in, kt, vt, attn_mask=mask, is_causal=causal, scale=inp.scale, enable_gqa=True)
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q_in, kt, vt, attn_mask=mask, is_causal=causal, scale=inp.scale)

        def run():
            kt, vt = next(turns)
            if not grad:
                with torch.no_grad():
                    return attention(kt, vt)
            kt, vt = kt.detach().requires_grad_(True), vt.detach().requires_grad_(True)
            q_in.grad = None
            with torch.enable_grad():
                attention(kt, vt).backward(cot)
            return q_in.grad
        return run

    version = torch.__version__
    if not on_gpu:
        text = f"torch.nn.functional.scaled_dot_product_attention (PyTorch {version}, {torch.get_num_threads()} threads)"
        text += ", forward + autograd backward" if grad else ""
        return [Impl("torch", text, False, make(None, (k, v)), lambda t: t.float().cpu().numpy(), sync)]
    from torch.nn.attention import SDPBackend

    # The fused backends take no GQA: K/V heads repeated outside the timing
    # (as a caller of them would have to).
    ratio = q.shape[-3] // k.shape[-3]
    repeated = (k.repeat_interleave(ratio, dim=-3), v.repeat_interleave(ratio, dim=-3))
    return [
        Impl(f"torch-{name}", f"PyTorch {version} SDPA, {name} backend (K/V heads repeated for GQA)"
             + (", forward + autograd backward" if grad else ""), False,
             make(backend, repeated), lambda t: t.float().cpu().numpy(), sync)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
    ]


# --- Gradients (flash-eval kernel --pass both|backward) ---------------------


def cotangent(inp: Inputs, seed: int = 11) -> mx.array:
    """The gradient of the output every implementation is differentiated
    against: fixed random values, so that no term cancels."""
    c = mx.random.normal(inp.q.shape, key=mx.random.key(seed)).astype(inp.q.dtype)
    mx.eval(c)
    return c


def mlx_grad_call(inp: Inputs, attention: Callable, masking: dict | None = None) -> Callable[[], list[mx.array]]:
    """Forward and backward of attention(q, k, v) on the next K/V set: its
    output and (dQ, dK, dV), lazy. Returns the list [out, dq, dk, dv]."""
    next_kv = kv_turns(inp)
    cot = cotangent(inp)
    masking = {"mask": inp.mask} if masking is None else masking
    f = lambda q, k, v: attention(q, k, v, scale=inp.scale, **masking)

    def call() -> list[mx.array]:
        k, v = next_kv()
        outs, grads = mx.vjp(f, [inp.q, k, v], [cot])
        return [*outs, *grads]

    return call


def grad_rows_to_numpy(x: list[mx.array]) -> np.ndarray:
    return mlx_to_numpy(x[1])  # dQ


def flash_grad_impl(inp: Inputs) -> Impl:
    return Impl("flash", "flashattn_core.flash_attention, forward + mx.vjp", True,
                mlx_grad_call(inp, flash_attention, inp.flash_args), grad_rows_to_numpy)


def flash_f32_grad_impl(inp: Inputs) -> Impl:
    return Impl("flash-f32", WIDENED_TEXT + ", forward + mx.vjp", True,
                mlx_grad_call(inp, widened(inp), inp.flash_args), grad_rows_to_numpy)


def flash_dense_grad_impl(inp: Inputs) -> Impl:
    return Impl("flash-dense", "flashattn_core.flash_attention, the window as a dense boolean mask, forward + mx.vjp",
                True, mlx_grad_call(inp, flash_attention), grad_rows_to_numpy)


def mlx_grad_impl(inp: Inputs) -> Impl:
    return Impl("mlx", f"mx.fast.scaled_dot_product_attention (MLX {mx.__version__}), forward + mx.vjp", True,
                mlx_grad_call(inp, mx.fast.scaled_dot_product_attention), grad_rows_to_numpy)
