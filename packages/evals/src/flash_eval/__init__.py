"""flash-eval: measurements of flashattn-core and mlxlm-flash-patch."""

__version__ = "0.1.0"
