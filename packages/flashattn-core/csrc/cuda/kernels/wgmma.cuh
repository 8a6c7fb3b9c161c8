// Hopper warpgroup matrix products (wgmma, sm_90a only): the 128 threads of
// a warpgroup issue one asynchronous 64 x N x 8 TF32 product together.
//
// Operands in shared memory are K-major and unswizzled: "core matrices" of
// 8 rows x 16 bytes (4 TF32 values), each stored as 128 contiguous bytes,
// addressed by a descriptor: start address, the byte offset between core
// matrices adjacent along K (LBO) and along M / N (SBO).
//
// Register fragments (per warp w of the group: rows 16 w .. 16 w + 15,
// g = lane / 4, t = lane % 4) match mma.sync's m16n8k8 ones, so mma.cuh's
// softmax step and P conversion serve both:
//   D (64 x N, f32): d[j][0..1] = row g, columns 8 j + 2 t, + 1;
//                    d[j][2..3] = row g + 8, the same columns.
//   A (64 x 8, TF32): a0 = (g, t), a1 = (g + 8, t), a2 = (g, t + 4), a3 = (g + 8, t + 4).

#pragma once

#include "mma.cuh"

namespace fa {

__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_u32(smem) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32);  // base offset 0, no swizzle
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Shared-memory writes by ordinary stores, made visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Ties accumulator registers to this point of the program: the compiler may
// not move their reads above a wait, nor their writes below an issue.
template <int N>
__device__ __forceinline__ void fence_fragments(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
}

#define FA_D8(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define FA_D64 FA_D8(0), FA_D8(1), FA_D8(2), FA_D8(3), FA_D8(4), FA_D8(5), FA_D8(6), FA_D8(7)
#define FA_R32                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64) = a (64 x 8, shared) * b (8 x 64, shared) + (accumulate ? d : 0).
__device__ __forceinline__ void wgmma_64x64x8_ss(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " FA_R32 ", %32, %33, p, 1, 1;\n}\n"
      : FA_D64
      : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x 64) = a (64 x 8, registers) * b (8 x 64, shared) + (accumulate ? d : 0).
__device__ __forceinline__ void wgmma_64x64x8_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b,
                                                 int accumulate = 1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " FA_R32
      ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : FA_D64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

#undef FA_D8
#undef FA_D64
#undef FA_R32

}  // namespace fa
