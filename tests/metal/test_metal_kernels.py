"""Every Metal kernel flashattn-core ships, compiled from the shipped source
and run by the emulator (tests/metal_emulator) through the same dispatch as
on an Apple GPU, against the float64 reference over the CPU correctness
matrix: every mask kind, non-multiple-of-32 sizes, GQA, batch shapes,
dtypes and layouts. Lanes run in a shuffled order between synchronisation
points, a different one per case, so a missing barrier shows."""

import zlib

import mlx.core as mx
import numpy as np
import pytest

import metal_emulator
from attention_cases import DTYPES, MASKS, MATRIX, TOLERANCE, Case, make_inputs

from flashattn_core import flash_attention, gradient_stats, reset_gradient_stats
from flashattn_core.reference import (attention_gradients_reference, attention_reference, causal_mask, dequantize,
                                      relative_error)

# The emulator compiles the kernels with clang: without it nothing here can run.
pytestmark = pytest.mark.skipif(metal_emulator.find_compiler() is None, reason=metal_emulator.MISSING_COMPILER)

MATRIX_DIMS = {64, 80, 96, 128}  # the head dims flash_mma has


def kernels_for(case):
    """(kernel, forced decode splits) pairs that can run this case."""
    runs = [("auto", 0), ("rows", 0), ("decode", 3)]
    if case.E in MATRIX_DIMS:
        runs.append(("matrix", 0))
    return runs


RUNS = [(case, kernel, splits) for case in MATRIX for kernel, splits in kernels_for(case)]


def check(out, q, k, v, mask, dtype, scale=None):
    assert out.shape == q.shape and out.dtype == q.dtype
    got = np.array(out.astype(mx.float32))
    assert not np.isnan(got).any(), "NaN in the output (an element no kernel wrote stays NaN)"
    assert relative_error(got, attention_reference(q, k, v, scale=scale, mask=mask)) <= TOLERANCE[dtype]


def test_every_kernel_runs_on_every_mask_kind():
    assert {kernel for _, kernel, _ in RUNS} == {"auto", "rows", "decode", "matrix"}
    for kernel in ("rows", "decode", "matrix"):
        assert {c.mask for c, k, _ in RUNS if k == kernel} == set(MASKS)
        assert any(c.L % 32 and c.S % 32 for c, k, _ in RUNS if k == kernel)


@pytest.mark.parametrize("case, kernel, splits", RUNS, ids=[f"{c}-{k}" for c, k, _ in RUNS])
def test_matches_float64_reference(emulator, case, kernel, splits):
    q, k, v, mask = make_inputs(case)
    seed = zlib.crc32(f"{case}-{kernel}".encode())  # a lane order per case, the same every run
    out = emulator.attention(q, k, v, mask=mask, kernel=kernel, splits=splits, seed=seed)
    check(out, q, k, v, mask, case.dtype)


# float32 attention over 16-bit inputs (dtype=float32, the patch's default on
# a 16-bit model): the *_f32 kernels and the merge's float32 instance. Every
# 16-bit case of the matrix, the kernels taken in turn.
WIDENED = [case for case in MATRIX if case.dtype != "float32"]
WIDENED_RUNS = [(case, kernels_for(case)[i % len(kernels_for(case))]) for i, case in enumerate(WIDENED)]


@pytest.mark.parametrize("case, run", WIDENED_RUNS, ids=[f"{c}-{k}" for c, (k, _) in WIDENED_RUNS])
def test_float32_attention_over_16_bit_inputs(emulator, case, run):
    kernel, splits = run
    q, k, v, mask = make_inputs(case)
    sinks = sinks_for(case) if case.mask in ("none", "causal") else None
    kw = dict(mask=mask, kernel=kernel, splits=splits, sinks=sinks, seed=zlib.crc32(f"{case}-{kernel}-f32".encode()))
    out = emulator.attention(q, k, v, dtype=mx.float32, **kw)
    assert out.shape == q.shape and out.dtype == mx.float32
    got = np.array(out)
    assert not np.isnan(got).any(), "NaN in the output (an element no kernel wrote stays NaN)"
    assert relative_error(got, attention_reference(q, k, v, mask=mask, sinks=sinks)) <= TOLERANCE["float32"]
    # As if the inputs had been cast (the kernels compute in float32 either way).
    cast = emulator.attention(*(x.astype(mx.float32) for x in (q, k, v)), **kw)
    assert np.array_equal(got, np.array(cast))
    # out_dtype the inputs' (the patch's call): the 16-bit kernels' own
    # output, the same float32 values rounded once, bit for bit the cast.
    rounded = emulator.attention(q, k, v, dtype=mx.float32, out_dtype=q.dtype, **kw)
    assert rounded.dtype == q.dtype
    assert mx.array_equal(rounded, out.astype(q.dtype))


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("kernel", ["rows", "decode", "matrix"])
def test_lane_orders(emulator, kernel, order):
    case = Case(batch=(2,), heads=(6, 3), L=45, S=77, E=64, mask="bool_LS", dtype="float16")
    q, k, v, mask = make_inputs(case)
    out = emulator.attention(q, k, v, mask=mask, kernel=kernel, splits=4, order=order)
    check(out, q, k, v, mask, case.dtype)


