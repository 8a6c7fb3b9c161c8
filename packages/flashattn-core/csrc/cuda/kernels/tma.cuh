// The Tensor Memory Accelerator (sm_90): whole tiles copied global ->
// shared by one thread's instruction, described by a tensor map (the
// driver's 128-byte CUtensorMap: the tensor's address, sizes and strides,
// the box copied, the swizzle). The copy arrives on an mbarrier with its
// byte count (complete_tx), so a "full" barrier expects one arrival and the
// tile's bytes.

#pragma once

#include "mma.cuh"

namespace fa {

// One arrival that also says how many bytes the barrier's phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

// Barrier initialisations made visible to the async proxy (the copies' arrivals).
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// The box at coordinates (c0 innermost, c1, c2, c3) of the 4-d tensor that
// `map` (a tensor map in global memory) describes, into dst; it arrives on bar.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(smem_u32(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// A bulk reduce-add (no tensor map): `bytes` contiguous bytes of float32 at
// src (shared) added element by element into dst (global; both 16-byte
// aligned, bytes a multiple of 16), each element's add atomic, as red.add
// would be. The copy reads src after the issuing thread's bulk_commit;
// bulk_wait_read<N> waits until at most N groups still read their sources.
// Threads that wrote src fence it to the async proxy (fence_proxy_async)
// before the barrier the issuing thread passes.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Tensor maps made on the device: a template from the host
// (cuTensorMapEncodeTiled: rank 4, element type, box, swizzle), passed as 32
// words of kernel arguments, with each tensor's address, sizes, byte strides
// and box rows put in (tensormap.replace), then published to global memory,
// where the copies read them (TMA reads maps from global or parameter memory,
// and MLX's custom-kernel API passes no 128-byte argument; a template in an
// array of MLX's sat in managed memory, which the host's writes to other
// small arrays in its page moved back and forth on every call). N maps at
// once, so that their latencies overlap: map i to global_maps + 128 i,
// staged in shared memory at staging + 128 i (128-aligned). The whole warp
// calls it; lane 0's fields count.
struct MapTemplate {
  uint32_t w[32];
};

struct MapFields {
  const void* address;
  uint32_t dims[4];     // innermost first
  uint64_t strides[3];  // bytes, of dims 1..3: multiples of 16
  uint32_t box_rows;
};

template <int N>
__device__ __forceinline__ void tma_make_maps(unsigned char* global_maps, const MapTemplate& templ,
                                              unsigned char* staging, const MapFields (&f)[N]) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
      for (int c = 0; c < 8; ++c)
        reinterpret_cast<uint4*>(staging + 128 * i)[c] =
            make_uint4(templ.w[4 * c], templ.w[4 * c + 1], templ.w[4 * c + 2], templ.w[4 * c + 3]);
      asm volatile(
          "tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;\n"
          "tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 0, %2;\n"
          "tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 1, %3;\n"
          "tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 2, %4;\n"
          "tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 3, %5;\n"
          "tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 0, %6;\n"
          "tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 1, %7;\n"
          "tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 2, %8;\n"
          "tensormap.replace.tile.box_dim.shared::cta.b1024.b32 [%0], 1, %9;\n" ::"r"(smem_u32(staging + 128 * i)),
          "l"(reinterpret_cast<uint64_t>(f[i].address)), "r"(f[i].dims[0]), "r"(f[i].dims[1]), "r"(f[i].dims[2]),
          "r"(f[i].dims[3]), "l"(f[i].strides[0]), "l"(f[i].strides[1]), "l"(f[i].strides[2]), "r"(f[i].box_rows)
          : "memory");
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile(
        "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%0], [%1], 128;\n" ::"l"(
            reinterpret_cast<uint64_t>(global_maps + 128 * i)),
        "r"(smem_u32(staging + 128 * i))
        : "memory");
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(
                     reinterpret_cast<uint64_t>(global_maps + 128 * i))
                 : "memory");
}

// The maps a block copies with, in its SM's slot of `slots` (scratch that
// MLX hands out uninitialised for each call): the first block of a call on
// an SM makes them (tma_make_maps) and then sets the slot's tag to the
// call's (a number the host never repeats); later blocks there find the tag
// and only fence (made by every block, they delay its first copy). With
// `make` the block makes them without looking (a launch of at
// most one block per SM: reading the tag is a round trip to memory, and a
// second block on an SM would only write the same maps again). Slots
// kSlotBytes apart: N maps, then the tag. The whole warp calls it.
template <int N, int kSlots, int kSlotBytes>
__device__ __forceinline__ unsigned char* tma_call_maps(void* slots, unsigned long long tag, const MapTemplate& templ,
                                                        unsigned char* staging, const MapFields (&f)[N],
                                                        bool make) {
  static_assert(kSlotBytes >= 128 * N + 8, "a slot holds the maps and the tag");
  uint32_t sm_id;
  asm("mov.u32 %0, %%smid;" : "=r"(sm_id));
  // SMs past kSlots share slots: the maps of one call are the same in all.
  auto* maps = static_cast<unsigned char*>(slots) + (sm_id % kSlots) * kSlotBytes;
  auto* slot_tag = reinterpret_cast<unsigned long long*>(maps + 128 * N);
  unsigned long long seen = 0;
  if (!make && (threadIdx.x & 31) == 0) asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(slot_tag) : "memory");
  if (!make && __shfl_sync(0xffffffffu, seen == tag, 0)) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(
                       reinterpret_cast<uint64_t>(maps + 128 * i))
                   : "memory");
  } else {
    tma_make_maps<N>(maps, templ, staging, f);
    if ((threadIdx.x & 31) == 0) asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(slot_tag), "l"(tag) : "memory");
  }
  return maps;
}

}  // namespace fa

// The template as 32 word arguments (MLX passes ints).
#define FA_MAP_TEMPLATE_PARAMS                                                                                   \
  int m0, int m1, int m2, int m3, int m4, int m5, int m6, int m7, int m8, int m9, int m10, int m11, int m12,    \
      int m13, int m14, int m15, int m16, int m17, int m18, int m19, int m20, int m21, int m22, int m23, int m24, \
      int m25, int m26, int m27, int m28, int m29, int m30, int m31
#define FA_MAP_TEMPLATE                                                                                           \
  fa::MapTemplate {                                                                                             \
    {uint32_t(m0), uint32_t(m1), uint32_t(m2), uint32_t(m3), uint32_t(m4), uint32_t(m5), uint32_t(m6),           \
     uint32_t(m7), uint32_t(m8), uint32_t(m9), uint32_t(m10), uint32_t(m11), uint32_t(m12), uint32_t(m13),       \
     uint32_t(m14), uint32_t(m15), uint32_t(m16), uint32_t(m17), uint32_t(m18), uint32_t(m19), uint32_t(m20),    \
     uint32_t(m21), uint32_t(m22), uint32_t(m23), uint32_t(m24), uint32_t(m25), uint32_t(m26), uint32_t(m27),    \
     uint32_t(m28), uint32_t(m29), uint32_t(m30), uint32_t(m31)}                                                 \
  }
