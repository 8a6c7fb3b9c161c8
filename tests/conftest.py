import os

# Before MLX is imported: on CUDA, MLX's own float32 products (the SDPA and
# VJP some tests compare with) at float32 accuracy, not TF32's (~1e-3), as
# scripts/cuda-check runs the suite.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    max_examples=int(os.environ.get("FLASHATTN_FUZZ_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("default")
