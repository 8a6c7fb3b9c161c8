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

// The keys pass (dK, dV): 64 keys a block, query rows in tiles of 32. K, V,
// Q, dO, and the row tile's log-sum-exp and D.
constexpr int kKeys = 16 * kWarps;
constexpr int kRowTile = 32;
FA_HOST_DEVICE constexpr int keys_smem_bytes(int EB) { return ((2 * kKeys + 2 * kRowTile) * ld(EB) + 2 * kRowTile) * 4; }

}  // namespace fa::backward_shapes