@pytest.mark.parametrize("S", [2048, 8191])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_splits_long_keys(emulator, S, dtype):
    # Qwen2-0.5B's decode step: 14 query heads over 2 KV heads, one query.
    case = Case(batch=(1,), heads=(14, 2), L=1, S=S, E=64, dtype=dtype, layout="kv_cache")
    q, k, v, _ = make_inputs(case)
    out = emulator.attention(q, k, v)  # automatic: split keys, then merge
    check(out, q, k, v, None, dtype)


@pytest.mark.parametrize("kernel", ["rows", "decode", "matrix"])
def test_agrees_with_the_cpu_kernels(emulator, kernel):
    case = Case(batch=(1,), heads=(14, 2), L=70, S=100, E=64, mask="causal")
    q, k, v, mask = make_inputs(case)
    metal = emulator.attention(q, k, v, mask=mask, kernel=kernel, splits=2)
    cpu = flash_attention(q, k, v, mask=mask, stream=mx.cpu)
    assert relative_error(metal, np.array(cpu)) <= 2e-5


@pytest.mark.parametrize("kernel", ["rows", "decode", "matrix"])
def test_hidden_non_finite_values_never_reach_a_row(emulator, kernel):
    case = Case(batch=(1,), heads=(2, 1), L=40, S=70, E=64)
    q, k, v, _ = make_inputs(case)
    visible = np.ones((40, 70), dtype=bool)
    visible[:, 10] = False  # key 10 hidden from every row, key 20 from some
    visible[::2, 20] = False
    visible[8] = False  # a row that sees nothing
    vn = np.array(v)
    vn[..., 10, 3] = np.nan
    vn[..., 20, 5] = np.inf
    out = np.array(emulator.attention(q, k, mx.array(vn), mask=mx.array(visible), kernel=kernel, splits=3))
    assert np.all(out[..., 8, :] == 0)
    assert not np.isnan(out[..., ::2, :]).any()
    assert np.isinf(out[..., 1::2, 5]).all()  # rows that see the Inf carry it


@pytest.mark.parametrize("kernel", ["rows", "decode", "matrix"])
def test_causal_rows_before_the_keys_are_zero(emulator, kernel):
    case = Case(batch=(2,), heads=(4, 2), L=100, S=33, E=64, mask="causal")
    q, k, v, mask = make_inputs(case)
    out = emulator.attention(q, k, v, mask=mask, kernel=kernel, splits=2)
    assert np.all(np.array(out)[..., : 100 - 33, :] == 0)
    check(out, q, k, v, mask, case.dtype)


WINDOW_CASES = [
    (Case(batch=(1,), heads=(14, 2), L=70, S=100, E=64, mask="causal"), 17),
    (Case(batch=(2,), heads=(4, 2), L=33, S=300, E=128, mask="causal", dtype="bfloat16"), 64),
    (Case(batch=(1,), heads=(6, 3), L=1, S=700, E=80, mask="causal", layout="kv_cache"), 100),
    (Case(batch=(1,), heads=(2, 2), L=40, S=40, E=16, mask="causal", dtype="float16"), 1),
]


WINDOW_RUNS = [(case, window, kernel) for case, window in WINDOW_CASES for kernel, _ in kernels_for(case)]


