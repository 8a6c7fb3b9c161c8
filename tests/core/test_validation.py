"""Every bad input raises ValueError (UnsupportedError) naming the argument,
before evaluation, with the reason a caller that falls back counts."""

import math

import mlx.core as mx
import pytest

from flashattn_core import UnsupportedError, flash_attention

q = mx.zeros((1, 4, 8, 16))
kv = mx.zeros((1, 2, 10, 16))

BAD = {
    "queries rank 2": ((mx.zeros((8, 16)), kv, kv, {}), "queries must have shape", "unsupported_input"),
    "keys rank": ((q, mx.zeros((2, 10, 16)), kv, {}), "keys must have the rank", "unsupported_input"),
    "values rank": ((q, kv, mx.zeros((2, 10, 16)), {}), "values must have the rank", "unsupported_input"),
    "batch mismatch": ((q, mx.zeros((2, 2, 10, 16)), mx.zeros((2, 2, 10, 16)), {}), "batch dimensions", "unsupported_input"),
    "heads not a multiple": ((q, mx.zeros((1, 3, 10, 16)), mx.zeros((1, 3, 10, 16)), {}), "multiple", "unsupported_input"),
    "zero kv heads": ((q, mx.zeros((1, 0, 10, 16)), mx.zeros((1, 0, 10, 16)), {}), "multiple", "unsupported_input"),
    "key head dim": ((q, mx.zeros((1, 2, 10, 8)), kv, {}), "head dimension", "unsupported_input"),
    "value head dim": ((q, kv, mx.zeros((1, 2, 10, 8)), {}), "head dimension", "unsupported_input"),
    "value length": ((q, kv, mx.zeros((1, 2, 11, 16)), {}), "same shape", "unsupported_input"),
    "value heads": ((q, kv, mx.zeros((1, 1, 10, 16)), {}), "same shape", "unsupported_input"),
    "head dim 0": ((mx.zeros((1, 4, 8, 0)), mx.zeros((1, 2, 10, 0)), mx.zeros((1, 2, 10, 0)), {}), "between 1 and 256", "unsupported_head_dim"),
    "head dim 257": ((mx.zeros((1, 1, 2, 257)), mx.zeros((1, 1, 2, 257)), mx.zeros((1, 1, 2, 257)), {}), "between 1 and 256", "unsupported_head_dim"),
    "int dtype": ((q.astype(mx.int32), kv.astype(mx.int32), kv.astype(mx.int32), {}), "int32", "unsupported_dtype"),
    "float64": ((q.astype(mx.float64, stream=mx.cpu), kv.astype(mx.float64, stream=mx.cpu),
                 kv.astype(mx.float64, stream=mx.cpu), {}), "float64", "unsupported_dtype"),
    "mixed dtypes": ((q, kv.astype(mx.float16), kv, {}), "share one dtype", "unsupported_dtype"),
    "mask string": ((q, kv, kv, {"mask": "upper"}), '"upper"', "unsupported_mask"),
    "mask shape": ((q, kv, kv, {"mask": mx.zeros((8, 9))}), "does not broadcast", "unsupported_mask"),
    "mask rank": ((q, kv, kv, {"mask": mx.zeros((1, 1, 1, 8, 10))}), "does not broadcast", "unsupported_mask"),
    "mask dtype": ((q, kv, kv, {"mask": mx.zeros((8, 10), dtype=mx.int32)}), "int32", "unsupported_mask"),
    "scale nan": ((q, kv, kv, {"scale": math.nan}), "scale must be a finite", "unsupported_input"),
    "scale inf": ((q, kv, kv, {"scale": math.inf}), "scale must be a finite", "unsupported_input"),
}


@pytest.mark.parametrize("args, message, reason", BAD.values(), ids=BAD.keys())
def test_bad_input_raises_value_error(args, message, reason):
    queries, keys, values, kwargs = args
    with pytest.raises(ValueError, match="flash_attention") as info:
        flash_attention(queries, keys, values, **kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, UnsupportedError) and info.value.reason == reason


def test_dtype_argument_reason():
    with pytest.raises(UnsupportedError, match="dtype must be None") as info:
        flash_attention(q, kv, kv, dtype=mx.float16)
    assert info.value.reason == "unsupported_dtype"


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="needs an MLX build without a GPU backend (this one has one)")
def test_gpu_stream_without_gpu_backend():
    with pytest.raises(UnsupportedError, match="no GPU backend") as info:
        flash_attention(q, kv, kv, stream=mx.gpu)
    assert info.value.reason == "no_gpu_kernel"


def test_non_array_mask_is_a_type_error():
    with pytest.raises(TypeError):
        flash_attention(q, kv, kv, mask=[[True]])


def test_valid_call_after_errors_still_works():
    out = flash_attention(q, kv, kv, mask="causal")
    assert out.shape == q.shape
