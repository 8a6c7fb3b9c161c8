"""Route mlx-lm's attention through flashattn_core.flash_attention.

Not written yet: this package is a placeholder in the workspace layout and
patches nothing. Its README says what it will do.
"""

__version__ = "0.1.0"
__all__: list[str] = []
