// The emulator's runtime as the kernel side (msl.h) sees it: one call per
// synchronising Metal operation. A lane (one Metal thread) runs as a fiber;
// every call below suspends it until the lanes it must meet have arrived.
//
// Compiled without msl.h's address-space macros, so plain C++ only.

#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fa_emu {

// Operations the 32 lanes of a SIMD group perform together.
enum class Op : int {
  simd_barrier,
  simd_sum,
  simd_max,
  simd_min,
  simd_shuffle,
  simd_sum_int,
  simd_max_int,
  matrix_multiply_accumulate,
};

// What one lane brings to a SIMD-group operation, and what it takes away.
struct Collective {
  Op op;
  const void* site;  // call site: lanes of one group must be at the same one
  float f = 0.0f;    // operand
  long long i = 0;   // integer operand
  int arg = 0;       // simd_shuffle: the lane read
  float f_out = 0.0f;
  long long i_out = 0;
  // matrix_multiply_accumulate: this lane's two elements of D, A, B, C.
  float* d = nullptr;
  const float* a = nullptr;
  const float* b = nullptr;
  const float* c = nullptr;
};

// Suspends the calling lane until every lane of its SIMD group has reached an
// operation; they must all be at the same one (same op, same call site).
void simd_collective(Collective& c);

// Suspends the calling lane until every lane of its threadgroup has arrived.
void threadgroup_barrier();

// Records a threadgroup array (once per threadgroup and lane; repeats are
// ignored): its bytes count towards the 32 KiB limit and are poisoned (all
// bits set: NaN for floats) at the start of every threadgroup.
void register_threadgroup_memory(void* p, size_t bytes);

// The calling lane's index within its SIMD group.
int lane_in_simdgroup();

// Where this lane's two elements of an 8 x 8 simdgroup_matrix sit: row
// frag_row, columns frag_col and frag_col + 1 (the layout MLX's steel
// kernels assume). Each lane holds only its own two.
inline int frag_row(int lane) {
  return ((lane / 4) & 4) + ((lane / 2) % 4);
}
inline int frag_col(int lane) {
  return ((lane / 4) & 2) * 2 + (lane % 2) * 2;
}

// Aborts the current launch with this message (the launch returns it).
[[noreturn]] void fail(const char* message);

// The thread-position values MSL passes as kernel arguments ([[...]]).
struct LaneIds {
  unsigned thread_position_in_grid[3];
  unsigned thread_position_in_threadgroup[3];
  unsigned threadgroup_position_in_grid[3];
  unsigned threads_per_threadgroup[3];
  unsigned dispatch_threads_per_threadgroup[3];
  unsigned threadgroups_per_grid[3];
  unsigned threads_per_grid[3];
  unsigned thread_index_in_threadgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned threads_per_simdgroup;
  unsigned simdgroups_per_threadgroup;
};

// One lane of a kernel: its buffers and its position.
using LaneFn = void (*)(void* const* buffers, const LaneIds& ids);

// The order in which lanes run between synchronisation points. On hardware
// lanes race; running them forward, backward or shuffled makes a missing
// barrier show up as a read of data not yet (or no longer) there.
enum class LaneOrder : int { forward = 0, reverse = 1, shuffled = 2 };

// Runs fn over a grid of threads (dispatchThreads semantics: edge
// threadgroups may be partial) in threadgroups of `threadgroup` threads,
// threadgroups spread over the machine's cores. Returns "" on success, else
// what went wrong (divergent SIMD operations, a deadlock, a limit exceeded).
std::string launch(
    LaneFn fn,
    void* const* buffers,
    const unsigned grid[3],
    const unsigned threadgroup[3],
    LaneOrder order,
    unsigned long long seed);

}  // namespace fa_emu
