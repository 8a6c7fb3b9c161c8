// Where the float32 kernels (the prefills, and decode_tf32.cu's quantized
// variant) read key and value rows from: float32 rows (F32Rows), or MLX's
// affine-quantized rows (QuantHead: as mlx-lm's
// QuantizedKVCache holds them, packed uint32 codes, a scale and a bias per
// group of elements), expanded as they are read, so a quantized cache is
// read in place: no full-precision copy of it, only the tile. Element e of
// a quantized row is scale * code + bias, its code at bits (e mod 32 /
// bits) * bits of word e * bits / 32 of the row, the scale and bias those
// of group e / group_size (32, 64 or 128: 4 or 8 elements at a multiple of
// 4 or 8 lie in one group).

#pragma once

#include "mma.cuh"

namespace fa {

// One head's float32 rows.
struct F32Rows {
  const float* p;
  int64_t sr;
};

// One KV head's quantized rows; S: the scales' and biases' dtype.
template <typename S>
struct QuantHead {
  const uint32_t* packed;  // row 0 of the head
  const S* scales;
  const S* biases;
  int psr, ssr;  // row strides: words, groups
  int bits, group_shift;

  // Rows first.. of the head as ROWS x E floats at dst (row stride LDT, in
  // floats, a multiple of 4), rows past count zeros. THREADS threads call
  // it; a thread takes 8 elements of a row at a time (one word of codes at 4
  // bits, two at 8) and issues all its loads of a batch before expanding
  // any, so they are in flight together.
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

// 4 elements of a row as loaded (T the scales' dtype): kernels that hold a
// tile in registers until a tile later expand them only then, so the loads
// stay in flight meanwhile.
template <typename T>
struct QuantRaw {
  uint32_t w;  // the word that holds the 4 codes (4 bits: in its low or high half)
  T s, b;
};
template <typename T>
__device__ __forceinline__ QuantRaw<T> load_quant4(const QuantHead<T>& h, int64_t row, int col) {
  const int64_t gi = row * h.ssr + (col >> h.group_shift);
  return {__ldg(h.packed + row * h.psr + ((col * h.bits) >> 5)), h.scales[gi], h.biases[gi]};
}
// Elements col .. col + 3 (col a multiple of 4) from their raw.
template <typename T>
__device__ __forceinline__ float4 expand_quant4(const QuantRaw<T>& r, int col, int bits) {
  const float s = to_f(r.s), b = to_f(r.b);
  float x[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t code = bits == 4 ? (r.w >> ((col & 4) * 4 + 4 * j)) & 0xFu : (r.w >> (8 * j)) & 0xFFu;
    x[j] = fmaf(s, float(code), b);
  }
  return make_float4(x[0], x[1], x[2], x[3]);
}

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

// ROWS rows of E floats (row stride LDT) from src's rows first.., zeros past count.
template <int E, int LDT, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile32(float* dst, const float* src, int64_t stride, int first, int count,
                                            int tid) {
  constexpr int CHUNKS = E / 4;
  for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
    const int r = idx / CHUNKS, c4 = idx % CHUNKS;
    const bool valid = r < count;
    cp_async16(dst + r * LDT + c4 * 4, valid ? src + (first + r) * stride + c4 * 4 : src, valid);
  }
}

// Where prefill_tf32 reads one block's rows from (head(blk): Q's query head,
// K's and V's KV head), each tile as ROWS x E floats of row stride LDT:
// float32 rows, copied by cp.async (Tf32Rows), or 16-bit or float32 queries
// and MLX's affine-quantized keys and values (Tf32QuantRows: kv_rows.cuh),
// read by plain loads. Either way the kernel waits for a tile (cp.async's
// wait and a barrier) before reading it.
struct Tf32Rows {
  const float *q, *k, *v;
  Layout lay;
  struct Head {
    const float* q;
    int64_t q_sr;
    F32Rows k, v;
    template <int E, int LDT, int ROWS, int THREADS>
    __device__ __forceinline__ void load_q(float* dst, int first, int count, int tid) const {
      load_tile32<E, LDT, ROWS, THREADS>(dst, q, q_sr, first, count, tid);
    }
    template <int E, int LDT, int ROWS, int THREADS>
    __device__ __forceinline__ void load_k(float* dst, int first, int count, int tid) const {
      load_tile32<E, LDT, ROWS, THREADS>(dst, k.p, k.sr, first, count, tid);
    }
    template <int E, int LDT, int ROWS, int THREADS>
    __device__ __forceinline__ void load_v(float* dst, int first, int count, int tid) const {
      load_tile32<E, LDT, ROWS, THREADS>(dst, v.p, v.sr, first, count, tid);
    }
  };
  __device__ __forceinline__ Head head(const PrefillBlock& blk, int first = 0) const {
    return {q + lay.q.at(blk.b, blk.h, 0), lay.q.sr, {k + lay.k.at(blk.b, blk.g, first), lay.k.sr},
            {v + lay.v.at(blk.b, blk.g, first), lay.v.sr}};
  }
};

// T: the queries' dtype, which the scales and biases share. lay.k / lay.v:
// the packed codes' rows (in words); ks / vs: the scales' rows (in groups;
// the biases lie alike).
template <typename T>
struct Tf32QuantRows {
  const T* q;
  const uint32_t *k, *v;
  const T *k_scales, *k_biases, *v_scales, *v_biases;
  Layout lay;
  Rows ks, vs;
  int bits, group_shift;
  struct Head {
    const T* q;
    int64_t q_sr;
    QuantHead<T> k, v;
    template <int E, int LDT, int ROWS, int THREADS>
    __device__ __forceinline__ void load_q(float* dst, int first, int count, int tid) const {
      load_rows_f32<T, E, LDT, ROWS, THREADS>(dst, q, q_sr, first, count, tid);
    }
    template <int E, int LDT, int ROWS, int THREADS>
    __device__ __forceinline__ void load_k(float* dst, int first, int count, int tid) const {
      k.template load_f32<E, LDT, ROWS, THREADS>(dst, first, count, tid);
    }
    template <int E, int LDT, int ROWS, int THREADS>
    __device__ __forceinline__ void load_v(float* dst, int first, int count, int tid) const {
      v.template load_f32<E, LDT, ROWS, THREADS>(dst, first, count, tid);
    }
  };
  __device__ __forceinline__ Head head(const PrefillBlock& blk, int first = 0) const {
    const int64_t k_at = ks.at(blk.b, blk.g, first), v_at = vs.at(blk.b, blk.g, first);
    return {q + lay.q.at(blk.b, blk.h, 0), lay.q.sr,
            {k + lay.k.at(blk.b, blk.g, first), k_scales + k_at, k_biases + k_at, lay.k.sr, ks.sr, bits, group_shift},
            {v + lay.v.at(blk.b, blk.g, first), v_scales + v_at, v_biases + v_at, lay.v.sr, vs.sr, bits, group_shift}};
  }
};

}  // namespace fa
