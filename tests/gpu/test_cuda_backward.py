"""The CUDA backward (kernels/backward.cu) beyond the shared matrix of
tests/core/test_backward.py: every head-dim bucket and the column halves of
E > 128, tiles of many rows and keys with every causal alignment, values a
row cannot see that are not finite, the log-sum-exp the forward keeps from
each of its kernels, and which backward ran."""

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import TOLERANCE, Case, band_scales, make_inputs

from flashattn_core import flash_attention, gradient_stats, reset_gradient_stats
from flashattn_core.reference import attention_gradients_reference, relative_error

pytestmark = pytest.mark.skipif(
    not (mx.is_available(mx.gpu) and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend and an NVIDIA GPU",
)


def d_out_for(q, seed=5):
    return mx.array(np.random.default_rng(seed).standard_normal(q.shape)).astype(q.dtype)


def gradients(q, k, v, mask, d_out):
    f = lambda q, k, v: flash_attention(q, k, v, mask=mask)
    return mx.vjp(f, [q, k, v], [d_out])[1]


def check(case, seed=0):
    q, k, v, mask = make_inputs(case, seed=seed)
    d_out = d_out_for(q)
    reset_gradient_stats()
    grads = gradients(q, k, v, mask, d_out)
    refs, sizes = attention_gradients_reference(q, k, v, d_out, mask=mask, sizes=True)
    for name, g, x, ref, size in zip(("dq", "dk", "dv"), grads, (q, k, v), refs, sizes):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        got = np.array(g.astype(mx.float32), dtype=np.float64)
        assert np.isfinite(got).all(), name
        error = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), size, 1e-30)
        assert error <= TOLERANCE[case.dtype], f"{name}: {error:.2e}"
    assert gradient_stats() == {"fused": 1, "recomputed": {}}


