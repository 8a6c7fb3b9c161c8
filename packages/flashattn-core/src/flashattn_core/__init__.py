"""FlashAttention-2 for MLX: one primitive, ``flash_attention``."""

import mlx.core as mx  # loads libmlx and registers mx.array before _ext

from ._ext import (UnsupportedError, cpu_info, cuda_kernels, flash_attention, gradient_stats,
                   mlx_version as _compiled_mlx_version, reset_gradient_stats)

if mx.__version__.split(".dev")[0] != _compiled_mlx_version:
    raise ImportError(
        f"flashattn_core was compiled against MLX {_compiled_mlx_version} but "
        f"MLX {mx.__version__} is installed; reinstall flashattn-core in this "
        f"environment or install mlx=={_compiled_mlx_version}"
    )

__all__ = [
    "UnsupportedError", "cpu_info", "cuda_kernels", "flash_attention", "gradient_stats", "reset_gradient_stats",
]
__version__ = "0.1.0"
