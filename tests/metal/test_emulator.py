"""The emulator itself: its SIMD-group operations and matrices compute what
MSL defines, and the mistakes it exists to catch are caught (divergent SIMD
operations, a missing barrier, a deadlock, Apple's limits, writes outside an
output, an output element never written, an input MLX would not pass as a
device pointer, mixed address spaces). Each kernel here is a few lines of
MSL run through the same build as flashattn-core's."""

import numpy as np
import pytest

import metal_emulator
from metal_emulator import EmulatorError

# The emulator compiles the kernels with clang: without it nothing here can run.
pytestmark = pytest.mark.skipif(metal_emulator.find_compiler() is None, reason=metal_emulator.MISSING_COMPILER)

PRELUDE = "#include <metal_stdlib>\nusing namespace metal;\n"

KERNELS = {
    "simd_ops": (["x"], ["out"], """
  const uint i = thread_position_in_grid.x;
  const float v = x[i];
  out[4 * i + 0] = simd_sum(v);
  out[4 * i + 1] = simd_max(v);
  out[4 * i + 2] = simd_shuffle(v, ushort((thread_index_in_simdgroup + 5) % 32));
  out[4 * i + 3] = simd_shuffle_xor(v, ushort(3));
"""),
    "matrix": (["a", "b", "c"], ["d"], """
  simdgroup_float8x8 A, B, C;
  simdgroup_load(A, a, 8);
  simdgroup_load(B, b, 8, ulong2(0, 0), true);
  simdgroup_load(C, c, 8);
  simdgroup_multiply_accumulate(C, A, B, C);
  simdgroup_store(C, d, 8);
"""),
    "divergent": (["x"], ["out"], """
  const uint i = thread_position_in_grid.x;
  if (thread_index_in_simdgroup < 16) {
    out[i] = simd_sum(x[i]);
  } else {
    out[i] = simd_max(x[i]);
  }
"""),
    "with_barrier": (["x"], ["out"], """
  threadgroup float shared[64];
  shared[thread_index_in_threadgroup] = x[thread_position_in_grid.x];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[thread_position_in_grid.x] = shared[(thread_index_in_threadgroup + 33) % 64];
"""),
    "without_barrier": (["x"], ["out"], """
  threadgroup float shared[64];
  shared[thread_index_in_threadgroup] = x[thread_position_in_grid.x];
  out[thread_position_in_grid.x] = shared[(thread_index_in_threadgroup + 33) % 64];
"""),
    "barrier_in_branch": (["x"], ["out"], """
  if (thread_index_in_threadgroup < 32) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[thread_position_in_grid.x] = x[thread_position_in_grid.x];
"""),
    "too_much_threadgroup_memory": (["x"], ["out"], """
  threadgroup float big[8200];
  big[thread_index_in_threadgroup] = x[thread_position_in_grid.x];
  out[thread_position_in_grid.x] = big[thread_index_in_threadgroup];
"""),
    "writes_past_the_end": (["x"], ["out"], """
  out[thread_position_in_grid.x + 1] = x[thread_position_in_grid.x];
"""),
    "skips_an_element": (["x"], ["out"], """
  if (thread_position_in_grid.x != 5) out[thread_position_in_grid.x] = x[thread_position_in_grid.x];
"""),
}


def as_metal(kernels, prelude=PRELUDE):
    """The `_ext._metal_kernels()` form for kernels without template
    arguments, all arguments float."""
    return {
        "source": prelude,
        "kernels": [{"name": n, "inputs": i, "outputs": o, "body": b} for n, (i, o, b) in kernels.items()],
        "instances": [
            {"kernel": n, "name": n, "template_params": [],
             "input_types": ["float"] * len(i), "output_types": ["float"] * len(o)}
            for n, (i, o, _) in kernels.items()
        ],
    }


@pytest.fixture(scope="module")
def emu():
    return metal_emulator.load(as_metal(KERNELS))


