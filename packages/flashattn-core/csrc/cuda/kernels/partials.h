// Where the fused decode (decode_combine.cuh) keeps its scratch, in plain
// C++: the kernels find it and the planner (plan_decode.cpp) sizes it from the
// same functions.
//
// The fused decode launches with one output (each output costs MLX's
// custom-kernel path host time on every call): its attention output first,
// then, from the next 256-byte boundary (fused_offset_floats), the splits'
// o partials (splits x rows x E floats), from the next 16-byte boundary
// their m / l (splits x rows x 2), then the tickets. (The generic kernel's
// split form keeps o and m / l in two arrays of their own: in one array its
// merge measured slower, the same code and bytes; docs/cuda.md.)

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
