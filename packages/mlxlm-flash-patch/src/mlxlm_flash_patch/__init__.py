"""Route mlx-lm's attention through flashattn_core.flash_attention.

    import mlxlm_flash_patch
    mlxlm_flash_patch.enable()          # every mlx-lm model, from now on

or, for scripts you do not want to touch, set MLX_FLASH_ATTENTION=1 in the
environment (a startup hook installed with this package does the rest).
"""

from __future__ import annotations

from contextlib import contextmanager

from ._stats import reset_stats, stats
from .patcher import disable, enable, is_enabled, precision

__version__ = "0.1.0"
__all__ = ["enable", "disable", "is_enabled", "patched", "precision", "stats", "reset_stats"]


@contextmanager
def patched(precision: str = "float32"):
    """Enable the patch inside a with-block; restore the previous state after."""
    from .patcher import precision as current_precision

    was = current_precision()
    enable(precision)
    try:
        yield
    finally:
        if was is None:
            disable()
        else:
            enable(was)
