// Key and value tiles of MLX's affine-quantized rows (as mlx-lm's
// QuantizedKVCache holds them: packed uint32 codes, a scale and a bias per
// group of elements) expanded into a prefill's shared memory, so the cache
// is read in place: no full-precision copy of it, only the tile. Element e
// of a row is scale * code + bias, its code at bits (e mod 32 / bits) *
// bits of word e * bits / 32 of the row, the scale and bias those of group
// e / group_size (32, 64 or 128: 8 elements at a multiple of 8 lie in one
// group). A thread takes 8 elements of a row at a time: one word of codes
// at 4 bits, two at 8.
//
// The loads of a tile are all issued before any is expanded, so they are
// in flight together (the kernels wait for a tile before computing on it
// anyway).

#pragma once

#include "common.cuh"

namespace fa {

// One KV head's quantized rows; S: the scales' and biases' dtype.
template <typename S>
struct QuantHead {
  const uint32_t* packed;  // row 0 of the head
  const S* scales;
  const S* biases;
  int psr, ssr;  // row strides: words, groups
  int bits, group_shift;

  // Rows first.. of the head as ROWS x E floats at dst (row stride LDT, in
  // floats, a multiple of 4), rows past count zeros. THREADS threads call it.
  template <int E, int LDT, int ROWS, int THREADS>
  __device__ __forceinline__ void load_f32(float* dst, int first, int count, int tid) const {
    constexpr int CHUNKS = E / 8, PER = ROWS * CHUNKS / THREADS;
    static_assert(E % 8 == 0 && LDT % 4 == 0 && ROWS * CHUNKS % THREADS == 0, "whole 8-element chunks a thread");
    // At most 4 chunks' loads in flight a thread: more cost the kernels at
    // E = 256 registers they have not got.
    constexpr int BATCH = PER < 4 ? PER : 4;
#pragma unroll
    for (int i0 = 0; i0 < PER; i0 += BATCH) {
      uint32_t w0[BATCH], w1[BATCH];
      float scale[BATCH], bias[BATCH];
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int idx = tid + (i0 + i) * THREADS, r = idx / CHUNKS, dim = idx % CHUNKS * 8;
        w0[i] = w1[i] = 0u;
        scale[i] = bias[i] = 0.0f;
        if (i0 + i < PER && r < count) {
          const int64_t row = first + r;
          const uint32_t* p = packed + row * psr + ((dim * bits) >> 5);
          w0[i] = __ldg(p);
          if (bits == 8) w1[i] = __ldg(p + 1);
          const int64_t gi = row * ssr + (dim >> group_shift);
          scale[i] = to_f(scales[gi]);
          bias[i] = to_f(biases[gi]);
        }
      }
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        if (i0 + i >= PER) break;
        const int idx = tid + (i0 + i) * THREADS, r = idx / CHUNKS, dim = idx % CHUNKS * 8;
        float x[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t code =
              bits == 4 ? (w0[i] >> (4 * j)) & 0xFu : ((j < 4 ? w0[i] : w1[i]) >> (8 * (j & 3))) & 0xFFu;
          x[j] = fmaf(scale[i], float(code), bias[i]);
        }
        float4* d = reinterpret_cast<float4*>(dst + r * LDT + dim);
        d[0] = make_float4(x[0], x[1], x[2], x[3]);
        d[1] = make_float4(x[4], x[5], x[6], x[7]);
      }
    }
  }
};

// ROWS x E elements of T from src's rows first.. as floats at dst (row
// stride LDT), rows past count zeros: element by element, so src needs no
// alignment (a prefill's queries, read once a block).
template <typename T, int E, int LDT, int ROWS, int THREADS>
__device__ __forceinline__ void load_rows_f32(float* dst, const T* src, int64_t stride, int first, int count,
                                              int tid) {
  for (int idx = tid; idx < ROWS * E; idx += THREADS) {
    const int r = idx / E, e = idx % E;
    dst[r * LDT + e] = r < count ? to_f(src[(first + r) * stride + e]) : 0.0f;
  }
}

}  // namespace fa
