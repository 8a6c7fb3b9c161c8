// What the CUDA path asks of the CUDA driver that MLX has loaded (looked up
// at run time with dlopen / dlsym: this extension links no CUDA library, so
// one binary serves MLX's CPU and CUDA builds).

#pragma once

#include <array>
#include <cstdint>
#include <optional>

namespace flashattn::cuda {

// The GPU's SM count, or 0 if unknown (MLX's device_info does not give it).
int multiprocessors(int device_index);

// The shared memory a block may opt in to (bytes), or 0 if unknown.
int max_shared_memory_per_block(int device_index);

// A tensor map template (cuTensorMapEncodeTiled): a rank-4 tensor (head dim,
// rows, heads, batch) of 16-bit elements (bfloat16 unless float16), copied
// in boxes of 64 head-dim columns with the 128-byte swizzle, rows past the
// end read as zeros. Its address, sizes, strides and box rows are
// placeholders that the kernel replaces (tma.cuh). nullopt if the driver has
// no tensor maps.
using TensorMap = std::array<uint32_t, 32>;
std::optional<TensorMap> tensor_map_template(bool float16);

}  // namespace flashattn::cuda
