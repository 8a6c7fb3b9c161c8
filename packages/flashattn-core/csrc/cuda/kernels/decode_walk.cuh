// How a warp of a tensor-core decode block (decode_mma.cu, decode_tf32.cu)
// walks its split's keys: in passes of the block's W warps x U chunks of KC
// keys (warp w takes chunk u of a pass at base + (u W + w) KC), the K and V
// rows of chunks to come asked into L2 ahead of their loads. With one chunk
// a warp at a time (U = 1) the first kAhead + 1 passes are asked for at the
// start and each pass asks for the one kAhead + 1 ahead; with several (all
// of a pass's loads issued at once), each pass asks for the next when
// kNextPass (decode_shapes.h says where that pays).

#pragma once

#include "common.cuh"

namespace fa {

template <typename T, int E, int W, int U, int KC, int kAhead, bool kNextPass = true>
struct ChunkWalk {
  static constexpr int PASS = W * U * KC;  // keys a pass of the block covers
  const T* k_head;
  const T* v_head;
  int64_t ks, vs;  // row strides of K and V
  int c_begin, c_end, w, lane;

  // The first key of this warp's chunk u of the pass from `base`.
  __device__ __forceinline__ int chunk_at(int base, int u) const { return base + (u * W + w) * KC; }

  // K and V rows [c0, c0 + KC) of the split into L2, a lane a row.
  __device__ __forceinline__ void prefetch_chunk(int c0) const {
    for (int r = lane; r < KC; r += 32) {
      if (c0 + r < c_end) {
        const char* k_row = reinterpret_cast<const char*>(k_head + (c0 + r) * ks);
        const char* v_row = reinterpret_cast<const char*>(v_head + (c0 + r) * vs);
#pragma unroll
        for (int by = 0; by < E * (int)sizeof(T); by += 128) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(k_row + by));
          asm volatile("prefetch.global.L2 [%0];" ::"l"(v_row + by));
        }
      }
    }
  }

  // Before the first pass.
  __device__ __forceinline__ void prefetch_start() const {
    if constexpr (U == 1) {
#pragma unroll
      for (int a = 0; a <= kAhead; ++a) prefetch_chunk(chunk_at(c_begin + a * PASS, 0));
    }
  }

  // At the start of the pass from `base`.
  __device__ __forceinline__ void prefetch_ahead(int base) const {
    if constexpr (U == 1) {
      prefetch_chunk(chunk_at(base, 0) + (kAhead + 1) * PASS);
    } else if constexpr (kNextPass) {
#pragma unroll
      for (int u = 0; u < U; ++u) prefetch_chunk(chunk_at(base + PASS, u));
    }
  }
};

}  // namespace fa
