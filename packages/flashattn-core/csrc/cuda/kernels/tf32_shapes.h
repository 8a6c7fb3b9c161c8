// Block shape of the float32 mma.sync prefill (prefill_tf32.cu), in plain
// C++: the kernel builds its tiles from it and the planner (plan_prefill.cpp)
// its launches and shared memory, so the two cannot disagree.
//
// E = 256 (Gemma's head dim) has a shape of its own: Q's 64 rows alone take
// 65 KB there, so tiles of 64 keys (196 KB a block) would fit only GPUs with
// 227 KB a block and one block an SM. Tiles of 32 keys, V copied over K in
// one buffer once Q K^T is done (98 KB), fit every GPU from sm_80 on and two
// blocks an SM. Of the shapes measured on an H200 (docs/cuda.md) it was the
// fastest in a 2048-row chunk and near the fastest at 8K: two blocks an SM
// trade the 2K call's speed, where 256 blocks are less than a wave and the
// SM that runs the longest row tile shares it, for the longer calls'.

#pragma once

namespace fa::tf32_shapes {

// The E = 256 shape, as defines for probes of the others.
#ifndef FA_TF32_WIDE_KEYS
#define FA_TF32_WIDE_KEYS 32
#endif
#ifndef FA_TF32_WIDE_WARPS
#define FA_TF32_WIDE_WARPS 4
#endif
#ifndef FA_TF32_WIDE_SHARED
#define FA_TF32_WIDE_SHARED 1
#endif

// Warps of 16 query rows each (Br = 16 warps).
constexpr int warps(int E) { return E > 128 ? FA_TF32_WIDE_WARPS : 4; }
constexpr int rows(int E) { return 16 * warps(E); }
constexpr int threads(int E) { return 32 * warps(E); }
// Keys a tile (Bc).
constexpr int keys(int E) { return E > 128 ? FA_TF32_WIDE_KEYS : 64; }

// Rows padded so that the scalar fragment loads hit 32 different banks: Q
// and K by 4 floats, V by 8.
constexpr int ld_qk(int E) { return E + 4; }
constexpr int ld_v(int E) { return E + 8; }

// Whether K and V take turns in one buffer (V copied over K once Q K^T is
// done, while the softmax runs).
constexpr bool shared_kv(int E) { return E > 128 && FA_TF32_WIDE_SHARED; }
constexpr int kv_floats(int E) { return keys(E) * (shared_kv(E) ? ld_v(E) : ld_qk(E) + ld_v(E)); }
constexpr int smem_bytes(int E) { return (rows(E) * ld_qk(E) + kv_floats(E)) * 4; }

// E = 80, 96 and 128 where a block may take its 133 / 158 / 208 KB (H100,
// H200; A100 too below E = 128): prefill_tf32_pairs.cu, 8 warps x 16 rows
// against 64-key tiles that the block splits once into TF32 high and low
// parts, stored side by side. Rows padded so that each fragment load hits
// 32 different banks: Q (raw, read as pairs) by 8 floats, K and V^T (four
// floats a pair: hi, hi, lo, lo) by 16.
namespace pairs {
constexpr int kWarps = 8, kRows = 16 * kWarps, kThreads = 32 * kWarps, kKeys = 64;
constexpr bool has(int E) { return E == 80 || E == 96 || E == 128; }
constexpr int ld_q(int E) { return E + 8; }
constexpr int ld_k(int E) { return 2 * E + 16; }
constexpr int kLdVt = 2 * kKeys + 16;
constexpr int smem_bytes(int E) { return (kRows * ld_q(E) + kKeys * ld_k(E) + E * kLdVt) * 4; }
}  // namespace pairs

}  // namespace fa::tf32_shapes
