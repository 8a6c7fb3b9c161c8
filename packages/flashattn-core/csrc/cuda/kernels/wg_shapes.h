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

// prefill_f16_wg.cu (float16 / bfloat16, E = 64 or 128): Q, three key/value
// tiles, and two 8-byte barriers per tile. Warpgroups per block and keys per
// tile from H200 probes (scripts/prefill-probe-f16.cu) of 2-4 groups and
// 64 or 128 keys, last with the swizzled layout and light copies (commit
// d70191e): qwen05b causal 8K best at 3 x 128 with the overlap (0.361 ms;
// without 0.375; 4 x 64: 0.374; 2 x 128: 0.402), hd128 causal 4K at 4 x 64
// (0.364 ms; 2 x 128: 0.364, with the overlap 0.361; 3 x 64: 0.402; 3 x 128
// does not fit shared memory). More warpgroups, more of one's softmax
// overlaps the others' products; four hold at most 128 registers.
constexpr int f16_groups(int E) { return E <= 64 ? 3 : 4; }
// Whether a warpgroup issues each tile's Q K^T with the previous tile's P V
// and runs the softmax while that P V is in flight (prefill_f16_wg.cu): at
// E = 64, 3 x 128, 0.361 against 0.375 ms; at E = 128 it would spill (four
// warpgroups hold at most 128 registers) and 4 x 64 without it is fastest.
constexpr bool f16_overlap(int E) { return E <= 64; }
constexpr int f16_bc(int E) { return E <= 64 ? 128 : 64; }
constexpr int f16_rows(int E) { return kRowsPerGroup * f16_groups(E); }
constexpr int f16_threads(int E) { return 128 * f16_groups(E); }
constexpr int kF16Buffers = 3;
constexpr int f16_smem_bytes(int E) {
  return (f16_rows(E) + 2 * kF16Buffers * f16_bc(E)) * E * 2 + 2 * kF16Buffers * 8;
}

}  // namespace fa::wg_shapes