@pytest.mark.parametrize("case, window, kernel", WINDOW_RUNS, ids=[f"{c}_w{w}-{k}" for c, w, k in WINDOW_RUNS])
def test_sliding_window(emulator, case, window, kernel):
    q, k, v, _ = make_inputs(case)
    out = emulator.attention(q, k, v, mask="causal", window=window, kernel=kernel, splits=3)
    check(out, q, k, v, mx.array(causal_mask(case.L, case.S, window)), case.dtype)


@pytest.mark.parametrize("item", WINDOW_CASES, ids=[f"{c}_w{w}" for c, w in WINDOW_CASES])
def test_sliding_window_gradients(emulator, item):
    case, window = item
    q, k, v, _ = make_inputs(case)
    d_out = d_out_for(q)
    f = lambda q, k, v: emulator.attention(q, k, v, mask="causal", window=window)
    reset_gradient_stats()
    grads = mx.vjp(f, [q, k, v], [d_out])[1]
    assert gradient_stats() == {"fused": 1, "recomputed": {}}
    refs, sizes = attention_gradients_reference(q, k, v, d_out, mask=causal_mask(case.L, case.S, window), sizes=True)
    for name, g, ref, size in zip(("dq", "dk", "dv"), grads, refs, sizes):
        got = np.array(g.astype(mx.float32), dtype=np.float64)
        error = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), size, 1e-30)
        assert error <= TOLERANCE[case.dtype], f"{name}: {error:.2e}"


QUANTIZED_CASES = [  # (heads, L, S, E, bits, group size, dtype, mask)
    ((14, 2), 70, 100, 64, 4, 64, "float32", "causal"),
    ((4, 2), 33, 300, 128, 8, 32, "bfloat16", None),
    ((6, 3), 1, 700, 96, 2, 32, "float16", None),
    ((2, 2), 40, 40, 32, 4, 32, "float32", "bool"),
]
QUANTIZED_RUNS = [(c, kernel) for c in QUANTIZED_CASES for kernel, _ in kernels_for(Case((), c[0], c[1], c[2], c[3]))]


def quantized_inputs(heads, L, S, E, bits, group_size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((1, heads[0], L, E))).astype(getattr(mx, dtype))

    def quantized():  # from a larger buffer, as mlx-lm's cache slices it
        x = mx.array(rng.standard_normal((1, heads[1], S + 37, E))).astype(getattr(mx, dtype))
        return tuple(p[..., :S, :] for p in mx.quantize(x, group_size=group_size, bits=bits))

    return q, quantized(), quantized()


@pytest.mark.parametrize("c, kernel", QUANTIZED_RUNS, ids=[f"{c[0]}-L{c[1]}-S{c[2]}-E{c[3]}-{c[4]}bit-{k}"
                                                          for c, k in QUANTIZED_RUNS])
def test_quantized_keys_and_values(emulator, c, kernel):
    # flash_rows_q / flash_decode_q / flash_mma_q read the packed words,
    # against float64 on the float64 dequantization.
    heads, L, S, E, bits, group_size, dtype, mask_kind = c
    q, kq, vq = quantized_inputs(heads, L, S, E, bits, group_size, dtype)
    mask = mx.array(np.random.default_rng(2).random((L, S)) < 0.7) if mask_kind == "bool" else mask_kind
    out = emulator.attention(q, kq, vq, mask=mask, kernel=kernel, splits=3, bits=bits)
    check(out, q, dequantize(kq, E), dequantize(vq, E), mask, dtype)


def test_float32_attention_over_a_quantized_cache(emulator):
    # dtype=float32 over a bfloat16 model's quantized cache (the patch's
    # default): the queries cast, the keys and values dequantized into
    # float32 tiles; out_dtype bfloat16 is that result rounded once.
    q, kq, vq = quantized_inputs((4, 2), 33, 300, 128, 8, 32, "bfloat16")
    kw = dict(mask="causal", bits=8, group_size=32)
    out = emulator.attention(q, kq, vq, dtype=mx.float32, **kw)
    assert out.dtype == mx.float32
    ref = attention_reference(q, dequantize(kq, 128), dequantize(vq, 128), mask="causal")
    assert relative_error(out, ref) <= TOLERANCE["float32"]
    rounded = emulator.attention(q, kq, vq, dtype=mx.float32, out_dtype=q.dtype, **kw)
    assert rounded.dtype == q.dtype and mx.array_equal(rounded, out.astype(q.dtype))


