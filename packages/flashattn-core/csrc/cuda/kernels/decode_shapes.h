// Block shape of the tensor-core decodes (decode_mma.cu, decode_tf32.cu), in plain C++: the
// kernel builds its blocks from it and the planner (plan_decode.cpp) its
// launches, so the two cannot disagree on threads.
//
// E = 64: 8 warps, each loading two chunks of 32 keys before computing them
// (64 KB of K and V in flight a block: a split of 512 keys, qwen05b's at
// S = 32768, asked for at once). E = 128: 4 warps (a warp's o takes 64
// registers; 8 warps' o would not fit the 48 KB of static shared memory the
// combine uses), each with two chunks of 16 keys in flight (254-255 registers,
// no spills: two blocks fit an SM). Two chunks in flight, the 256-byte L2
// fetch at E = 64, and at E = 128 no L2 prefetch and two blocks an SM each
// measured faster on an H200, K and V read from memory (docs/cuda.md).

#pragma once

namespace fa::decode_shapes {

constexpr int mma_warps(int E) { return E == 64 ? 8 : 4; }
constexpr int mma_chunks_in_flight(int) { return 2; }
// Whether each pass asks the next pass's K and V into L2 (decode_walk.cuh).
constexpr bool mma_prefetch_next_pass(int E) { return E == 64; }
// Whether the K / V loads ask L2 for the 256 bytes around them
// (ld.global.nc.L2::256B).
constexpr bool mma_fetch_256(int E) { return E == 64; }
// Blocks a call's key splits aim at (plan_decode.cpp): one an SM at E = 64,
// two at E = 128 (their merge then reads twice the partials, still faster).
constexpr int mma_target_blocks(int E) { return E == 64 ? 128 : 256; }

// The fused merge's o loads a thread issues at once (decode_combine.cuh):
// at 32 the merge spills a register and measured slower.
constexpr int mma_merge_batch(int) { return 16; }

// The float32 decode (decode_tf32.cu): chunks of 1024 / E keys (the same
// bytes as the 16-bit kernel's chunks). 8 warps at E = 128 too: its o (8
// rows, not 16) leaves room in shared memory; one chunk in flight at
// E = 128 (two were not measured there).
constexpr int tf32_warps(int) { return 8; }
constexpr int tf32_chunks_in_flight(int E) { return E == 64 ? 2 : 1; }
constexpr int tf32_merge_batch(int) { return 16; }

}  // namespace fa::decode_shapes
