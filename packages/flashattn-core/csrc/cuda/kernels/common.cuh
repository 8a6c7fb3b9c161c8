// Device helpers shared by every CUDA kernel: dtype conversion, warp
// reductions, input layouts, masks. Queries, keys and values arrive as MLX
// holds them (strided views included: their batch, head and row strides are
// launch arguments; the head dim is contiguous), and a mask made contiguous
// in its own shape, addressed through per-(batch, query head) base offsets
// and its row / column strides (0 on broadcast axes).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "causal.h"
#include "mask_bits.h"

#define FA_NEG_INF (-__int_as_float(0x7f800000))
#define FA_LOG2E 1.4426950408889634f

namespace fa {

enum MaskKind { kNone = 0, kCausal = 1, kBool = 2, kAdditive = 3 };

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Column k of W (16 x NB*8 in the mma accumulator layout) for this thread's
// rows g and g + 8: lane 4 g + (k % 8) / 2 holds them. Every lane asks.
template <int NB>
__device__ __forceinline__ void accumulator_column(const float (&w)[NB][4], int k, int lane, float (&p)[2]) {
  const int kb = k >> 3, odd = k & 1;
  float wa = 0.0f, wb = 0.0f;
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (b == kb) wa = odd ? w[b][1] : w[b][0], wb = odd ? w[b][3] : w[b][2];
  }
  const int src = 4 * (lane >> 2) + ((k & 7) >> 1);
  p[0] = __shfl_sync(0xffffffffu, wa, src);
  p[1] = __shfl_sync(0xffffffffu, wb, src);
}

// A call's tag (48 bits the host never repeats: primitive.cpp's next_tag)
// from its two 24-bit launch arguments: the fused decode's tickets and the
// tensor maps' slots tell this call's writes from what lay there before.
__device__ __forceinline__ unsigned long long call_tag(int lo, int hi) {
  return (unsigned long long)hi << 24 | (unsigned)lo;
}

// Where the rows of Q, K, V or the output lie: element e of row r of
// (batch b, head h) is at b sb + h sh + r sr + e (MLX strides, in elements).
struct Rows {
  int sb, sh, sr;
  __device__ __forceinline__ int64_t at(int64_t b, int64_t h, int64_t r) const {
    return b * sb + h * sh + r * sr;
  }
};

// o: the output's rows, which the prefills store (store_rows, mma.cuh) in
// the queries' layout as MLX's own attention does, so that mlx-lm's
// transpose back to (B, L, H E) copies nothing; the other kernels' outputs
// are row-contiguous.
struct Layout {
  Rows q, k, v, o;
};

// The layout as the last launch arguments of every attention kernel.
#define FA_LAYOUT_PARAMS                                                                                \
  int q_sb, int q_sh, int q_sr, int k_sb, int k_sh, int k_sr, int v_sb, int v_sh, int v_sr, int o_sb, int o_sh, \
      int o_sr
#define FA_LAYOUT \
  fa::Layout{{q_sb, q_sh, q_sr}, {k_sb, k_sh, k_sr}, {v_sb, v_sh, v_sr}, {o_sb, o_sh, o_sr}}

// The mask's contribution to one score, in the log2 domain: -inf hides.
// Every kernel asks it, and only it, which keys a row sees. A causal mask
// has no array: its column-stride argument carries the sliding window
// (mask_bits.h; kNoWindow: none).
struct Mask {
  int kind;
  const void* data;
  const int64_t* base;  // per (batch x query head)
  int row_stride, col_stride;
  int offset;           // causal_offset(L, S)

  __device__ __forceinline__ Mask(int kind_, const void* data_, const int64_t* base_, int row_stride_,
                                  int col_stride_, int L, int S)
      : kind(kind_ & kKindBits), data(data_), base(base_), row_stride(row_stride_), col_stride(col_stride_),
        offset(causal_offset(L, S)) {}

