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
from attention_cases import MASKS, MATRIX, TOLERANCE, Case, make_inputs

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, relative_error

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


def test_explicit_scale(emulator):
    case = Case(batch=(1,), heads=(4, 4), L=33, S=33, E=64, mask="causal")
    q, k, v, mask = make_inputs(case)
    for scale in (0.0, 0.01, 3.0):
        out = emulator.attention(q, k, v, scale=scale, mask=mask)
        check(out, q, k, v, mask, "float32", scale=scale)


def test_gradients_through_the_metal_path(emulator):
    case = Case(batch=(1,), heads=(4, 2), L=20, S=30, E=64, mask="causal")
    q, k, v, mask = make_inputs(case)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) ** 2).sum()

    metal = mx.grad(loss(lambda q, k, v: emulator.attention(q, k, v, mask=mask)), argnums=(0, 1, 2))(q, k, v)
    cpu = mx.grad(loss(lambda q, k, v: flash_attention(q, k, v, mask=mask)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(metal, cpu):
        assert relative_error(a, np.array(b)) <= 1e-4


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
