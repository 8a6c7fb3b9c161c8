"""Reference attention in float64 NumPy: the yardstick for tests and benchmarks.

Same conventions as ``flash_attention``: ``(B..., H, L, E)`` layout, GQA by
``h // (H_q // H_kv)``, bottom-right causal masks, boolean masks (True
attends) or additive float masks (-inf hides a key), and zeros for rows that
see no key. Non-finite inputs: a NaN in a query row, or in a key or value the
row can see, makes the row NaN (Inf follows IEEE arithmetic); keys and values
a row cannot see never reach its output.
Needs NumPy (``pip install flashattn-core[reference]``).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np


def to_float64(x) -> np.ndarray:
    """An mx.array or array-like as float64 NumPy (exact for f32/f16/bf16)."""
    if isinstance(x, mx.array):
        if x.dtype == mx.bool_:
            return np.array(x)
        return np.array(x.astype(mx.float32), dtype=np.float64)
    return np.asarray(x, dtype=np.float64)


def dequantize(quantized, E: int) -> np.ndarray:
    """(packed, scales, biases) in MLX's affine format, as ``mx.quantize``
    returns them, for rows of E elements, in float64: element e of a row is
    scales[g] * q_e + biases[g] with g = e // group_size and q_e the e-th
    bits-wide field of the row's uint32 words, lowest bits first (bits = 32 *
    words / E, group_size = E / len(scales))."""
    packed, scales, biases = quantized
    words = np.array(packed).astype(np.uint64)
    s, b = to_float64(scales), to_float64(biases)
    bits = 32 * words.shape[-1] // E
    group_size = E // s.shape[-1]
    shifts = np.arange(32 // bits, dtype=np.uint64) * bits
    q = ((words[..., :, None] >> shifts) & ((1 << bits) - 1)).reshape(*words.shape[:-1], E)
    return q * np.repeat(s, group_size, axis=-1) + np.repeat(b, group_size, axis=-1)


def causal_mask(L: int, S: int, window: int | None = None) -> np.ndarray:
    """Boolean (L, S): query row i sees key j iff j <= i + (S - L), and with a
    sliding window of W keys also j > i + (S - L) - W."""
    last = np.arange(L)[:, None] + (S - L)
    keys = np.arange(S)[None, :]
    visible = keys <= last
    if window is not None:
        visible &= keys > last - window
    return visible


def mask_terms(mask, shape) -> tuple[np.ndarray, np.ndarray | float]:
    """(visible, additive) for a mask argument, broadcast to (B..., H_q, L, S).

    visible is boolean (a hidden key gets no weight); additive is added to the
    scores of visible keys (an additive -inf hides a key as well).
    """
    L, S = shape[-2], shape[-1]
    if mask is None:
        return np.ones(shape, dtype=bool), 0.0
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask string {mask!r}")
        return np.broadcast_to(causal_mask(L, S), shape), 0.0
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        mask = np.array(mask)
    if isinstance(mask, np.ndarray) and mask.dtype == bool:
        return np.broadcast_to(mask, shape), 0.0
    additive = np.broadcast_to(to_float64(mask), shape)
    return ~np.isneginf(additive), additive


def attention_reference(queries, keys, values, *, scale=None, mask=None, sinks=None) -> np.ndarray:
    """softmax(scale * Q K^T + mask) V in float64; rows with no visible key are 0.
    sinks: (H_q,) logits that join every row's softmax denominator and add no
    value (MLX's SDPA ``sinks``)."""
    q, k, v = to_float64(queries), to_float64(keys), to_float64(values)
    *batch, H_q, L, E = q.shape
    H_kv, S = k.shape[-3], k.shape[-2]
    ratio = H_q // H_kv
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)

    # GQA without repeating K/V: query heads as (H_kv, ratio), keys broadcast.
    qg = q.reshape(*batch, H_kv, ratio, L, E)
    kg, vg = k[..., :, None, :, :], v[..., :, None, :, :]
    # IEEE arithmetic on non-finite inputs is the point: no warnings for it.
    with np.errstate(invalid="ignore", over="ignore"):
        scores = (qg @ np.swapaxes(kg, -1, -2)) * scale
        visible, additive = mask_terms(mask, (*batch, H_q, L, S))
        grouped = (*batch, H_kv, ratio, L, S)
        if np.ndim(additive):
            additive = additive.reshape(grouped)
        scores = np.where(visible.reshape(grouped), scores + additive, -np.inf)

        m = np.max(scores, axis=-1, keepdims=True)
        if sinks is not None:
            sink = to_float64(sinks).reshape(H_kv, ratio, 1, 1)
            m = np.maximum(m, sink)
        m = np.where(np.isneginf(m), 0.0, m)  # rows with no visible key
        p = np.exp(scores - m)
    l = np.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sink - m)
    if np.isfinite(v).all():
        o = p @ vg
    else:
        # Keys a row cannot see never reach its output, even when their
        # values are NaN or Inf (p @ v would make 0 x NaN = NaN).
        seen = visible.reshape(grouped)[..., None]
        with np.errstate(invalid="ignore"):
            o = np.where(seen, p[..., None] * vg[..., None, :, :], 0.0).sum(axis=-2)
    o = o.reshape(*batch, H_q, L, E)
    l = l.reshape(*batch, H_q, L, 1)
    # l == 0 only for rows with no visible key; NaN inputs keep l = NaN.
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(l == 0, 0.0, o / l)


