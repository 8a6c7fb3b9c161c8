// Block shapes of the backward (backward.cu), in plain C++: the kernels build
// their tiles from them and the host (cuda/backward.cpp) its launches and
// shared memory, so the two cannot disagree.
//
// Head dims run in buckets of 64, 128 and 256 (rows padded with zeros to the
// bucket). Every tile lies in shared memory as float32 (16-bit inputs
// widened once as they land), rows padded by 4 floats so that the fragment
// loads of Q K^T hit 32 different banks. A block accumulates at most 128
// gradient columns, 64 registers a thread per gradient: at E = 256 two
// blocks take one half each (grid.z), recomputing the scores.

#pragma once

#include "causal.h"  // FA_HOST_DEVICE

namespace fa::backward_shapes {

constexpr int kWarps = 4;  // of 16 rows (the rows pass) or keys (the keys pass) each
constexpr int kThreads = 32 * kWarps;

FA_HOST_DEVICE constexpr int bucket(int E) { return E <= 64 ? 64 : E <= 128 ? 128 : 256; }
FA_HOST_DEVICE constexpr int ld(int EB) { return EB + 4; }
FA_HOST_DEVICE constexpr int out_cols(int EB) { return EB > 128 ? 128 : EB; }
FA_HOST_DEVICE constexpr int col_blocks(int EB) { return EB / out_cols(EB); }

// The rows pass (dQ and each row's statistics): 64 query rows a block, keys
// in tiles of 64 (32 above E = 64: two blocks an SM at E = 128). Q, dO, K, V.
constexpr int kRows = 16 * kWarps;
FA_HOST_DEVICE constexpr int key_tile(int EB) { return EB > 64 ? 32 : 64; }
FA_HOST_DEVICE constexpr int rows_smem_bytes(int EB) { return (2 * kRows + 2 * key_tile(EB)) * ld(EB) * 4; }

// Blocks an SM that the rows pass's registers must allow: at E = 64 its
// shared memory leaves three on Hopper, which 171 registers a thread would
// cut to two.
FA_HOST_DEVICE constexpr int min_blocks(int EB) { return EB == 64 ? 3 : 1; }

// The keys pass (dK, dV): 64 keys a block, query rows in tiles of 64 at
// E = 64 and 32 above (where dK and dV take 128 registers a thread). K, V,
// Q, dO, and the row tile's log-sum-exp and D. At E = 64 the wider row tile
// reads each warp's K and V fragments half as often: two blocks an SM (229
// registers) where the 32-row tile had three, and the keys pass with dQ
// 0.96x the time (qwen05b causal 8K, H200).
constexpr int kKeys = 16 * kWarps;
FA_HOST_DEVICE constexpr int row_tile(int EB) { return EB == 64 ? 64 : 32; }
FA_HOST_DEVICE constexpr int keys_smem_bytes(int EB) {
  return ((2 * kKeys + 2 * row_tile(EB)) * ld(EB) + 2 * row_tile(EB)) * 4;
}
// With dQ (fa_backward_keysq, E <= 128): the row tile's dS^T after them,
// a key's rows padded by 8 floats (its stores and dQ's reads then hit
// distinct banks).
FA_HOST_DEVICE constexpr int ld_ds(int rows) { return rows + 8; }
FA_HOST_DEVICE constexpr int keysq_smem_bytes(int EB) { return keys_smem_bytes(EB) + kKeys * ld_ds(row_tile(EB)) * 4; }

// 16-bit inputs at E <= 128 (backward_f16.cu): a statistics pass (64 rows a
// block of 4 warps, key tiles of 64) and a keys pass that makes all three
// gradients: 128 keys a block of 8 warps (every block adds its keys' share
// of dQ by atomics: 64 keys a block took ~2x the L2 traffic), row tiles of
// 64 at E = 64 and 32 at E = 128, where dK and dV take 128 registers a
// thread. Tiles stay 16-bit in shared memory for m16n8k16, rows padded by 8
// elements (16 bytes, so that the 8 rows an ldmatrix reads hit distinct
// banks); the tiles a loop walks (K; Q, dO and the rows' statistics)
// double-buffered, the next copied by cp.async during this one's products.
// The keys pass keeps the tile's dS^T too, for dQ.
FA_HOST_DEVICE constexpr bool f16_kernel(int EB, int bytes) { return bytes == 2 && EB <= 128; }
FA_HOST_DEVICE constexpr int ld16(int EB) { return EB + 8; }
constexpr int kKeyTile16 = 64;
constexpr int kKeysThreads16 = 256;
constexpr int kKeys16 = 16 * kKeysThreads16 / 32;
FA_HOST_DEVICE constexpr int row_tile16(int EB) { return EB > 64 ? 32 : 64; }
FA_HOST_DEVICE constexpr int ld_ds16(int EB) { return row_tile16(EB) + 8; }
FA_HOST_DEVICE constexpr int rows_smem_bytes16(int EB) { return (kRows + 2 * kKeyTile16) * ld16(EB) * 2; }
FA_HOST_DEVICE constexpr int keys_smem_bytes16(int EB) {
  return ((2 * kKeys16 + 4 * row_tile16(EB)) * ld16(EB) + kKeys16 * ld_ds16(EB)) * 2 + 4 * row_tile16(EB) * 4;
}

// The keys pass on Hopper (backward_wg.cu): the same blocks and tiles, K,
// V, Q and dO unpadded in wgmma's swizzled layout, the rows' flags beside
// their statistics.
FA_HOST_DEVICE constexpr int keys_smem_bytes_wg(int EB) {
  return ((2 * kKeys16 + 4 * row_tile16(EB)) * EB + kKeys16 * ld_ds16(EB)) * 2 + 6 * row_tile16(EB) * 4;
}

// Past them, dQ's share of the block in two float32 staging tiles (BR x EB
// each, rows contiguous as in dQ's sums) for the keys passes compiled for
// their head dim, which add a row tile's share by one bulk reduce
// (backward_wg.cu).
FA_HOST_DEVICE constexpr int keys_dq_stage_bytes_wg(int EB) { return 2 * row_tile16(EB) * EB * 4; }
FA_HOST_DEVICE constexpr int keys_smem_total_wg(int EB) { return keys_smem_bytes_wg(EB) + keys_dq_stage_bytes_wg(EB); }

// float32 at E = 64 on Hopper's float16 tensor cores (backward_f32s_wg.cu):
// the keys pass's blocks of 128 keys and row tiles of 64, K, V, Q and dO as
// rows of two float16 terms ([hi | lo], 128 halves, swizzled), the next row
// tile's Q and dO in float32, dS^T's two terms for dQ (in a tile that holds
// a value that is not finite, dS^T in float32 in the same bytes), the rows'
// (lse, D) and the tiles' shifts (two buffers each), and the warps' largest
// |dS|.
constexpr int kF32sE = 64, kF32sRows = 64;
FA_HOST_DEVICE constexpr int keys_smem_bytes_f32s() {
  return (2 * kKeys16 + 2 * kF32sRows) * 2 * kF32sE * 2 + 2 * kF32sRows * kF32sE * 4 +
         2 * kKeys16 * (kF32sRows + 8) * 2 + 4 * kF32sRows * 4 + (8 + 4) * 4;
}

// The statistics pass on Hopper: the same tiles, unpadded (swizzled).
FA_HOST_DEVICE constexpr int rows_smem_bytes_wg(int EB) { return (kRows + 2 * kKeyTile16) * EB * 2; }

// A keys pass launch's keys a block and threads a block, and a launch's
// dynamic shared memory, for inputs of `bytes` bytes an element.
FA_HOST_DEVICE constexpr int keys_block(int EB, int bytes) { return f16_kernel(EB, bytes) ? kKeys16 : kKeys; }
FA_HOST_DEVICE constexpr int keys_threads(int EB, int bytes) { return f16_kernel(EB, bytes) ? kKeysThreads16 : kThreads; }
FA_HOST_DEVICE constexpr int rows_smem(int EB, int bytes) {
  return f16_kernel(EB, bytes) ? rows_smem_bytes16(EB) : rows_smem_bytes(EB);
}
FA_HOST_DEVICE constexpr int keys_smem(int EB, int bytes) {
  return f16_kernel(EB, bytes) ? keys_smem_bytes16(EB) : keys_smem_bytes(EB);
}

}  // namespace fa::backward_shapes
