"""The CUDA kernels are compiled and embedded whenever the build had nvcc
(CI has it; a GPU is only needed to run them: tests/gpu)."""

import shutil

import pytest

import flashattn_core

DTYPES = ["float32", "float16", "bfloat16"]
EXPECTED = (
    {f"fa_generic{s}_{d}_{e}" for d in DTYPES for e in range(1, 9) for s in ("", "_split")}
    | {f"fa_merge{s}_{d}" for d in DTYPES for s in ("", "_lse")}
    | {f"fa_generic_vsplit_{d}_{lanes}" for d in DTYPES for lanes in (8, 16, 32)}
    | {f"fa_decode{s}_{d}_{e}" for d in DTYPES for e in (64, 96, 128) for s in ("", "_fused")}
    | {f"fa_decode_{f}{s}_{d}_{e}" for f in ("mma", "mma32") for d in ("float16", "bfloat16") for e in (64, 128)
       for s in ("", "_fused")}
    | {f"fa_decode_tf32{s}_float32_{e}" for e in (64, 128) for s in ("", "_fused")}
    | {f"fa_prefill_{d}_{e}" for d in ("float16", "bfloat16") for e in (64, 80, 96, 128, 256)}
    | {f"fa_prefill_float32_{e}" for e in (64, 80, 96, 128, 256)}
    | {f"fa_prefill_pairs_float32_{e}" for e in (80, 96, 128)}
    | {f"fa_prefill_tf32q_{d}_{e}" for d in DTYPES for e in (64, 96, 128, 256)}
    | {f"fa_decode_mmaq{b}{s}_{d}_{e}" for b in (4, 8) for d in ("float16", "bfloat16") for e in (64, 128)
       for s in ("", "_fused")}
    | {f"fa_decode_tf32q{s}_{d}_{e}" for d in DTYPES for e in (64, 128) for s in ("", "_fused")}
    # the tensor-core decodes with attention sinks
    | {f"fa_decode_{f}_sinks{s}_{d}_{e}" for f in ("mma", "mma32", "mmaq4", "mmaq8") for d in ("float16", "bfloat16")
       for e in (64, 128) for s in ("", "_fused")}
    | {f"fa_decode_tf32_sinks{s}_float32_{e}" for e in (64, 128) for s in ("", "_fused")}
    | {f"fa_decode_tf32q_sinks{s}_{d}_{e}" for d in DTYPES for e in (64, 128) for s in ("", "_fused")}
    | {f"fa_backward_{p}_{d}_{e}" for p in ("stats", "keysq", "dflags") for d in ("float16", "bfloat16")
       for e in (64, 128)}
    | {f"fa_backward_{p}_{d}_{e}" for p in ("rows", "keys") for d in DTYPES for e in (64, 128, 256)
       if d == "float32" or e == 256}
    | {f"fa_backward_{p}{k}_float32_{e}" for p in ("rows", "keys", "keysq") for k in ("n", "c") for e in (64, 128)}
    | {f"fa_backward_{p}_float32_{e}" for p in ("d", "keysq") for e in (64, 128)}
    | {f"fa_backward_dq_{d}" for d in ("float16", "bfloat16")}
    | {"fa_quant_split_bfloat16"}
)
# Hopper's arch-specific instructions (wgmma): sm_90a machine code, no PTX.
HOPPER_ONLY = (
    {f"fa_prefill_wg_float32_{e}" for e in (64, 128)}
    | {f"fa_prefill_wgq_{d}_64" for d in DTYPES}
    | {f"fa_prefill_{f}_{d}_{e}" for f in ("wg", "wg32", "wg32h") for d in ("float16", "bfloat16")
       for e in (64, 80, 96, 128)}
    | {f"fa_prefill_wg2_{d}_64" for d in ("float16", "bfloat16")}
    | {f"fa_prefill_{f}_bfloat16_{e}" for f in ("wg32t", "wg32th") for e in (128, 256)}
    | {f"fa_backward_{p}wg_{d}_{e}" for p in ("stats", "keys") for d in ("float16", "bfloat16") for e in (64, 128)}
    | {f"fa_backward_keyswg{k}_{d}_{e}" for k in ("n", "c") for d in ("float16", "bfloat16") for e in (64, 128)}
)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA compiler) is not installed here")
def test_every_dispatchable_kernel_is_embedded():
    kernels = flashattn_core.cuda_kernels()
    assert EXPECTED | HOPPER_ONLY <= set(kernels), sorted((EXPECTED | HOPPER_ONLY) - set(kernels))
    # Small modules: MLX copies and hashes one on every launch. Each kernel has
    # Hopper machine code and PTX for the other GPUs, in modules of their own.
    for name, sizes in kernels.items():
        assert set(sizes) == {"sm90", "ptx"}, name
        assert 0 < sizes["sm90"] < 128 * 1024, (name, sizes)
        if name in HOPPER_ONLY:
            assert sizes["ptx"] == 0, (name, sizes)
        else:
            assert 0 < sizes["ptx"] < 256 * 1024, (name, sizes)
