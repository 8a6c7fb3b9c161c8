// Synchronisation for warpgroups that run skewed (sm_90): shared-memory
// barriers (mbarrier) for the data, named barriers for the turns.
//
// A block-wide barrier per key/value tile keeps every warpgroup in step, so
// all of them run their softmax at once while the tensor cores idle.
// FlashAttention-3's ping-pong lets them drift apart instead: each tile's
// buffer has a "full" barrier (every thread has stored its part) and an
// "empty" one (every thread is done reading it), and the warpgroups take
// turns to issue their products, so one's softmax runs during another's
// products.

#pragma once

#include "mma.cuh"

namespace fa {

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// This thread's arrival (release: its earlier shared-memory writes are seen
// by threads that wait for the phase).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_u32(bar))
               : "memory");
}

// Waits until the barrier's phase of this parity (0, 1, 0, ... for its
// first, second, third ... completion) has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) among `threads` threads:
// sync waits for them all, arrive counts this thread and goes on.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace fa