def x64():
    return np.random.default_rng(0).standard_normal(64).astype(np.float32)


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffled"])
def test_simd_functions(emu, order):
    x = x64()
    (out,) = emu.run("simd_ops", [x], [((64, 4), np.float32)], (64, 1, 1), (64, 1, 1), order=order)
    groups = x.reshape(2, 32)
    lanes = np.arange(32)
    np.testing.assert_allclose(out[:, 0], np.repeat(groups.sum(1), 32), rtol=1e-5)
    np.testing.assert_array_equal(out[:, 1], np.repeat(groups.max(1), 32))
    np.testing.assert_array_equal(out[:, 2], groups[:, (lanes + 5) % 32].ravel())
    np.testing.assert_array_equal(out[:, 3], groups[:, lanes ^ 3].ravel())


def test_simdgroup_matrix_multiply_accumulate(emu):
    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    (d,) = emu.run("matrix", [a, b, c], [((8, 8), np.float32)], (32, 1, 1), (32, 1, 1))
    np.testing.assert_allclose(d, a @ b.T + c, rtol=1e-5, atol=1e-6)  # b loaded transposed


def test_divergent_simd_operations_are_reported(emu):
    with pytest.raises(EmulatorError, match="simd_sum.*simd_max.*divergent"):
        emu.run("divergent", [x64()], [((64,), np.float32)], (64, 1, 1), (64, 1, 1))


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffled"])
def test_a_barrier_makes_every_order_agree(emu, order):
    x = x64()
    (out,) = emu.run("with_barrier", [x], [((64,), np.float32)], (64, 1, 1), (64, 1, 1), order=order)
    np.testing.assert_array_equal(out, x[(np.arange(64) + 33) % 64])


def test_a_missing_barrier_shows_as_unwritten_threadgroup_memory(emu):
    # Forward order: lane t reads lane t + 33's slot before that lane has run;
    # threadgroup memory starts poisoned, so the read is NaN.
    (out,) = emu.run("without_barrier", [x64()], [((64,), np.float32)], (64, 1, 1), (64, 1, 1))
    assert np.isnan(out[:31]).all()


def test_a_barrier_not_every_thread_reaches_is_a_deadlock(emu):
    with pytest.raises(EmulatorError, match="deadlock|returned"):
        emu.run("barrier_in_branch", [x64()], [((64,), np.float32)], (64, 1, 1), (64, 1, 1))


def test_threadgroup_memory_beyond_32_kib_is_refused(emu):
    with pytest.raises(EmulatorError, match="threadgroup memory of 32800 bytes: Apple GPUs allow 32768"):
        emu.run("too_much_threadgroup_memory", [x64()], [((64,), np.float32)], (64, 1, 1), (64, 1, 1))


def test_threadgroups_beyond_1024_threads_are_refused(emu):
    x = np.zeros(2048, np.float32)
    with pytest.raises(EmulatorError, match="threadgroup of 2048 threads"):
        emu.run("skips_an_element", [x], [((2048,), np.float32)], (2048, 1, 1), (2048, 1, 1))


def test_writes_outside_an_output_are_reported(emu):
    with pytest.raises(EmulatorError, match="wrote outside output out"):
        emu.run("writes_past_the_end", [x64()], [((64,), np.float32)], (64, 1, 1), (64, 1, 1))


def test_an_unwritten_output_element_stays_nan(emu):
    x = x64()
    (out,) = emu.run("skips_an_element", [x], [((64,), np.float32)], (64, 1, 1), (32, 1, 1))
    assert np.isnan(out[5]) and np.array_equal(np.delete(out, 5), np.delete(x, 5))


def test_partial_threadgroups_at_the_grid_edge(emu):
    x = np.arange(50, dtype=np.float32)  # 50 threads in threadgroups of 32: 32 + 18
    (out,) = emu.run("skips_an_element", [x], [((50,), np.float32)], (50, 1, 1), (32, 1, 1))
    assert np.array_equal(np.delete(out, 5), np.delete(x, 5))


def test_inputs_mlx_would_pass_as_constant_are_refused(emu):
    with pytest.raises(EmulatorError, match="constant address space"):
        emu.run("skips_an_element", [np.zeros(4, np.float32)], [((4,), np.float32)], (4, 1, 1), (4, 1, 1))


def test_mixing_address_spaces_does_not_compile():
    bad = {"mixed": (["x"], ["out"], """
  threadgroup float shared[32];
  const device float* p = shared;
  out[thread_position_in_grid.x] = p[0] + x[0];
""")}
    with pytest.raises(RuntimeError, match="'device float const \\*' with an lvalue of type 'threadgroup float"):
        metal_emulator.load(as_metal(bad))