def test_quantized_keys_beside_plain_values(emulator):
    # Only the keys quantized: dequantized for the plain kernels.
    q, kq, vq = quantized_inputs((4, 2), 20, 50, 64, 4, 32, "float32")
    v = mx.array(dequantize(vq, 64).astype(np.float32))
    out = emulator.attention(q, kq, v, mask="causal")
    check(out, q, dequantize(kq, 64), v, "causal", "float32")


def test_no_gradient_through_quantized_keys(emulator):
    q, kq, vq = quantized_inputs((2, 1), 8, 8, 32, 4, 32, "float32")
    with pytest.raises(ValueError, match="no gradient through quantized keys or values"):
        mx.grad(lambda q: emulator.attention(q, kq, vq).sum())(q)


SINK_CASES = [
    Case(batch=(1,), heads=(14, 2), L=70, S=100, E=64, mask="causal"),
    Case(batch=(2,), heads=(4, 2), L=1, S=700, E=128, dtype="bfloat16", layout="kv_cache"),
    Case(batch=(1,), heads=(6, 3), L=40, S=24, E=80, mask="causal", dtype="float16"),  # rows that see no key
]
SINK_RUNS = [(case, kernel) for case in SINK_CASES for kernel, _ in kernels_for(case)]


def sinks_for(case, seed=7):
    s = np.random.default_rng(seed).normal(0.5, 1.5, case.heads[0]).astype(np.float32)
    s[0] = -np.inf  # a head without a sink
    return mx.array(s).astype(DTYPES[case.dtype])


@pytest.mark.parametrize("case, kernel", SINK_RUNS, ids=[f"{c}-{k}" for c, k in SINK_RUNS])
def test_attention_sinks(emulator, case, kernel):
    # Each row's sink joins its denominator at the end of flash_rows and
    # flash_mma, and once in flash_merge after the decode splits.
    q, k, v, mask = make_inputs(case)
    sinks = sinks_for(case)
    out = emulator.attention(q, k, v, mask=mask, kernel=kernel, splits=3, sinks=sinks)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_reference(q, k, v, mask=mask, sinks=sinks)
    assert relative_error(out, ref) <= TOLERANCE[case.dtype]
    cpu = flash_attention(q, k, v, mask=mask, sinks=sinks, stream=mx.cpu)
    assert relative_error(out, np.array(cpu.astype(mx.float32))) <= TOLERANCE[case.dtype]


def test_attention_sinks_with_quantized_keys(emulator):
    q, kq, vq = quantized_inputs((4, 2), 9, 200, 64, 4, 32, "float32")
    sinks = mx.array([0.3, -1.0, 2.0, 5.0])
    out = emulator.attention(q, kq, vq, mask="causal", sinks=sinks)
    ref = attention_reference(q, dequantize(kq, 64), dequantize(vq, 64), mask="causal", sinks=sinks)
    assert relative_error(out, ref) <= 2e-5


SINK_GRADIENT_CASES = SINK_CASES + [
    Case(batch=(2,), heads=(4, 2), L=50, S=70, E=32, mask="bool_LS"),
    Case(batch=(1,), heads=(3, 1), L=33, S=33, E=16, mask="additive_full"),
]


@pytest.mark.parametrize("case", SINK_GRADIENT_CASES, ids=str)
def test_attention_sinks_gradients(emulator, case):
    # flash_backward_rows counts each head's sink in its rows' log-sum-exp, so
    # that P is the forward's; the sinks' own gradient is -sum p_sink D over
    # the (lse, D) it writes. One head has no sink (-inf): its gradient is 0.
    q, k, v, mask = make_inputs(case)
    sinks = sinks_for(case)
    d_out = d_out_for(q)
    seed = zlib.crc32(f"{case}-sinks-backward".encode())
    reset_gradient_stats()
    f = lambda q, k, v, s: emulator.attention(q, k, v, mask=mask, sinks=s, seed=seed)
    grads = mx.vjp(f, [q, k, v, sinks], [d_out])[1]
    assert gradient_stats() == {"fused": 1, "recomputed": {}}
    refs, sizes = attention_gradients_reference(q, k, v, d_out, mask=mask, sinks=sinks, sizes=True)
    for name, g, x, ref, size in zip(("dq", "dk", "dv", "dsinks"), grads, (q, k, v, sinks), refs, sizes):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        got = np.array(g.astype(mx.float32), dtype=np.float64)
        error = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), size, 1e-30)
        assert error <= TOLERANCE[case.dtype], f"{name}: {error:.2e}"
    assert np.array(grads[3].astype(mx.float32))[0] == 0.0


