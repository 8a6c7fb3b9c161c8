// Where key splits leave their partials, in plain C++: the kernels find
// them and the planner (dispatch.cpp) sizes them from the same functions.
//
// A call's partials are one float32 array (the primitive's last output):
// o (splits x rows x E floats), then, from the next 16-byte boundary, m / l
// (splits x rows x 2), then the fused decode's tickets (decode_combine.cuh).
// The fused decode launches with that array as its only output (each output
// costs MLX's custom-kernel path host time on every call): the attention
// output first, the partials from the next 256-byte boundary
// (fused_offset_floats).

#pragma once

#include <cstdint>

namespace fa::partials {

#if defined(__CUDACC__)
#define FA_PARTIALS_FN __host__ __device__ constexpr
#else
#define FA_PARTIALS_FN constexpr
#endif

// Floats from the start of o to the start of m / l.
FA_PARTIALS_FN int64_t ml_offset(int64_t splits, int64_t rows, int64_t E) { return (splits * rows * E + 3) / 4 * 4; }

// Floats of o and m / l.
FA_PARTIALS_FN int64_t floats(int64_t splits, int64_t rows, int64_t E) { return ml_offset(splits, rows, E) + splits * rows * 2; }

// Floats from the fused decode's output to its partials: its output's
// bytes rounded up to 256.
FA_PARTIALS_FN int64_t fused_offset_floats(int64_t out_bytes) { return (out_bytes + 255) / 256 * 64; }

#undef FA_PARTIALS_FN

}  // namespace fa::partials
