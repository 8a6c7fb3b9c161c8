// Block shapes of the Hopper (wgmma) prefill kernels, in plain C++: the
// kernels build their tiles from them and the planner (plan_prefill.cpp) its
// launches, so the two cannot disagree on rows, threads or shared memory.

#pragma once

namespace fa::wg_shapes {

constexpr int kRowsPerGroup = 64;  // query rows per warpgroup (wgmma's M)

// prefill_tf32_wg.cu (float32, E = 64 or 128): two warpgroups of 64 query
// rows; key/value tiles, each as TF32 high and low parts of K and of V^T;
// then each tile's barriers and flag (two 8-byte barriers and a 4-byte flag).
// E = 64: three tiles of 64 keys, Q's parts in registers. E = 128: Q's
// high and low parts, o and P V's accumulator would take about 300
// registers a thread, so Q's low part is in shared memory (the A operand
// of one of S's three products), which leaves room for two tiles of 32 keys.
// (The kernel calls these too.)
#if defined(__CUDACC__)
#define FA_WG_HD __host__ __device__
#else
#define FA_WG_HD
#endif
constexpr int kTf32Groups = 2;
constexpr int kTf32Rows = kRowsPerGroup * kTf32Groups, kTf32Threads = 128 * kTf32Groups;
FA_WG_HD constexpr bool tf32_has(int E) { return E == 64 || E == 128; }
FA_WG_HD constexpr int tf32_bc(int E) { return E > 64 ? 32 : 64; }  // keys a tile
FA_WG_HD constexpr int tf32_buffers(int E) { return E > 64 ? 2 : 3; }
FA_WG_HD constexpr bool tf32_q_lo_shared(int E) { return E > 64; }
FA_WG_HD constexpr int tf32_q_lo_bytes(int E) { return tf32_q_lo_shared(E) ? kTf32Rows * E * 4 : 0; }
FA_WG_HD constexpr int tf32_smem_bytes(int E) {
  return tf32_q_lo_bytes(E) + tf32_buffers(E) * 4 * tf32_bc(E) * E * 4 + (tf32_buffers(E) * 20 + 7) / 8 * 8;
}
#undef FA_WG_HD
// The quantized variant (fa_prefill_wgq_) exists at E = 64 only.
constexpr int kTf32E = 64, kTf32SmemBytes = tf32_smem_bytes(kTf32E);

// prefill_f16_wg.cu (float16 / bfloat16, E = 64, 80, 96 or 128): consumer
// warpgroups of 64 query rows each, one producer warpgroup that does every
// copy; Q, three key/value tiles of 128 keys, and two 8-byte barriers per
// tile and two for Q. Three consumers at E = 64 and two at E = 128, each
// with the producer and the overlap, were the fastest of the shapes measured
// on an H200 (benchmarks/cuda-probes/prefill-probe-f16.cu). The producer
// keeps 24 registers (one thread copies, with TMA) and gives the rest to the
// consumers: with two the overlap fits at E = 128, which four warpgroups of
// 128 registers could not.
// f32: the float32 attention over 16-bit inputs (fa_prefill_wg32_*), whose P
// is two A operands (mma.cuh's PSplit) instead of one and whose every tile's
// P V goes into a fresh accumulator (prefill_f16_wg.cu: accuracy). At E = 64
// three consumers without the overlap: each consumer's chain (Q K^T's wait,
// the softmax, P's split) bounds the step, not the products, so a third
// warp a scheduler pays more than the overlap (which three have no
// registers for): a key tile 0.93x the cycles a row of two consumers with
// it, `qwen05b` chunk 2K of 16K 0.90-0.92x the time with the launch model's
// key splits (H100, prefill-timeline.cu; docs/cuda.md). At E = 128 two, the
// overlap off (it spilled ~14 KB).
// narrow: two consumers at E = 64 as well (fa_prefill_wg2_*, row tiles of
// 128), which the planner takes where three leave SMs idle (plan_prefill.cpp,
// wg_launch.cpp's launch model).
// E = 80 and 96 run in the E = 128 kernel's tiles (f16_stored_e): the
// copies leave the columns past E zero (TMA's fill past the tensor's end),
// Q K^T takes E / 16 steps and P V is E columns wide (wgmma's N), reading
// part of V's second 64-column block. The 128-byte swizzle that one layout
// of Q, K and V rests on takes rows of 64 columns, so a narrower stored
// row would need other layouts.
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int f16_stored_e(int E, bool tt = false) { return tt ? E : E <= 64 ? 64 : 128; }
// The queries' stored columns: the two-term units (prefill_f16_wg.cu's
// kTT: keys and values [hi | lo], E twice the head dim) keep them once.
constexpr int f16_stored_q(int E, bool tt = false) { return tt ? E / 2 : f16_stored_e(E); }
// The widened units (f32 above) take the 16-bit ones' count.
constexpr int f16_groups(int E, bool narrow = false) {  // consumer warpgroups
  return narrow || E > 64 ? 2 : 3;
}
// Whether a warpgroup issues each tile's Q K^T with the previous tile's P V
// and runs the softmax while that P V is in flight (prefill_f16_wg.cu).
// f32: only the two-term units (tt), whose output (and P V) is E / 2 wide,
// with two consumers at E = 128: 0.4-2.6% less time though ptxas spills 224
// bytes (H100, against the same unit without it).
constexpr bool f16_overlap(int E, bool f32 = false, bool bf16 = false, bool tt = false) {
  return !f32 || (tt && bf16 && E / 2 <= 64);
}
// f32 over bfloat16: P's terms (mma.cuh's PSplit).
constexpr int kF32Bf16Terms = 2;
// Whether the softmax of tile j really runs while P_{j-1} V_{j-1} is in
// flight. The source asks for it with OVERLAP, but ptxas put the wait for that
// P V at the top of the softmax's basic block (the SASS: wait, then the 64
// exponentials) unless a branch ends the block after the softmax. The branch
// pays at E = 64 (docs/cuda.md) and gained nothing at E = 128 (its two
// consumers' products keep the tensor cores as busy either way), which
// keeps the early wait.
constexpr int kF16SoftmaxUnderPvMaxE = 64;  // E up to this
// Keys a tile: 64 for the two-term units at E = 256, whose three buffers of
// 128-key tiles would not fit an SM's shared memory.
constexpr int f16_bc(int E, bool tt = false) { return tt && E > 128 ? 64 : 128; }
constexpr int f16_rows(int E, bool narrow = false) {
  return kRowsPerGroup * f16_groups(E, narrow);
}
// The consumers and the producer warpgroup, which copies every tile with the
// Tensor Memory Accelerator (tma.cuh).
constexpr int f16_threads(int E, bool narrow = false) {
  return 128 * (f16_groups(E, narrow) + 1);
}
constexpr int kF16Buffers = 3;
// Row tiles per block (prefill_f16_wg.cu's ITEMS): 2 lets a block take
// many, when the planner launches one block per SM and the kernel places
// every row tile in a list ordered heaviest first, each block taking every
// P-th in a snake (P blocks): the planner does so when at least
// kF16ScheduleMinTiles row tiles (all slices) keep the GPU busy: the
// producer loads a row tile while the consumers finish the one before, and
// the snake evens out the blocks' work. At E = 64 the three consumers have
// no registers for several tiles (they spill, and ran slower), so a block
// there takes one row tile.
constexpr int f16_items(int E) { return E <= 64 ? 1 : 2; }
constexpr long long kF16ScheduleMinTiles = 512;
// The blocks' TMA copies (prefill_f16_wg.cu) take tensor maps (Q,
// K, V: 128 bytes each) once per SM and call, in the SM's slot of scratch
// memory (the maps, then an 8-byte tag); GPUs with more SMs share slots.
constexpr int kMapSlots = 256, kMapSlotBytes = 512;
// Key splits of a launch's last row tiles (key_split.cuh), in the scratch
// past the maps' slots: a ticket word per split row tile (rounded up to 256
// bytes), then each piece's state: o, m and l of every consumer thread
// (E / 8 x 4 + 4 floats each).
// (The kernels also call it at run time.)
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr long long split_ticket_bytes(long long tail) { return (tail * 8 + 255) / 256 * 256; }
// A split row tile's `tiles` key tiles, cut in `splits` pieces: the first of
// piece `piece` (it ends where the next begins; no piece is empty while
// tiles >= splits, which the planner keeps).
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int piece_first_tile(int tiles, int piece, int splits) { return tiles * piece / splits; }
constexpr long long split_state_floats(int E, int groups) { return (E / 8 * 4 + 4) * 128LL * groups; }
constexpr long long split_scratch_bytes(long long tail, int splits, int E, int groups) {
  return split_ticket_bytes(tail) + tail * splits * split_state_floats(E, groups) * 4;
}
constexpr int f16_smem_bytes(int E, bool narrow = false, bool tt = false) {
  return (f16_rows(E, narrow) * f16_stored_q(E, tt) + 2 * kF16Buffers * f16_bc(E, tt) * f16_stored_e(E, tt)) * 2 +
         (2 * kF16Buffers + 2) * 8;
}

// The split-query float32 prefill (prefill_f32s_wg.cu) at head dim 64:
// the two-term float16 unit at E = 128 with its queries 128 wide too, two
// consumers, no overlap (with it ptxas serialised the wgmma: registers).
constexpr int kF32sE = 64, kF32sStoredE = 2 * kF32sE;
// f32_split.cu: a shift a tile of this many rows, a block of this many
// threads a tile (dispatch.cpp launches it).
constexpr int kF32sSplitRows = 128, kF32sSplitThreads = 256;
constexpr int f32s_smem_bytes() {
  return (f16_rows(kF32sStoredE) * kF32sStoredE + 2 * kF16Buffers * f16_bc(kF32sStoredE, true) * kF32sStoredE) * 2 +
         (2 * kF16Buffers + 2) * 8;
}

}  // namespace fa::wg_shapes