def test_attention_sinks_gradients_with_an_additive_masks_own(emulator):
    # The mask's gradient (dS, L x S) is recomputed with MLX operations, with
    # the sinks in its softmax; MLX's VJP of its own SDPA is the reference.
    case = Case(batch=(1,), heads=(4, 2), L=24, S=40, E=32, mask="additive_full")
    q, k, v, mask = make_inputs(case)
    sinks = sinks_for(case)
    d_out = d_out_for(q)
    ours = lambda q, k, v, m, s: emulator.attention(q, k, v, mask=m, sinks=s)
    mlx = lambda q, k, v, m, s: mx.fast.scaled_dot_product_attention(q, k, v, scale=case.E**-0.5, mask=m, sinks=s)
    got = mx.vjp(ours, [q, k, v, mask, sinks], [d_out])[1]
    with mx.stream(mx.cpu):
        want = mx.vjp(mlx, [q, k, v, mask, sinks], [d_out])[1]
    for name, g, w in zip(("dq", "dk", "dv", "dmask", "dsinks"), got, want):
        assert g.shape == w.shape, name
        w = np.array(w, dtype=np.float64)
        keep = np.isfinite(w)  # MLX's dmask is NaN where the mask is -inf
        assert relative_error(np.array(g)[keep], w[keep]) <= 2e-5, name


def test_explicit_scale(emulator):
    case = Case(batch=(1,), heads=(4, 4), L=33, S=33, E=64, mask="causal")
    q, k, v, mask = make_inputs(case)
    for scale in (0.0, 0.01, 3.0):
        out = emulator.attention(q, k, v, scale=scale, mask=mask)
        check(out, q, k, v, mask, "float32", scale=scale)


def gradients(emulator, case, q, k, v, mask, d_out, seed=0, order="shuffled"):
    f = lambda q, k, v: emulator.attention(q, k, v, mask=mask, seed=seed, order=order)
    return mx.vjp(f, [q, k, v], [d_out])[1]


def d_out_for(q, seed=5):
    return mx.array(np.random.default_rng(seed).standard_normal(q.shape)).astype(q.dtype)


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_fused_backward_matches_float64_reference(emulator, case):
    # flash_backward_rows + flash_backward_keys (backward.metal), lanes shuffled.
    q, k, v, mask = make_inputs(case)
    d_out = d_out_for(q)
    reset_gradient_stats()
    grads = gradients(emulator, case, q, k, v, mask, d_out, seed=zlib.crc32(f"{case}-backward".encode()))
    refs, sizes = attention_gradients_reference(q, k, v, d_out, mask=mask, sizes=True)
    for name, g, ref, size in zip(("dq", "dk", "dv"), grads, refs, sizes):
        assert g.shape == ref.shape and g.dtype == q.dtype, name
        got = np.array(g.astype(mx.float32), dtype=np.float64)
        error = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), size, 1e-30)
        assert error <= TOLERANCE[case.dtype], f"{name}: {error:.2e}"
    assert gradient_stats() == {"fused": 1, "recomputed": {}}


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_fused_backward_lane_orders(emulator, order):
    case = Case(batch=(2,), heads=(6, 2), L=45, S=77, E=80, mask="causal")
    q, k, v, mask = make_inputs(case)
    d_out = d_out_for(q)
    refs = attention_gradients_reference(q, k, v, d_out, mask=mask)
    for g, ref in zip(gradients(emulator, case, q, k, v, mask, d_out, order=order), refs):
        assert relative_error(g, ref) <= 2e-5


