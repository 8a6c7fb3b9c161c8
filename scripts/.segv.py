import mlx.core as mx, flashattn_core
try:
    flashattn_core.flash_attention(mx.zeros((8, 16)), mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))
except ValueError as e:
    print("ValueError OK:", e)
