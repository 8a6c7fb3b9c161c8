// Block shape of the float16 / bfloat16 mma.sync prefill (prefill_f16.cu),
// in plain C++: the kernel builds its tiles from it and the planner
// (plan_prefill.cpp) its launches and shared memory, so the two cannot
// disagree.
//
// W warps of 16 query rows each, W = 8 at E = 64 and 4 above, where
// registers run short. Shared memory holds Q's rows and two buffers each of
// K and V, every row padded by 8 elements (16 bytes), which keeps ldmatrix
// free of bank conflicts.

#pragma once

namespace fa::f16_shapes {

constexpr int warps(int E) { return E <= 64 ? 8 : 4; }
constexpr int rows(int E) { return 16 * warps(E); }  // Br
constexpr int threads(int E) { return 32 * warps(E); }
constexpr int kBc = 64;                     // keys a tile
constexpr int ld(int E) { return E + 8; }  // elements a padded row
// Q, then two buffers of K and V, 2 bytes an element.
constexpr int smem_bytes(int E) { return (rows(E) + 4 * kBc) * ld(E) * 2; }

}  // namespace fa::f16_shapes
