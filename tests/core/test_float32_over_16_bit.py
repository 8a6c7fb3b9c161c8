"""dtype=float32 with float16 / bfloat16 inputs: attention in float32 and a
float32 result, as if the inputs had been cast to float32 first (what the
patch's default precision asks of a 16-bit model). Held to the float32
tolerance against a float64 reference on the 16-bit inputs' values. On the
CPU every case reads the 16-bit inputs in place (the 16-bit kernels compute
in float32 and store a float32 output); on CUDA too: the decode cases in the
tensor-core decode's float32 variant or the generic kernel's split form, the
prefill cases in the wgmma prefill's float32 variant on Hopper and the
mma.sync one's on the PTX images (tests/gpu has more of each, and the cast
path). out_dtype, the inputs' dtype for the result, is the float32 result
rounded once. The Metal kernels' own cases: tests/metal."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from attention_cases import TOLERANCE, Case, make_inputs
from quantized_cases import quantized_case

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, relative_error

CASES = [
    # decode: on CUDA the tensor-core decode's float32 variant (one split up
    # to 1024 keys, merged in the same launch above), mlx-lm's layouts
    Case(batch=(1,), heads=(14, 2), L=1, S=700, E=64, mask="none", layout="kv_cache"),
    Case(batch=(2,), heads=(14, 2), L=1, S=5000, E=64, mask="causal", layout="kv_cache"),
    Case(batch=(1,), heads=(32, 8), L=1, S=3000, E=128, mask="none", layout="kv_cache"),
    Case(batch=(1,), heads=(16, 2), L=2, S=2500, E=64, mask="none"),
    Case(batch=(1,), heads=(8, 8), L=4, S=1500, E=128, mask="none", layout="transposed"),
    # the rest: on CUDA the generic kernel's split form for L <= 8, the
    # prefills' float32 variants above it
    Case(batch=(1,), heads=(14, 2), L=3, S=900, E=64, mask="causal", layout="kv_cache"),
    Case(batch=(2,), heads=(4, 2), L=1, S=2000, E=96, mask="none"),
    Case(batch=(1,), heads=(8, 8), L=1, S=1200, E=128, mask="bool_keys"),
    Case(batch=(1,), heads=(4, 1), L=64, S=64, E=64, mask="causal"),
    Case(batch=(1,), heads=(6, 2), L=50, S=80, E=80, mask="additive_LS", layout="transposed"),
]


def widened_cases():
    for case in CASES:
        for dtype in ("bfloat16", "float16"):
            yield replace(case, dtype=dtype)


@pytest.mark.parametrize("case", list(widened_cases()), ids=str)
def test_float32_accuracy_from_16_bit_inputs(case):
    q, k, v, mask = make_inputs(case)
    out = flash_attention(q, k, v, mask=mask, dtype=mx.float32)
    assert out.dtype == mx.float32 and out.shape == q.shape
    assert relative_error(out, attention_reference(q, k, v, mask=mask)) <= TOLERANCE["float32"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_agrees_with_float32_attention_on_cast_inputs(dtype):
    case = Case(batch=(1,), heads=(14, 2), L=1, S=9000, E=64, mask="none", dtype=dtype, layout="kv_cache")
    q, k, v, _ = make_inputs(case)
    widened = flash_attention(q, k, v, dtype=mx.float32)
    cast = flash_attention(*(x.astype(mx.float32) for x in (q, k, v)))
    assert relative_error(widened, np.array(cast)) <= 1e-5


@pytest.mark.parametrize("case", list(widened_cases()), ids=str)
def test_cpu_equals_float32_attention_on_cast_inputs(case):
    # What "as if cast" promises, bit for bit, on the CPU's in-place path.
    q, k, v, mask = make_inputs(case)
    out = flash_attention(q, k, v, mask=mask, dtype=mx.float32, stream=mx.cpu)
    cast = flash_attention(*(x.astype(mx.float32) for x in (q, k, v)), mask=mask, stream=mx.cpu)
    assert out.dtype == mx.float32 and mx.array_equal(out, cast)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("L", [1, 70])
@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_quantized_and_sinks_equal_the_cast_path(dtype, L, bits):
    # Quantized keys and values (scales in the inputs' dtype), a quantized
    # key with a plain value, and sinks: the in-place path against float32
    # queries (and value) over the same codes.
    q, kq, vq = quantized_case((1,), (8, 2), L, 600, 64, bits, 32, dtype, "kv_cache", seed=3)
    v = mx.random.normal((1, 2, 600, 64), key=mx.random.key(4)).astype(getattr(mx, dtype))
    sinks = mx.array(np.linspace(-1.0, 2.0, 8), dtype=mx.float32)
    kw = dict(mask="causal", sinks=sinks, group_size=32, bits=bits, stream=mx.cpu)
    q32 = q.astype(mx.float32)
    for values, values32 in ((vq, vq), (v, v.astype(mx.float32))):
        out = flash_attention(q, kq, values, dtype=mx.float32, **kw)
        assert out.dtype == mx.float32
        assert mx.array_equal(out, flash_attention(q32, kq, values32, **kw))


def test_cpu_float32_attention_copies_no_keys_or_values():
    # 65,536 bfloat16 keys and values (2 heads, E = 64): 16 MiB each, where a
    # float32 copy of either would be 32 MiB.
    case = Case(batch=(1,), heads=(14, 2), L=1, S=65536, E=64, mask="none", dtype="bfloat16", layout="kv_cache")
    q, k, v, _ = make_inputs(case)
    mx.eval(q, k, v)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, k, v, dtype=mx.float32, stream=mx.cpu)
    mx.eval(out)
    extra = mx.get_peak_memory() - before - out.nbytes
    assert extra < 2**20, f"{extra / 2**20:.1f} MiB beyond the output"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_large_score_differences_keep_small_weights(dtype):
    # Most keys far below the best one: their weights (down to ~2^-40) go
    # into P V as they are, not flushed by 16-bit rounding of P (float16's
    # smallest subnormal is 2^-24).
    rng = np.random.default_rng(7)
    S, E = 4096, 64
    q = mx.array(np.full((1, 2, 1, E), 0.5)).astype(getattr(mx, dtype))
    k = rng.standard_normal((1, 1, S, E)) * 0.1
    k[..., 100, :] = 2.0
    v = rng.standard_normal((1, 1, S, E))
    k, v = (mx.array(x).astype(getattr(mx, dtype)) for x in (k, v))
    out = flash_attention(q, k, v, scale=1.0, dtype=mx.float32)
    assert relative_error(out, attention_reference(q, k, v, scale=1.0)) <= TOLERANCE["float32"]


def test_inputs_dtype_and_float32_inputs_are_unchanged():
    case = Case(batch=(1,), heads=(4, 2), L=5, S=40, E=16, mask="causal", dtype="bfloat16")
    q, k, v, mask = make_inputs(case)
    assert mx.array_equal(flash_attention(q, k, v, mask=mask, dtype=mx.bfloat16), flash_attention(q, k, v, mask=mask))
    q32, k32, v32 = (x.astype(mx.float32) for x in (q, k, v))
    out = flash_attention(q32, k32, v32, mask=mask, dtype=mx.float32)
    assert out.dtype == mx.float32
    assert mx.array_equal(out, flash_attention(q32, k32, v32, mask=mask))


@pytest.mark.parametrize("inputs, dtype", [("float32", mx.float16), ("bfloat16", mx.float16),
                                           ("float16", mx.bfloat16), ("bfloat16", mx.int32)])
def test_other_dtypes_are_refused(inputs, dtype):
    q = k = v = mx.zeros((1, 2, 3, 8), dtype=getattr(mx, inputs))
    with pytest.raises(ValueError, match="dtype must be None, the inputs' dtype"):
        flash_attention(q, k, v, dtype=dtype)


@pytest.mark.parametrize("case", list(widened_cases()), ids=str)
def test_out_dtype_is_the_float32_result_rounded_once(case):
    # out_dtype = the inputs' dtype: what the patch asks for; equal, bit for
    # bit, to casting the float32 result (on CUDA the prefills store it
    # themselves: tests/gpu covers their launch shapes).
    q, k, v, mask = make_inputs(case)
    out = flash_attention(q, k, v, mask=mask, dtype=mx.float32, out_dtype=q.dtype)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert mx.array_equal(out, flash_attention(q, k, v, mask=mask, dtype=mx.float32).astype(q.dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("L", [1, 70])
@pytest.mark.parametrize("sinks", [False, True])
def test_out_dtype_over_quantized_keys_and_values_and_sinks(dtype, L, sinks):
    # On the CPU the 16-bit kernels' own output where there are no sinks
    # (their factor is applied after the kernel), the cast otherwise.
    q, kq, vq = quantized_case((1,), (8, 2), L, 600, 64, 4, 32, dtype, "kv_cache", seed=5)
    kw = dict(mask="causal", group_size=32, bits=4, dtype=mx.float32)
    if sinks:
        kw["sinks"] = mx.array(np.linspace(-1.0, 2.0, 8), dtype=mx.float32)
    out = flash_attention(q, kq, vq, out_dtype=q.dtype, **kw)
    assert out.dtype == q.dtype
    assert mx.array_equal(out, flash_attention(q, kq, vq, **kw).astype(q.dtype))


def test_out_dtype_default_and_same_dtype():
    case = Case(batch=(1,), heads=(4, 2), L=5, S=40, E=16, mask="causal", dtype="bfloat16")
    q, k, v, mask = make_inputs(case)
    widened = flash_attention(q, k, v, mask=mask, dtype=mx.float32)
    assert mx.array_equal(flash_attention(q, k, v, mask=mask, dtype=mx.float32, out_dtype=mx.float32), widened)
    native = flash_attention(q, k, v, mask=mask, out_dtype=mx.bfloat16)
    assert native.dtype == mx.bfloat16 and mx.array_equal(native, flash_attention(q, k, v, mask=mask))
    q32, k32, v32 = (x.astype(mx.float32) for x in (q, k, v))
    out = flash_attention(q32, k32, v32, mask=mask, dtype=mx.float32, out_dtype=mx.float32)
    assert mx.array_equal(out, flash_attention(q32, k32, v32, mask=mask))


@pytest.mark.parametrize("inputs, dtype, out_dtype", [
    ("bfloat16", mx.float32, mx.float16),  # neither the inputs' dtype nor dtype
    ("bfloat16", None, mx.float32),        # no float32 attention to keep
    ("float32", None, mx.bfloat16),        # float32 inputs: no 16-bit result
    ("float16", mx.float32, mx.int32),
])
def test_other_out_dtypes_are_refused(inputs, dtype, out_dtype):
    q = k = v = mx.zeros((1, 2, 3, 8), dtype=getattr(mx, inputs))
    with pytest.raises(ValueError, match="out_dtype must be None, the inputs' dtype") as info:
        flash_attention(q, k, v, dtype=dtype, out_dtype=out_dtype)
    assert info.value.reason == "unsupported_dtype"


def test_out_dtype_gradients_are_those_of_the_cast():
    case = Case(batch=(1,), heads=(4, 2), L=20, S=300, E=64, mask="causal", dtype="bfloat16")
    q, k, v, mask = make_inputs(case)

    def rounded(q, k, v):
        return flash_attention(q, k, v, mask=mask, dtype=mx.float32, out_dtype=mx.bfloat16).astype(mx.float32).sum()

    def cast(q, k, v):
        return flash_attention(q, k, v, mask=mask, dtype=mx.float32).astype(mx.bfloat16).astype(mx.float32).sum()

    for a, b in zip(mx.grad(rounded, argnums=(0, 1, 2))(q, k, v), mx.grad(cast, argnums=(0, 1, 2))(q, k, v)):
        assert a.dtype == mx.bfloat16 and mx.array_equal(a, b)


def test_empty_keys_give_float32_zeros():
    q = mx.ones((1, 2, 3, 8), dtype=mx.bfloat16)
    k = v = mx.zeros((1, 2, 0, 8), dtype=mx.bfloat16)
    out = flash_attention(q, k, v, dtype=mx.float32)
    assert out.dtype == mx.float32 and not out.any().item()
    out = flash_attention(q, k, v, dtype=mx.float32, out_dtype=mx.bfloat16)
    assert out.dtype == mx.bfloat16 and not out.any().item()


def test_gradients_are_those_of_the_cast_path():
    case = Case(batch=(1,), heads=(4, 2), L=1, S=300, E=64, mask="none", dtype="bfloat16")
    q, k, v, _ = make_inputs(case)

    def widened(q, k, v):
        return flash_attention(q, k, v, dtype=mx.float32).sum()

    def cast(q, k, v):
        return flash_attention(*(x.astype(mx.float32) for x in (q, k, v))).sum()

    for a, b in zip(mx.grad(widened, argnums=(0, 1, 2))(q, k, v), mx.grad(cast, argnums=(0, 1, 2))(q, k, v)):
        assert a.dtype == mx.bfloat16
        assert relative_error(a, np.array(b.astype(mx.float32))) <= TOLERANCE["bfloat16"]
