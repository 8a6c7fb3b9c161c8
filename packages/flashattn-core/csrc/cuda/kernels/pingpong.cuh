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

// Whether pred holds for any of the `threads` threads at named barrier `id`
// (__syncthreads_or for part of a block).
__device__ __forceinline__ bool named_or(int id, int threads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, %3, p;\nselp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}

// A warpgroup's register budget from here on (sm_90a): a producer gives
// registers back, the consumers take them (every warp of the warpgroup
// executes it).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Turns of G warpgroups to issue their Q K^T: warpgroup w waits on named
// barrier 1 + w, then opens the next one's (128 threads wait, the other 128
// of the barrier's 256 arrive). The last opens the first's before the loop
// over `tiles` tiles, and not after its last tile, so that every arrival is
// waited for.
struct Turns {
  int mine, next;
  bool last;

  __device__ Turns(int wg, int groups, int tiles)
      : mine(1 + wg), next(1 + (wg + 1) % groups), last(wg == groups - 1) {
    if (last && tiles > 0) named_arrive(next, 256);
  }
  __device__ void wait() const { named_sync(mine, 256); }
  // After tile j's products are issued.
  __device__ void pass(int j, int tiles) const {
    if (!last || j + 1 < tiles) named_arrive(next, 256);
  }
};

}  // namespace fa
