// float32 rows as two float16 terms, every 128-row tile of a (batch, head)
// scaled by a power of two of its own (f32_split.cu), as the split-query
// prefill (prefill_f32s_wg.cu) and the backward (backward_f32s_wg.cu) read
// them: the tiles' shifts (kBad: a tile with a value that is not finite,
// which the kernels read from the float32 inputs instead).

#pragma once

#include <cstdint>

#include "common.cuh"
#include "wg_shapes.h"

namespace fa::f32_split {

constexpr int kRows = wg_shapes::kF32sSplitRows;  // a tile's rows, the shift's reach
// The shift of a tile with a value that is not finite; the backward's
// split (fa_f32_split4_) adds it to the shift of the tile's finite values
// instead (bad(s), shift_of(s)).
constexpr int kBad = 1 << 20;
__host__ __device__ constexpr bool bad(int s) { return s >= kBad / 2; }
__host__ __device__ constexpr int shift_of(int s) { return bad(s) ? s - kBad : s; }
__host__ __device__ constexpr int tiles(int rows) { return (rows + kRows - 1) / kRows; }

// Where the shifts lie: Q's tiles (slice b H_q + h), then K's and V's
// (slice b H_kv + g), tile by tile within a slice.
struct Shifts {
  const int* p;
  int64_t q_slices, kv_slices;  // batch x H_q, batch x H_kv
  int tq, tk;                   // tiles a slice: tiles(L), tiles(S)
  __device__ __forceinline__ const int* q(int64_t slice) const { return p + slice * tq; }
  __device__ __forceinline__ const int* k(int64_t slice) const { return p + q_slices * tq + slice * tk; }
  __device__ __forceinline__ const int* v(int64_t slice) const { return k(slice) + kv_slices * tk; }
  // dO's (the backward's split, fa_f32_split4_: slice b H_q + h)
  __device__ __forceinline__ const int* d(int64_t slice) const { return v(0) + kv_slices * tk + slice * tq; }
};

// 2^e exactly, e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

// The float32 inputs themselves, which a tile marked bad is read from.
struct Source {
  const float *q = nullptr, *k = nullptr, *v = nullptr;
  Layout lay{};
};

}  // namespace fa::f32_split
