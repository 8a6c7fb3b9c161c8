// Moving tiles between the strided inputs and float32 scratch, converting
// float16 / bfloat16 as they are read: no separate cast pass over the inputs.

#pragma once

#include <cstdint>
#include <cstring>

#include "mlx/types/half_types.h"

namespace flashattn::cpu {

// dst[r * ld + e] = src[base + (r0 + r) * row_stride + e * col_stride] * mul
// for r < rows, e < E; the remaining rows up to tile_rows are zeroed so that
// padded rows never carry stale values.
template <typename T>
void load_tile(
    const T* src,
    int64_t base,
    int64_t row_stride,
    int64_t col_stride,
    int r0,
    int rows,
    int E,
    float mul,
    float* dst,
    int ld,
    int tile_rows) {
  for (int r = 0; r < rows; ++r) {
    const T* row = src + base + int64_t(r0 + r) * row_stride;
    float* d = dst + r * ld;
    for (int e = 0; e < E; ++e) {
      d[e] = static_cast<float>(row[int64_t(e) * col_stride]) * mul;
    }
  }
  for (int r = rows; r < tile_rows; ++r) {
    std::memset(dst + r * ld, 0, sizeof(float) * E);
  }
}

// Writes o_i / l_i for rows of one query tile into the row contiguous output;
// rows that saw no visible key (l_i = 0) are zeros, never NaN.
template <typename T>
void store_output(
    const float* o_i,
    int ld_o,
    const float* l_i,
    int rows,
    int E,
    T* out) {
  for (int r = 0; r < rows; ++r) {
    float inv = l_i[r] == 0.0f ? 0.0f : 1.0f / l_i[r];
    for (int e = 0; e < E; ++e) {
      out[int64_t(r) * E + e] = static_cast<T>(o_i[r * ld_o + e] * inv);
    }
  }
}

} // namespace flashattn::cpu
