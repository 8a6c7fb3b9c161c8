// Block shapes of the Hopper (wgmma) prefill kernels, in plain C++: the
// kernels build their tiles from them and the planner (dispatch.cpp) its
// launches, so the two cannot disagree on rows, threads or shared memory.

#pragma once

namespace fa::wg_shapes {

constexpr int kRowsPerGroup = 64;  // query rows per warpgroup (wgmma's M)

// prefill_tf32_wg.cu (float32, E = 64): two warpgroups; three key/value tiles
// of 64 keys, each as TF32 high and low parts of K and of V^T; then 64 bytes
// of barriers and flags (two 8-byte barriers and a 4-byte flag per tile).
constexpr int kTf32Groups = 2, kTf32Bc = 64, kTf32E = 64, kTf32Buffers = 3;
constexpr int kTf32Rows = kRowsPerGroup * kTf32Groups, kTf32Threads = 128 * kTf32Groups;
constexpr int kTf32SmemBytes = kTf32Buffers * 4 * kTf32Bc * kTf32E * 4 + 64;

// prefill_f16_wg.cu (float16 / bfloat16, E = 64, 80, 96 or 128): consumer
// warpgroups of 64 query rows each, one producer warpgroup that does every
// copy; Q, three key/value tiles of 128 keys, and two 8-byte barriers per
// tile and two for Q. From H200 probes (scripts/prefill-probe-f16.cu, session
// of this commit), qwen05b causal 8K: 3 consumers + producer with the
// overlap 0.320 ms (without the producer, 3 x 128: 0.361; 2 + 1: 0.378;
// 3 + 1 x 64 keys: 0.381); hd128 causal 4K: 2 + 1 with the overlap 0.338 ms
// (without it 0.343; without the producer, 2 x 128: 0.358, 4 x 64: 0.362;
// 3 + 1 x 64 keys: 0.352). The producer keeps 32 registers (48 with two
// consumers) and gives the rest to the consumers (160 each for three, 224
// for two): with two the overlap fits at E = 128, which four warpgroups of
// 128 registers could not.
// f32: the float32 attention over 16-bit inputs (fa_prefill_wg32_*), whose P
// is 2 or 3 A operands (mma.cuh's PSplit) instead of one: with three
// consumers at E = 64 ptxas spilled 480 bytes (with the overlap) or 56
// (without), with two none; at E = 128 the overlap spilled 204 bytes
// (two row tiles a block) and no overlap none. Each tile's P V then goes
// into a fresh accumulator as well (prefill_f16_wg.cu: accuracy), which
// with the overlap spilled 4.6 KB at bfloat16 E = 64; without it 8 bytes
// (E = 64) and 140 (E = 128) for bfloat16, none for float16.
// narrow: two consumers at E = 64 as well (fa_prefill_wg2_*, row tiles of
// 128), which the planner takes where three leave SMs idle (dispatch.cpp's
// narrow_wins).
// E = 80 and 96 run in the E = 128 kernel's tiles (f16_stored_e): the
// copies leave the columns past E zero (TMA's fill past the tensor's end),
// Q K^T takes E / 16 steps and P V is E columns wide (wgmma's N), reading
// part of V's second 64-column block. The 128-byte swizzle that one layout
// of Q, K and V rests on takes rows of 64 columns, so a narrower stored
// row would need other layouts.
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int f16_stored_e(int E) { return E <= 64 ? 64 : 128; }
constexpr int f16_groups(int E, bool f32 = false, bool narrow = false) {  // consumer warpgroups
  return f32 || narrow || E > 64 ? 2 : 3;
}
// Whether a warpgroup issues each tile's Q K^T with the previous tile's P V
// and runs the softmax while that P V is in flight (prefill_f16_wg.cu).
constexpr bool f16_overlap(int, bool f32 = false) { return !f32; }
// Whether the softmax of tile j really runs while P_{j-1} V_{j-1} is in
// flight. The source asks for it with OVERLAP, but ptxas put the wait for that
// P V at the top of the softmax's basic block (the SASS: wait, then the 64
// exponentials) unless a branch ends the block after the softmax. With the
// branch (H200 probes, this commit's session): qwen05b causal 8K 0.306 ->
// 0.288 ms; hd128 causal 4K 0.291 -> 0.295, so E = 128 keeps the early wait
// (its two consumers' products keep the tensor cores no busier either way;
// with the descriptors in uniform registers, a later session: 0.288 both ways).
constexpr int kF16SoftmaxUnderPvMaxE = 64;  // E up to this
constexpr bool kF16Producer = true;
// The producer copies with the Tensor Memory Accelerator (one thread, one
// instruction a 64-column box) instead of 128 threads' cp.async. H200 probe
// (this commit's session, runs alternating): qwen05b causal 8K 0.282 ->
// 0.278 ms, hd128 causal 4K 0.268 -> 0.266 (with the maps made by the host
// and passed ready: 0.272 and 0.263; made on the device they cost ~1.5 us
// before a block's first copy, once per SM and call).
constexpr bool kF16Tma = true;
constexpr int f16_bc(int) { return 128; }
constexpr int f16_rows(int E, bool f32 = false, bool narrow = false) {
  return kRowsPerGroup * f16_groups(E, f32, narrow);
}
constexpr int f16_threads(int E, bool f32 = false, bool narrow = false) {
  return 128 * (f16_groups(E, f32, narrow) + (kF16Producer ? 1 : 0));
}
constexpr int kF16Buffers = 3;
// Row tiles per block (prefill_f16_wg.cu's ITEMS): 2 lets a block take
// many, when the planner launches one block per SM and the kernel places
// every row tile in a list ordered heaviest first, each block taking every
// P-th in a snake (P blocks): the planner does so when at least
// kF16ScheduleMinTiles row tiles (all slices) keep the GPU busy. Before, a
// block took two row tiles (p and row_tiles - 1 - p; H200 probe, hd128
// causal 4K: 0.303 -> 0.291 ms against one a block). A block timeline of
// that launch (H200, 512 blocks, 4 a SM) showed the SMs busy 96% of the
// time and the last ones idle ~11 us of 280 (512 equal blocks do not fill
// 132 SMs evenly), and ~3K cycles a block before its first product (setup,
// Q's first copy). At E = 64 the three consumers have no registers for
// several tiles (they spill: 0.307 -> 0.394 ms; at 3aa80dc, with the next
// tile in the launch's order as the second one instead of the mirrored one,
// so that blocks keep the heaviest-first order: 0.288 -> 0.347 ms).
constexpr int f16_items(int E) { return E <= 64 ? 1 : 2; }
constexpr long long kF16ScheduleMinTiles = 512;
// With TMA copies (prefill_f16_wg.cu) the blocks make their tensor maps (Q,
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
constexpr int f16_smem_bytes(int E, bool f32 = false, bool narrow = false) {
  return (f16_rows(E, f32, narrow) + 2 * kF16Buffers * f16_bc(E)) * f16_stored_e(E) * 2 + (2 * kF16Buffers + 2) * 8;
}

}  // namespace fa::wg_shapes
