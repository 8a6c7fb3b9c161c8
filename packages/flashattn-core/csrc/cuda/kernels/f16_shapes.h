// Block shape of the float16 / bfloat16 mma.sync prefill (prefill_f16.cu),
// in plain C++: the kernel builds its tiles from it and the planner
// (plan_prefill.cpp) its launches and shared memory, so the two cannot
// disagree.
//
// W warps of 16 query rows each, W = 8 at E = 64 and 4 above, where
// registers run short. At E = 256 a wide block has 8 (198 KB of shared
// memory: Hopper's blocks may take that much), which shares each key tile
// among twice the rows and gives an SM twice the warps to hide latencies
// with (1.3-1.45x the time a key tile for twice the rows, H100), at the
// price of half the blocks: the planner takes it where its model of the
// launch says it ends sooner (plan_prefill.cpp). Shared memory holds Q's
// rows and two buffers each of K and V, every row padded by 8 elements (16
// bytes), which keeps ldmatrix free of bank conflicts.

#pragma once

namespace fa::f16_shapes {

constexpr bool has_wide(int E) { return E == 256; }
constexpr int warps(int E, bool wide = false) { return E <= 64 || wide ? 8 : 4; }
constexpr int rows(int E, bool wide = false) { return 16 * warps(E, wide); }  // Br
constexpr int threads(int E, bool wide = false) { return 32 * warps(E, wide); }
constexpr int kBc = 64;                     // keys a tile
constexpr int ld(int E) { return E + 8; }  // elements a padded row
// Q, then two buffers of K and V, 2 bytes an element.
constexpr int smem_bytes(int E, bool wide = false) { return (rows(E, wide) + 4 * kBc) * ld(E) * 2; }

}  // namespace fa::f16_shapes