@pytest.mark.parametrize("E", [1, 8, 63, 64, 65, 100, 128, 129, 200, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_head_dim_bucket(E, dtype):
    check(Case(batch=(1,), heads=(6, 2), L=150, S=170, E=E, mask="causal", dtype=dtype))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    "L,S,mask",
    [(1000, 1000, "causal"), (300, 1100, "causal"), (1100, 300, "causal"), (700, 900, "bool_full"),
     (640, 640, "additive_LS"), (513, 1025, "none")],
)
def test_many_tiles(L, S, mask, dtype):
    check(Case(batch=(1,), heads=(7, 1), L=L, S=S, E=64, mask=mask, dtype=dtype))


@pytest.mark.parametrize("E", [128, 256])
def test_long_rows_and_keys(E):
    check(Case(batch=(1,), heads=(2, 1), L=2048, S=2048, E=E, mask="causal", dtype="bfloat16"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hidden_non_finite_values_never_reach_a_gradient(dtype):
    case = Case(batch=(1,), heads=(2, 1), L=90, S=140, E=64, dtype=dtype)
    q, k, v, _ = make_inputs(case)
    visible = np.ones((90, 140), dtype=bool)
    visible[:, 10] = False  # key 10 hidden from every row
    visible[8] = False  # a row that sees nothing
    visible[40:, 100] = False  # key 100 seen by some rows only
    kn, vn, qn = (np.array(x.astype(mx.float32)) for x in (k, v, q))
    kn[..., 10, 3] = np.nan
    vn[..., 10, 5] = np.inf
    qn[..., 8, 7] = np.inf  # the row that sees nothing
    mask = mx.array(visible)
    as_dtype = lambda x: mx.array(x).astype(q.dtype)
    d_out = d_out_for(q)
    grads = gradients(as_dtype(qn), as_dtype(kn), as_dtype(vn), mask, d_out)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert np.isfinite(np.array(g.astype(mx.float32))).all(), name
    dq, dk, dv = (np.array(g.astype(mx.float32)) for g in grads)
    assert np.all(dq[..., 8, :] == 0)
    assert np.all(dk[..., 10, :] == 0) and np.all(dv[..., 10, :] == 0)
    # the visible part is exact: the reference with the hidden non-finite values zeroed
    qz, kz, vz = qn.copy(), kn.copy(), vn.copy()
    qz[..., 8, :] = 0
    kz[..., 10, :] = 0
    vz[..., 10, :] = 0
    refs = attention_gradients_reference(as_dtype(qz), as_dtype(kz), as_dtype(vz), d_out, mask=mask)
    for g, ref in zip(grads, refs):
        assert relative_error(g, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("E", [64, 128, 256])
@pytest.mark.parametrize("cotangent,bound", [("bfloat16", 2.0), ("float32", 2.5)])
def test_float32_attention_over_16_bit_inputs(E, cotangent, bound):
    # dtype=mx.float32 under a gradient: the forward in float32 over the
    # bfloat16 inputs, the gradient (bfloat16, as the inputs) from the 16-bit
    # backward, which rounds P and dS to 16 bits in its products, and dO
    # too: against float64, within `bound` times the error of the float64
    # gradient rounded to bfloat16 (the best a bfloat16 gradient can be). A
    # bfloat16 cotangent is the patch's (its output cast back to the model's
    # dtype); a float32 one loses its low bits as well.
    case = Case(batch=(2,), heads=(14, 2), L=300, S=300, E=E, mask="causal", dtype="bfloat16")
    q, k, v, _ = make_inputs(case)
    d_out = mx.array(np.random.default_rng(1).standard_normal(q.shape).astype(np.float32))
    d_out = d_out.astype(getattr(mx, cotangent)).astype(mx.float32)
    f = lambda q, k, v: flash_attention(q, k, v, mask="causal", dtype=mx.float32)
    reset_gradient_stats()
    out, grads = mx.vjp(f, [q, k, v], [d_out])
    assert out[0].dtype == mx.float32
    refs = attention_gradients_reference(q, k, v, d_out, mask="causal")
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert g.dtype == mx.bfloat16
        rounded = mx.array(ref.astype(np.float32)).astype(mx.bfloat16)
        assert relative_error(g, ref) <= bound * relative_error(rounded, ref), name
    assert gradient_stats() == {"fused": 1, "recomputed": {}}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("E,heads", [(64, (8, 2)), (128, (4, 1))])
def test_prefill_log_sum_exp_after_key_splits(E, heads, dtype):
    # The backward reads each row's log-sum-exp from the forward's prefill
    # kernel; under FLASHATTN_CUDA_SPLITS (cuda-check's rerun) the piece that
    # merges a split row tile's keys writes it.
    check(Case(batch=(2,), heads=heads, L=700, S=900, E=E, mask="causal", dtype=dtype))


def _misaligned(shape, dtype, seed):
    """A row-contiguous view one element into its buffer: rows off 16-byte
    boundaries, which the tensor-core kernels cannot read."""
    flat = mx.random.normal((int(np.prod(shape)) + 1,), key=mx.random.key(seed)).astype(getattr(mx, dtype))
    return flat[1:].reshape(shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("L,S", [(200, 333), (7, 300), (1, 300)])
def test_gradients_of_misaligned_rows(L, S, dtype):
    # The generic kernel's split form, whose merge (fa_merge_lse_) keeps the
    # log-sum-exp; L = 1: planned as a decode, which keeps none (the
    # backward takes it again).
    q, k, v = (_misaligned(shape, dtype, seed) for shape, seed in
               (((2, 8, L, 64), 1), ((2, 2, S, 64), 2), ((2, 2, S, 64), 3)))
    d_out = d_out_for(q)
    reset_gradient_stats()
    grads = gradients(q, k, v, "causal", d_out)
    refs = attention_gradients_reference(q, k, v, d_out, mask="causal")
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert relative_error(g, ref) <= TOLERANCE[dtype], name
    assert gradient_stats() == {"fused": 1, "recomputed": {}}


def _as_mlx_lm(shape, dtype, seed):
    """mlx-lm's layout: a (B, N, H, E) projection viewed as (B, H, N, E)."""
    B, H, N, E = shape
    x = np.random.default_rng(seed).standard_normal((B, N, H, E))
    return mx.swapaxes(mx.array(x).astype(getattr(mx, dtype)), 1, 2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("E", [64, 72, 80, 128])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=str)
@pytest.mark.parametrize("mask,L,S", [("causal", 300, 300), ("causal", 130, 400), (None, 200, 150),
                                      ("bool", 160, 260)], ids=str)
def test_gradients_of_inputs_in_mlx_lm_layout(dtype, E, heads, mask, L, S):
    # The backward reads Q, K, V, O and dO where they lie (transposed views,
    # as mlx-lm's; 16-bit E = 72: rows 144 bytes apart, copied element by
    # element) and stores dQ, dK and dV laid out as Q, K and V (float32 under
    # GQA: dK and dV added into them by atomics).
    check_mlx_lm_layout(dtype, E, heads, mask, L, S)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("E", [200, 256])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=str)
@pytest.mark.parametrize("mask,L,S", [("causal", 300, 300), ("bool", 160, 260), ("causal", 5, 300)], ids=str)
def test_gradients_of_inputs_in_mlx_lm_layout_above_e128(dtype, E, heads, mask, L, S):
    # The rows pass and the keys pass of kernels/backward.cu; 16-bit dK and
    # dV under GQA as float32 sums, cast after.
    check_mlx_lm_layout(dtype, E, heads, mask, L, S)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("E", [64, 128])
def test_gradients_of_a_decode_sized_call_in_mlx_lm_layout(dtype, E):
    # Five query rows: the forward's decode kernels.
    check_mlx_lm_layout(dtype, E, (6, 2), "causal", 5, 300)


def check_mlx_lm_layout(dtype, E, heads, mask, L, S):
    (H_q, H_kv), B = heads, 2
    q = _as_mlx_lm((B, H_q, L, E), dtype, 1)
    k = _as_mlx_lm((B, H_kv, S, E), dtype, 2)
    v = _as_mlx_lm((B, H_kv, S, E), dtype, 3)
    d_out = _as_mlx_lm((B, H_q, L, E), dtype, 4)
    if mask == "bool":
        mask = mx.array(np.random.default_rng(5).random((L, S)) < 0.7)
    reset_gradient_stats()
    grads = gradients(q, k, v, mask, d_out)
    refs = attention_gradients_reference(q, k, v, d_out, mask=mask)
    for name, g, x, ref in zip(("dq", "dk", "dv"), grads, (q, k, v), refs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert relative_error(g, ref) <= TOLERANCE[dtype], name
    assert gradient_stats() == {"fused": 1, "recomputed": {}}


def test_gradients_of_inputs_whose_batch_axes_do_not_collapse():
    # Batch axes swapped: no one batch stride, so the node has MLX copy them.
    x = lambda shape, seed: mx.swapaxes(
        mx.array(np.random.default_rng(seed).standard_normal(shape)).astype(mx.bfloat16), 0, 1)
    q, k, v, d_out = x((3, 2, 4, 100, 64), 1), x((3, 2, 2, 120, 64), 2), x((3, 2, 2, 120, 64), 3), x(
        (3, 2, 4, 100, 64), 4)
    grads = gradients(q, k, v, "causal", d_out)
    refs = attention_gradients_reference(q, k, v, d_out, mask="causal")
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert relative_error(g, ref) <= TOLERANCE["bfloat16"], name


@pytest.mark.parametrize("heads", [(16, 4), (8, 8)], ids=str)
@pytest.mark.parametrize("dtype,kw", [("bfloat16", {}), ("bfloat16", {"dtype": mx.float32}), ("float32", {})],
                         ids=str)
def test_mlx_lm_transpose_of_the_gradients_copies_nothing(heads, dtype, kw):
    # Back through mlx-lm's transposes, each gradient goes to (B, L, H E) by a
    # transpose and a reshape: views, when the gradient lies as its input.
    (H_q, H_kv), B, L, E = heads, 1, 2048, 128
    q = _as_mlx_lm((B, H_q, L, E), dtype, 1)
    k = _as_mlx_lm((B, H_kv, L, E), dtype, 2)
    v = _as_mlx_lm((B, H_kv, L, E), dtype, 3)
    d_out = _as_mlx_lm((B, H_q, L, E), dtype, 4)
    f = lambda q, k, v: flash_attention(q, k, v, mask="causal", **kw)
    grads = mx.vjp(f, [q, k, v], [d_out])[1]
    mx.eval(grads)
    mx.synchronize()
    before = mx.get_active_memory()
    flat = [mx.swapaxes(g, 1, 2).reshape(B, L, -1) for g in grads]
    mx.eval(flat)
    assert mx.get_active_memory() - before < 2**20
    refs = attention_gradients_reference(q, k, v, d_out, mask="causal")
    for name, g, ref in zip(("dq", "dk", "dv"), flat, refs):
        assert relative_error(g.reshape(B, L, -1, E).swapaxes(1, 2), ref) <= TOLERANCE[dtype], name


@pytest.mark.parametrize("L,S", [(700, 700), (300, 1000)])
def test_float32_gradients_tiles_of_any_magnitude(L, S):
    # On Hopper float32 gradients at E = 64 under a causal mask run on
    # float16 tensor cores: each 128-row tile of q, k, v and dO scaled by a
    # power of two of its own, dS by one a row tile, dK's and dV's sums in
    # units that follow (backward_f32s_wg.cu). Bands of rows far outside
    # float16's range both ways; each band of dQ (its rows' dO band) and of
    # dK and dV (their keys' v band) held to float32's tolerance on its own.
    # Query and key bands stay small, as in the forward's test: a score of
    # size x carries 2^-22 x of error.
    case = Case(batch=(2,), heads=(4, 2), L=L, S=S, E=64, mask="causal")
    q, k, v, _ = (np.array(x) for x in make_inputs(case))
    d_out = np.array(d_out_for(mx.array(q)))
    q = q * band_scales(L, [-40, -12, 0, 0], 1)[:, None]
    k = k * band_scales(S, [-30, -5, 0, 0], 2)[:, None]
    v = v * band_scales(S, [-50, -20, 0, 20, 50], 3)[:, None]
    d_out = d_out * band_scales(L, [-60, -25, 0, 25, 60], 4)[:, None]
    args = [mx.array(x, dtype=mx.float32) for x in (q, k, v, d_out)]
    grads = gradients(*args[:3], "causal", args[3])
    refs = attention_gradients_reference(*args, mask="causal")
    for name, g, ref, n in zip(("dq", "dk", "dv"), grads, refs, (L, S, S)):
        got = np.array(g, dtype=np.float64)
        for start in range(0, n, 128):
            rows = slice(start, start + 128)
            assert relative_error(got[..., rows, :], ref[..., rows, :]) <= TOLERANCE["float32"], f"{name} {start}.."


@pytest.mark.parametrize(
    "where,row,value",
    [("q", 300, float("inf")), ("k", 200, float("nan")), ("v", 500, float("nan")), ("d_out", 300, float("inf"))],
)
def test_float32_gradients_one_tile_not_finite(where, row, value):
    # A value that is not finite in one 128-row tile of many: the row tiles
    # and key blocks that hold it take their products in plain float32 (the
    # split marks them), the rest stay on the tensor cores. Every gradient
    # the value reaches is not finite, as float64's; the others equal the
    # reference's with that value zeroed (which changes nothing they depend
    # on), the keys a row with an infinite query cannot see included.
    case = Case(batch=(1,), heads=(4, 2), L=700, S=700, E=64, mask="causal")
    q, k, v, _ = (np.array(x) for x in make_inputs(case))
    d_out = np.array(d_out_for(mx.array(q)))
    arrays = {"q": q, "k": k, "v": v, "d_out": d_out}
    zeroed = {name: x.copy() for name, x in arrays.items()}
    arrays[where][0, 1, row, 7] = value
    zeroed[where][0, 1, row, 7] = 0
    as_mx = lambda xs: [mx.array(xs[name], dtype=mx.float32) for name in ("q", "k", "v", "d_out")]
    args = as_mx(arrays)
    grads = [np.array(g) for g in gradients(*args[:3], "causal", args[3])]
    refs = attention_gradients_reference(*as_mx(zeroed), mask="causal")
    # What the value reaches (query heads 2, 3 share key head 1; a row i sees keys <= i).
    reached = [np.zeros(g.shape, dtype=bool) for g in grads]
    dq, dk, dv = reached
    if where in ("q", "d_out"):
        dq[0, 1, row] = True
        dk[0, 0, : row + 1] = True
        if where == "q":
            dv[0, 0, : row + 1] = True
        else:  # dV = P^T dO: the column that holds it
            dv[0, 0, : row + 1, 7] = True
    else:  # key head 1: every row from `row` on of its query heads
        dq[0, 2:, row:] = True
        dk[0, 1] = True
        if where == "k":
            dv[0, 1] = True
    for name, g, ref, mask in zip(("dq", "dk", "dv"), grads, refs, reached):
        assert not np.isfinite(g[mask]).any(), name
        assert np.isfinite(g[~mask]).all(), name
        assert relative_error(np.where(mask, 0, g), np.where(mask, 0, ref)) <= TOLERANCE["float32"], name
