"""The CUDA kernels are compiled and embedded whenever the build had nvcc
(CI has it; a GPU is only needed to run them: tests/gpu)."""

import pathlib
import shutil
import subprocess

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
    # float32 at head dim 64 on float16 tensor cores: the split, then the attention
    | {"fa_f32_split_64", "fa_prefill_wgs_float32_64"}
    # and its backward under a causal mask: the split of q, k, v and dO, then the keys pass
    | {"fa_f32_split4_64", "fa_backward_keyswgsc_float32_64"}
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



ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = ROOT / "packages" / "flashattn-core" / "build"


def _ninja_file():
    """The newest CMake build of flashattn-core, if it was configured from the
    CMakeLists.txt of this tree (its unit list is then this tree's)."""
    found = sorted(BUILD.glob("*/build.ninja"), key=lambda p: p.stat().st_mtime)
    cmake_lists = ROOT / "packages" / "flashattn-core" / "CMakeLists.txt"
    if not found or found[-1].stat().st_mtime < cmake_lists.stat().st_mtime:
        return None
    return found[-1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA compiler) is not installed here")
@pytest.mark.skipif(_ninja_file() is None,
                    reason="a CMake build of flashattn-core (packages/flashattn-core/build) newer than its CMakeLists.txt")
def test_units_built_through_compute_80_ptx_have_the_same_compute_90_code():
    """The build makes most units' Hopper machine code from their compute_80
    PTX (CMakeLists.txt); that is right only while their PTX for compute_90 is
    the same. A unit whose code differs (e.g. under __CUDA_ARCH__ >= 900)
    must keep a front end for each image, or its Hopper code silently loses
    that branch. Checked here for the units whose sources test
    __CUDA_ARCH__; scripts/check-cuda-ptx-arch without --arch-branches
    checks every unit (~2 min)."""
    script = ROOT / "scripts" / "check-cuda-ptx-arch"
    run = subprocess.run(["bash", str(script), "--arch-branches", str(_ninja_file().parent)],
                         capture_output=True, text=True)
    assert run.returncode == 0, (
        "units to keep a compute_90 front end (CMakeLists.txt's FLASHATTN_ARCH_SOURCES):\n" + run.stdout + run.stderr)
