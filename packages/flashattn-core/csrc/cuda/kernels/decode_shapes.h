// Block shape of the tensor-core decodes (decode_mma.cu, decode_tf32.cu), in plain C++: the
// kernel builds its blocks from it and the planner (dispatch.cpp) its
// launches, so the two cannot disagree on threads.
//
// E = 64: 8 warps, each loading two chunks of 32 keys before computing them
// (64 KB of K and V in flight a block: a split of 512 keys, qwen05b's at
// S = 32768, asked for at once). E = 128: 4 warps, one chunk of 16 keys at a
// time (a warp's o takes 64 registers; 8 warps' o would not fit the 48 KB of
// static shared memory the combine uses). H200 (scripts/decode-floor.cu, 20
// launches in a CUDA graph): qwen05b S = 32768 bfloat16 14.4 -> 12.8 us a
// launch with the merge changes of the same commit; hd128 S = 32768 W = 4
// with two chunks in flight was within 1% of one.

#pragma once

namespace fa::decode_shapes {

constexpr int mma_warps(int E) { return E == 64 ? 8 : 4; }
constexpr int mma_chunks_in_flight(int E) { return E == 64 ? 2 : 1; }

// The float32 decode (decode_tf32.cu): chunks of 1024 / E keys (the same
// bytes as the 16-bit kernel's chunks). 8 warps at E = 128 too: its o (8
// rows, not 16) leaves room in shared memory.
constexpr int tf32_warps(int) { return 8; }
constexpr int tf32_chunks_in_flight(int E) { return mma_chunks_in_flight(E); }

}  // namespace fa::decode_shapes
