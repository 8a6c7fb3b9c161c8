// Where the tensor-core decodes (decode_mma.cu, decode_tf32.cu) read one KV
// head's key or value rows from: plain rows of the attention's dtype, or
// MLX's affine-quantized rows read in place (packed codes, a scale and a
// bias per group of elements), expanded in registers. A warp loads all of
// a pass's raw fragments first and expands each just before its product,
// so the loads are in flight together and a quantized fragment holds its
// codes (fewer registers than the 16 bytes it expands to) until then.

#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace fa {

// 16 bytes at p, or zeros when !valid; kFetch256: a miss brings the 256
// bytes around p into L2 (the rows the next fragment loads read).
template <bool kFetch256 = false>
__device__ __forceinline__ uint4 load16(const void* p, bool valid) {
  if constexpr (!kFetch256) {
    return valid ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
  } else {
    uint4 r = make_uint4(0, 0, 0, 0);
    if (valid) {
      asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
          : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
          : "l"(p));
    }
    return r;
  }
}

// 4 bytes at p (read-only for the kernel's life), with decode_mma's L2 hint.
template <bool kFetch256 = false>
__device__ __forceinline__ uint32_t load_word(const uint32_t* p) {
  uint32_t r;
  if constexpr (kFetch256) {
    asm("ld.global.nc.L2::256B.u32 %0, [%1];" : "=r"(r) : "l"(p));
  } else {
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  }
  return r;
}

// 8 elements of 16-bit T from any 2-byte boundary (the quantized decode's
// queries: read once a block, so no alignment is asked of them).
template <typename T>
__device__ __forceinline__ uint4 load8_any(const T* p, bool valid) {
  uint32_t w[4] = {0, 0, 0, 0};
  if (valid) {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = uint32_t(s[2 * i]) | uint32_t(s[2 * i + 1]) << 16;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 8 query elements: 16 aligned bytes, or (kAligned false) from anywhere.
template <bool kAligned, typename T>
__device__ __forceinline__ uint4 load_query(const T* p, bool valid) {
  if constexpr (kAligned) {
    return load16(p, valid);
  } else {
    return load8_any(p, valid);
  }
}

// Plain rows of 16-bit T: a fragment is the 16 bytes of 8 elements.
template <typename T, bool kFetch256>
struct PlainRows16 {
  using Raw = uint4;
  static constexpr bool kPrefetch = true, kAlignedQueries = true;
  const T* head;  // row 0 of this KV head
  int sr;         // row stride, in elements (the launch argument)
  __device__ __forceinline__ const T* prefetch_head() const { return head; }
  __device__ __forceinline__ int64_t prefetch_stride() const { return sr; }
  // Dims [d0 + d1, +8) of row `key` (d0 a constant of the unrolled loops:
  // added to the pointer apart, it folds into the load's offset).
  __device__ __forceinline__ Raw load(int key, int d0, int d1, bool valid) const {
    return load16<kFetch256>(head + key * static_cast<int64_t>(sr) + d0 + d1, valid);
  }
  __device__ __forceinline__ uint4 expand(const Raw& r) const { return r; }
};

// The head's rows in MLX's affine format (bits 4 or 8): element e of row r
// is scale * code + bias, the code at bits (e mod 32 / bits) * bits of word
// e * bits / 32 of the row, scale and bias those of group e / group_size
// (32, 64 or 128: 8 elements at a multiple of 8 lie in one group).
// Expanded to T as the 16-bit kernel's fragments: value = fma(code, scale,
// bias) in float32, rounded once.
template <typename T, bool kFetch256>
struct QuantRows16 {
  struct Raw {
    uint32_t w0, w1;  // 8 codes: one word at 4 bits, two at 8
    float scale, bias;
  };
  // No L2 prefetch of the rows ahead (ChunkWalk asks for rows of T), and
  // queries read without alignment (load8_any).
  static constexpr bool kPrefetch = false, kAlignedQueries = false;
  const uint32_t* packed;  // row 0 of this KV head
  const T* scales;
  const T* biases;
  int psr, ssr;            // row strides: words, groups (launch arguments)
  int bits, group_shift;
  __device__ __forceinline__ const T* prefetch_head() const { return nullptr; }
  __device__ __forceinline__ int64_t prefetch_stride() const { return 0; }

  __device__ __forceinline__ Raw load(int key, int d0, int d1, bool valid) const {
    const int dim = d0 + d1;
    Raw r{0u, 0u, 0.0f, 0.0f};
    if (valid) {
      const uint32_t* p = packed + key * static_cast<int64_t>(psr) + ((dim * bits) >> 5);
      r.w0 = load_word<kFetch256>(p);
      if (bits == 8) r.w1 = load_word<kFetch256>(p + 1);
      const int64_t gi = key * static_cast<int64_t>(ssr) + (dim >> group_shift);
      r.scale = to_f(scales[gi]);
      r.bias = to_f(biases[gi]);
    }
    return r;
  }

  __device__ __forceinline__ uint4 expand(const Raw& r) const {
    float x[8];
    if (bits == 4) {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = static_cast<float>((r.w0 >> (4 * i)) & 15u);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[i] = static_cast<float>((r.w0 >> (8 * i)) & 255u);
        x[i + 4] = static_cast<float>((r.w1 >> (8 * i)) & 255u);
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = fmaf(x[i], r.scale, r.bias);
    return make_uint4(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]), pack2<T>(x[4], x[5]), pack2<T>(x[6], x[7]));
  }
};

}  // namespace fa