def attention_gradients_reference(queries, keys, values, d_out, *, scale=None, mask=None, sinks=None, sizes=False):
    """(dQ, dK, dV) of softmax(scale * Q K^T + mask) V against the cotangent
    d_out, in float64, for finite inputs: with P the probabilities (0 for
    hidden keys and for rows with no visible key), dV = P^T dO, dS = P * (dP -
    D) with dP = dO V^T and D = rowsum(dO * O), dQ = scale dS K, dK = scale
    dS^T Q; GQA gradients of K and V summed over each group's query heads.

    sinks: (H_q,) logits in every row's denominator (attention_reference's);
    then also d sinks = -sum over a head's rows of p_sink D, a fourth gradient.

    sizes=True also returns, per gradient, the norm of what a float32
    computation sums before dP - D cancels (dQ and dK computed with P * dP in
    place of dS; dV's own norm): the scale of its rounding error, which stays
    meaningful where the gradient itself cancels to nothing (one key, say)."""
    q, k, v, do = (to_float64(x) for x in (queries, keys, values, d_out))
    *batch, H_q, L, E = q.shape
    H_kv, S = k.shape[-3], k.shape[-2]
    ratio = H_q // H_kv
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    grouped = (*batch, H_kv, ratio, L)
    qg, dog = q.reshape(*grouped, E), do.reshape(*grouped, E)
    kg, vg = k[..., :, None, :, :], v[..., :, None, :, :]
    scores = (qg @ np.swapaxes(kg, -1, -2)) * scale
    visible, additive = mask_terms(mask, (*batch, H_q, L, S))
    if np.ndim(additive):
        additive = additive.reshape(*grouped, S)
    visible = visible.reshape(*grouped, S)
    with np.errstate(invalid="ignore"):
        scores = np.where(visible, scores + additive, -np.inf)
        m = np.max(scores, axis=-1, keepdims=True)
        if sinks is not None:
            sink = to_float64(sinks).reshape(H_kv, ratio, 1, 1)
            m = np.maximum(m, sink)
        m = np.where(np.isneginf(m), 0.0, m)
        p = np.exp(scores - m)
    l = np.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sink - m)
    P = p / np.where(l == 0, 1.0, l)
    o = P @ vg
    dP = dog @ np.swapaxes(vg, -1, -2)
    D = np.sum(dog * o, axis=-1, keepdims=True)
    dS = P * (dP - D)
    dq = (dS @ kg) * scale
    dk = np.sum(np.swapaxes(dS, -1, -2) @ qg, axis=-3) * scale
    dv = np.sum(np.swapaxes(P, -1, -2) @ dog, axis=-3)
    grads = (dq.reshape(q.shape), dk, dv)
    size_s = []
    if sinks is not None:
        # (batch..., H_kv, ratio, L, 1) -> (H_q,): summed over batch and rows.
        p_sink = np.exp(sink - m) / np.where(l == 0, 1.0, l)
        axes = tuple(range(len(batch))) + (-2, -1)
        grads += (-np.sum(p_sink * D, axis=axes).reshape(H_q),)
        size_s = [np.linalg.norm(np.sum(np.abs(p_sink * D), axis=axes))]
    if not sizes:
        return grads
    terms = np.abs(P * dP)
    size_q = np.linalg.norm((terms @ np.abs(kg)) * scale)
    size_k = np.linalg.norm(np.sum(np.swapaxes(terms, -1, -2) @ np.abs(qg), axis=-3) * scale)
    return grads, (size_q, size_k, np.linalg.norm(dv), *size_s)


def relative_error(out, ref) -> float:
    """Relative Frobenius-norm error ||out - ref|| / ||ref|| (0 when both are 0)."""
    out, ref = to_float64(out), to_float64(ref)
    denom = np.linalg.norm(ref)
    diff = np.linalg.norm(out - ref)
    return float(diff / denom) if denom > 0 else float(diff)
