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

#include <type_traits>

#include "mma.cuh"
#include "swizzle.cuh"

namespace fa {

__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_u32(smem) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32);  // base offset 0, no swizzle
}

// The same for the 128-byte swizzled layout (tiles on 1024-byte boundaries:
// base offset 0). K-major: LBO unused, SBO between 8-row groups; MN-major:
// LBO between 64-element column blocks, SBO between 8-row groups along K.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* smem, uint32_t lbo, uint32_t sbo) {
  return wgmma_desc(smem, lbo, sbo) | (1ull << 62);
}

// A descriptor as two halves, moved along by 16-byte units added to the low
// one alone (the start address cannot carry into LBO for shared-memory
// offsets below 256 KiB): one 32-bit add per product instead of a 64-bit one.
struct WgDesc {
  uint32_t lo, hi;
  __device__ explicit WgDesc(uint64_t d) : lo(static_cast<uint32_t>(d)), hi(static_cast<uint32_t>(d >> 32)) {}
  __device__ __forceinline__ uint64_t at(uint32_t units) const {
    return (static_cast<uint64_t>(hi) << 32) | (lo + units);
  }
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of this warpgroup's committed groups are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { wgmma_wait<0>(); }
// Shared-memory writes by ordinary stores, made visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Ties fragment registers to this point of the program: accumulators (float)
// so that the compiler may not move their reads above a wait nor their
// writes below an issue; A operands (uint32_t), which wgmma reads after its
// issue, so that they are kept (not reused) until this point, after the wait.
template <typename T, int N>
__device__ __forceinline__ void fence_fragments(T (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        asm volatile("" : "+f"(d[j][i])::"memory");
      } else {
        asm volatile("" : "+r"(d[j][i])::"memory");
      }
    }
}

// The same for each of M sets of A operands (P's terms).
template <int M, int N>
__device__ __forceinline__ void fence_terms(uint32_t (&d)[M][N][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m) fence_fragments(d[m]);
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

#define FA_D32 FA_D8(0), FA_D8(1), FA_D8(2), FA_D8(3)
#define FA_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// The TF32 products by the accumulator's width (N = 8 x its first extent:
// 64, or 32 for prefill_tf32_wg.cu's key tiles of 32 at E = 128).
__device__ __forceinline__ void wgmma_tf32_ss(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
  wgmma_64x64x8_ss(d, a, b, accumulate);
}
__device__ __forceinline__ void wgmma_tf32_ss(float (&d)[4][4], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 " FA_R16 ", %16, %17, p, 1, 1;\n}\n"
      : FA_D32
      : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b,
                                              int accumulate = 1) {
  wgmma_64x64x8_rs(d, a, b, accumulate);
}

__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[4][4], const uint32_t (&a)[4], uint64_t b,
                                              int accumulate = 1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 " FA_R16
      ", {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : FA_D32
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

#undef FA_D8
#undef FA_D32
#undef FA_D64
#undef FA_R16
#undef FA_R32

// 16-bit operands (float16 / bfloat16: K = 16 per instruction), N = 64 or
// 128 columns (P V also 80 and 96: the head dim of prefill_f16_wg.cu's
// E = 80 / 96, whose V rows are stored 128 wide; its second 64-column block
// is read in part; the shared-memory product also 32: the backward's row
// tiles at E = 128). Shared-memory operands K-major unless transposed (tnspB = 1:
// B stored MN-major, N contiguous, as V's rows are); the register A operand
// matches mma.sync m16n8k16's: a0 = (g, 2t..2t + 1), a1 = (g + 8, 2t..),
// a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..), two elements per register.
#define FA_D8(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define FA_D32 FA_D8(0), FA_D8(1), FA_D8(2), FA_D8(3)
#define FA_D64 FA_D32, FA_D8(4), FA_D8(5), FA_D8(6), FA_D8(7)
#define FA_D128 FA_D64, FA_D8(8), FA_D8(9), FA_D8(10), FA_D8(11), FA_D8(12), FA_D8(13), FA_D8(14), FA_D8(15)
#define FA_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FA_R32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FA_R64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FA_D80 FA_D64, FA_D8(8), FA_D8(9)
#define FA_D96 FA_D80, FA_D8(10), FA_D8(11)
#define FA_R40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define FA_R48 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define FA_WG16(n, ty, tail) "wgmma.mma_async.sync.aligned.m64n" #n "k16.f32." #ty "." #ty " " tail

