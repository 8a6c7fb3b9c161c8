"""The attention function that stands in for mlx-lm's
``mlx_lm.models.base.scaled_dot_product_attention`` while the patch is on.

Same signature. Routes through ``flashattn_core.flash_attention``; every case
the kernel does not take goes to mlx-lm's own function, counted and logged.
"""

from __future__ import annotations

import mlx.core as mx

from flashattn_core import UnsupportedError, flash_attention

from ._stats import count_fallback, count_flash_call
from .pacing import pace
from .windows import as_window


def make_attention(original, precision: str):
    """The replacement for mlx-lm's shared attention function.

    precision "float32" (the default, as the design asks) computes attention
    in float32 and casts the result back to the queries' dtype: 16-bit
    queries, keys and values go to flash_attention with dtype=float32, which
    is float32 attention on cast inputs (the kernels read the 16-bit keys
    and values without casting them, and on CUDA a gradient comes from the
    16-bit backward), and out_dtype the queries' dtype (a Hopper GPU's prefill
    then stores the rounded result itself, without a float32 copy to cast);
    "native" hands flash_attention the model's own dtype.
    """
    dtype = mx.float32 if precision == "float32" else None

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        # A QuantizedKVCache hands over (packed, scales, biases) triples,
        # which flash_attention reads in place (on the CPU).
        quantized = {"group_size": cache.group_size, "bits": cache.bits} if hasattr(cache, "bits") else {}
        out_dtype = queries.dtype
        # A sliding-window layer's band mask goes in as the window it is.
        flash_mask, window = as_window(mask) or (mask, None)
        try:
            # Sinks (gpt-oss) run on every backend, under a gradient too.
            out = flash_attention(queries, keys, values, scale=scale, mask=flash_mask, window=window, dtype=dtype,
                                  out_dtype=out_dtype, sinks=sinks, **quantized)
        except (ValueError, TypeError) as error:
            # Validation happens before anything is computed: nothing is lost.
            # The check that refused the call names the reason; a wrong Python
            # type (nanobind's TypeError) is unsupported input.
            reason = error.reason if isinstance(error, UnsupportedError) else "unsupported_input"
            count_fallback(reason, str(error))
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        count_flash_call(windowed=window is not None)
        # A quantized cache is a choice of memory over speed: its prefill on
        # CUDA runs paced (pacing.py).
        pace(out, queries.shape[-2] if quantized else 0)
        return out

    scaled_dot_product_attention.__doc__ = original.__doc__
    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention._mlxlm_flash_patch = True
    return scaled_dot_product_attention