  __device__ __forceinline__ int64_t row_base(int64_t n, int l) const {
    return base[n] + (int64_t)l * row_stride;
  }
  // For boolean / additive masks; rb = row_base(...).
  __device__ __forceinline__ float term(int64_t rb, int c) const {
    if (kind == kBool) {
      return static_cast<const uint8_t*>(data)[rb + (int64_t)c * col_stride] ? 0.0f : FA_NEG_INF;
    }
    float a = static_cast<const float*>(data)[rb + (int64_t)c * col_stride];
    return a == FA_NEG_INF ? FA_NEG_INF : a * FA_LOG2E;
  }
  __device__ __forceinline__ bool is_array() const { return kind == kBool || kind == kAdditive; }
  // Whether the causal rule (if this mask is causal) or its window hides key c from row r.
  __device__ __forceinline__ bool causal_hides(int r, int c) const {
    return kind == kCausal && fa::causal_hides(r, c, offset, col_stride);
  }
  // The keys row r may see within [begin, end) (0 or a split's start, S or its end).
  __device__ __forceinline__ int key_begin(int r, int begin) const {
    return kind == kCausal && col_stride != kNoWindow ? max(begin, r + offset - col_stride + 1) : begin;
  }
  __device__ __forceinline__ int key_end(int r, int end) const {
    return kind == kCausal ? min(end, r + offset + 1) : end;
  }
  // Rows l0 .. l0 + rows - 1 see keys [kv_begin(l0), kv_end(l0, rows)) at most.
  __device__ __forceinline__ int kv_begin(int l0, int L, int S) const {
    return kind == kCausal ? causal_kv_begin(l0, L, S, col_stride) : 0;
  }
  __device__ __forceinline__ int kv_end(int l0, int rows, int L, int S) const {
    return kind == kCausal ? causal_kv_end(l0, rows, L, S) : S;
  }
  // Keys c0 .. c0 + keys - 1 are seen by rows [row_begin(c0), row_end(c0, keys)) at most.
  __device__ __forceinline__ int row_begin(int c0, int L, int S) const {
    return kind == kCausal ? causal_row_begin(c0, L, S) : 0;
  }
  __device__ __forceinline__ int row_end(int c0, int keys, int L, int S) const {
    return kind == kCausal ? causal_row_end(c0, keys, L, S, col_stride) : L;
  }
  // Whether key c is hidden from row r (of L rows, S keys); rb = row_base(n, r),
  // read only for an array mask and a row and key that exist.
  __device__ __forceinline__ bool hides(int64_t rb, int r, int c, int L, int S) const {
    if (r >= L || c >= S || causal_hides(r, c)) return true;
    return is_array() && term(rb, c) == FA_NEG_INF;
  }
  // Whether some key of the tile [c0, c0 + bc) may be hidden from some row
  // of first .. first + rows - 1 (S keys).
  __device__ __forceinline__ bool tile_hides(int c0, int bc, int first, int rows, int S) const {
    return c0 + bc > S || is_array() || (kind == kCausal && causal_tile_hides(first, rows, c0, bc, offset, col_stride));
  }
};

// The sinks (one float per query head) in the mask's launch arguments
// (mask_bits.h), or nullptr. Read where a row ends, from the arguments
// themselves: a pointer kept in the Mask from the start cost the wgmma
// prefill spills.
__device__ __forceinline__ const float* sinks_of(int mask_kind, const int64_t* mask_base) {
  if (!(mask_kind & kSinks)) return nullptr;
  return reinterpret_cast<const float*>(mask_base + (mask_kind >> kSinkWordsShift));
}

// Query head h's sink logit in the log2 domain; -inf without sinks (then
// add_sink, softmax.cuh, changes nothing).
__device__ __forceinline__ float sink_log2(int mask_kind, const int64_t* mask_base, int h) {
  const float* sinks = sinks_of(mask_kind, mask_base);
  return sinks == nullptr ? FA_NEG_INF : sinks[h] * FA_LOG2E;
}

// The rows' log-sum-exp output where the launch asks for it (kLse), else
// nullptr: the prefill kernels take the pointer from their arguments only
// where a row ends, as the sinks.
__device__ __forceinline__ float* lse_of(int mask_kind, float* lse) { return (mask_kind & kLse) ? lse : nullptr; }

// The same for an input: the backward's statistics passes read the
// forward's log-sum-exp where the launch says it holds it.
__device__ __forceinline__ const float* lse_in(int mask_kind, const float* lse) {
  return (mask_kind & kLse) ? lse : nullptr;
}

}  // namespace fa