// d (64 x N) = a (64 x 16, shared, K-major) * b (16 x N, shared, K-major) + (accumulate ? d : 0).
template <typename T, int N>
__device__ __forceinline__ void wgmma16_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate);
// d (64 x N) += a (64 x 16, registers) * b (16 x N, shared, MN-major).
template <typename T, int N>
__device__ __forceinline__ void wgmma16_rs_t(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b);

#define FA_WG16_DEFS(T, ty)                                                                              \
  template <>                                                                                            \
  __device__ __forceinline__ void wgmma16_ss<T, 32>(float (&d)[4][4], uint64_t a, uint64_t b,            \
                                                    int accumulate) {                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" FA_WG16(32, ty, FA_R16 ", %16, %17, p, 1, 1, 0, 0;\n}\n") \
                 : FA_D32                                                                                \
                 : "l"(a), "l"(b), "r"(accumulate));                                                     \
  }                                                                                                      \
  template <>                                                                                            \
  __device__ __forceinline__ void wgmma16_ss<T, 64>(float (&d)[8][4], uint64_t a, uint64_t b,            \
                                                    int accumulate) {                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" FA_WG16(64, ty, FA_R32 ", %32, %33, p, 1, 1, 0, 0;\n}\n") \
                 : FA_D64                                                                                \
                 : "l"(a), "l"(b), "r"(accumulate));                                                     \
  }                                                                                                      \
  template <>                                                                                            \
  __device__ __forceinline__ void wgmma16_ss<T, 128>(float (&d)[16][4], uint64_t a, uint64_t b,          \
                                                     int accumulate) {                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" FA_WG16(128, ty, FA_R64 ", %64, %65, p, 1, 1, 0, 0;\n}\n") \
                 : FA_D128                                                                               \
                 : "l"(a), "l"(b), "r"(accumulate));                                                     \
  }                                                                                                      \
  template <>                                                                                            \
  __device__ __forceinline__ void wgmma16_rs_t<T, 64>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                          \
                 FA_WG16(64, ty, FA_R32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n")                \
                 : FA_D64                                                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));                         \
  }                                                                                                      \
  template <>                                                                                            \
  __device__ __forceinline__ void wgmma16_rs_t<T, 128>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                          \
                 FA_WG16(128, ty, FA_R64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n")               \
                 : FA_D128                                                                               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));                         \
  }                                                                                                      \
  template <>                                                                                            \
  __device__ __forceinline__ void wgmma16_rs_t<T, 80>(float (&d)[10][4], const uint32_t (&a)[4], uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"                                          \
                 FA_WG16(80, ty, FA_R40 ", {%40, %41, %42, %43}, %44, p, 1, 1, 1;\n}\n")               \
                 : FA_D80                                                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));                         \
  }                                                                                                      \
  template <>                                                                                            \
  __device__ __forceinline__ void wgmma16_rs_t<T, 96>(float (&d)[12][4], const uint32_t (&a)[4], uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"                                          \
                 FA_WG16(96, ty, FA_R48 ", {%48, %49, %50, %51}, %52, p, 1, 1, 1;\n}\n")               \
                 : FA_D96                                                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));                         \
  }

FA_WG16_DEFS(__half, f16)
FA_WG16_DEFS(__nv_bfloat16, bf16)

#undef FA_WG16_DEFS
#undef FA_WG16
#undef FA_D8
#undef FA_D32
#undef FA_D64
#undef FA_D128
#undef FA_D80
#undef FA_D96
#undef FA_R16
#undef FA_R32
#undef FA_R40
#undef FA_R48
#undef FA_R64

}  // namespace fa