def test_gradients_agree_with_the_cpu_backward_under_grad_and_compile(emulator):
    case = Case(batch=(1,), heads=(4, 2), L=20, S=30, E=64, mask="causal")
    q, k, v, mask = make_inputs(case)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) ** 2).sum()

    metal = mx.compile(mx.grad(loss(lambda q, k, v: emulator.attention(q, k, v, mask=mask)), argnums=(0, 1, 2)))
    cpu = mx.grad(loss(lambda q, k, v: flash_attention(q, k, v, mask=mask)), argnums=(0, 1, 2))
    for a, b in zip(metal(q, k, v), cpu(q, k, v)):
        assert relative_error(a, np.array(b)) <= 1e-5


def test_hidden_non_finite_values_never_reach_a_gradient(emulator):
    case = Case(batch=(1,), heads=(2, 1), L=40, S=70, E=64)
    q, k, v, _ = make_inputs(case)
    visible = np.ones((40, 70), dtype=bool)
    visible[:, 10] = False  # key 10 hidden from every row
    visible[8] = False  # a row that sees nothing
    kn, vn, qn = np.array(k), np.array(v), np.array(q)
    kn[..., 10, 3] = np.nan
    vn[..., 10, 5] = np.inf
    qn[..., 8, 7] = np.inf  # the row that sees nothing
    mask = mx.array(visible)
    d_out = d_out_for(q)
    grads = gradients(emulator, case, mx.array(qn), mx.array(kn), mx.array(vn), mask, d_out)
    for name, g in zip(("dq", "dk", "dv"), grads):
        g = np.array(g)
        # the hidden key's own gradients are zero (no row sees it); nothing is NaN
        assert not np.isnan(g).any() and not np.isinf(g).any(), name
    assert np.all(np.array(grads[0])[..., 8, :] == 0)
    assert np.all(np.array(grads[1])[..., 10, :] == 0) and np.all(np.array(grads[2])[..., 10, :] == 0)
    # the visible part is exact: the reference with key 10's NaN / Inf zeroed
    kz, vz = kn.copy(), vn.copy()
    kz[..., 10, :] = 0
    vz[..., 10, :] = 0
    refs = attention_gradients_reference(q, mx.array(kz), mx.array(vz), d_out, mask=mask)
    for g, ref in zip(grads, refs):
        assert relative_error(g, ref) <= 2e-5


def test_an_additive_mask_gets_its_gradient(emulator):
    # dQ, dK, dV fused; the mask's own gradient (dS, L x S) recomputed.
    case = Case(batch=(1,), heads=(2, 2), L=24, S=40, E=32)
    q, k, v, _ = make_inputs(case)
    bias = mx.array(np.random.default_rng(3).standard_normal((24, 40)).astype(np.float32))
    loss = lambda fn: (lambda q, b: (fn(q, b) ** 2).sum())
    metal = mx.grad(loss(lambda q, b: emulator.attention(q, k, v, mask=b)), argnums=(0, 1))(q, bias)
    cpu = mx.grad(loss(lambda q, b: flash_attention(q, k, v, mask=b)), argnums=(0, 1))(q, bias)
    for a, b in zip(metal, cpu):
        assert relative_error(a, np.array(b)) <= 1e-5


def test_fused_backward_memory_is_linear_in_sequence_length(emulator):
    # One L x S float32 score matrix here is 16 MiB; inputs, outputs and
    # gradients together are ~1 MiB.
    L = 2048
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, 1, L, 16)).astype(np.float32)) for _ in range(3))
    mx.eval(q, k, v)
    grad = mx.grad(lambda q, k, v: emulator.attention(q, k, v, mask="causal").sum(), argnums=(0, 1, 2))
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    grads = grad(q, k, v)
    mx.eval(grads)
    extra = mx.get_peak_memory() - before
    assert extra < 4 * 2**20, f"{extra / 2**20:.1f} MiB"


def test_forcing_the_matrix_kernel_on_another_head_dim_is_refused(emulator):
    q = mx.zeros((1, 1, 40, 48))
    with pytest.raises(ValueError, match="head dims 64, 80, 96 and 128; got 48"):
        emulator.attention(q, q, q, kernel="matrix")
    with pytest.raises(ValueError, match='kernel must be "auto"'):
        emulator.attention(q, q, q, kernel="steel")


def test_bad_input_is_refused_before_any_kernel(emulator):
    q = mx.zeros((1, 3, 8, 64))
    k = mx.zeros((1, 2, 8, 64))
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        emulator.attention(q, k, k)
