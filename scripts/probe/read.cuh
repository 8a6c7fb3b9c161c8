// A plain read of a buffer by every block of a launch, for the decode
// probes' floors (scripts/decode-floor.cu, few-sm-read-probe.cu).

#pragma once

#include <cstdint>

#include "harness.cuh"

// Block b reads its share of n16 16-byte words, U loads in flight a thread.
template <int U>
__global__ void read_kernel(const uint4* __restrict__ src, size_t n16, uint32_t* sink) {
#ifdef FA_MARK
  FA_MARK(0);
#endif
  const size_t per = (n16 + gridDim.x - 1) / gridDim.x;
  const size_t begin = blockIdx.x * per, end = min(n16, begin + per);
  uint32_t acc = 0;
  for (size_t i = begin + threadIdx.x; i < end; i += size_t(blockDim.x) * U) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t j = i + size_t(u) * blockDim.x;
      r[u] = j < end ? __ldcg(src + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
#ifdef FA_MARK
  __syncthreads();
  FA_MARK(1);
#endif
}

namespace probe {

// `bytes` (a multiple of 16) from global src into shared dst by one 1-d bulk
// copy, arriving on the mbarrier bar with its byte count (complete_tx).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(bytes), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
}

// A floor probe's start: the GPU named, repetitions from argv[1] (default
// 30), the SM count, and a word the kernels' never-taken stores go to.
struct FloorStart {
  int reps, sms;
  uint32_t* sink;
};
inline FloorStart floor_start(int argc, char** argv) {
  print_gpu();
  FloorStart f{argc > 1 ? std::atoi(argv[1]) : 30, 0, nullptr};
  CHECK(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaMalloc(&f.sink, 4));
  return f;
}

}  // namespace probe
