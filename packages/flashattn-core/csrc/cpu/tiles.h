// Tile shapes of the CPU kernels, chosen in this one place.
//
// The kernels vectorise over query rows: a row tile of RB = RV x W query rows
// (W SIMD lanes, RV vectors) meets key/value tiles of Bc keys. Per thread the
// scratch is Q_i^T and o_i^T (E x RB each), S_ij^T (Bc x RB) and, for inputs
// that must be converted or padded, one K_j and one V_j tile (Bc x E each):
// a few tens of KiB, which keeps the hot set in L1/L2.
//
// KB keys (in Q K^T) and EB head-dim columns (in P V) are processed per
// register block: KB x RV (or EB x RV) accumulators stay in registers.

#pragma once

namespace flashattn::cpu {

constexpr int Bc = 64; // keys per tile

template <int W_, int RV_, int KB_, int EB_>
struct TileConfig {
  static constexpr int W = W_; // SIMD lanes (floats per vector)
  static constexpr int RV = RV_; // vectors of query rows per row tile
  static constexpr int RB = W_ * RV_; // query rows per row tile
  static constexpr int KB = KB_; // keys per Q K^T register block
  static constexpr int EB = EB_; // head-dim columns per P V register block
  static_assert(Bc % KB_ == 0, "Bc must be a multiple of KB");
};

// "wide" for prefill, "narrow" for decode (few query rows per KV head).
namespace avx512_tiles {
using wide = TileConfig<16, 3, 8, 8>; // 24 zmm accumulators of 32
using narrow = TileConfig<8, 1, 8, 8>; // ymm: decode rows rarely fill 16
} // namespace avx512_tiles
namespace avx2_tiles {
using wide = TileConfig<8, 3, 4, 4>; // 12 ymm accumulators of 16 (8 took 1.1-1.3x the time)
using narrow = TileConfig<8, 1, 8, 8>;
} // namespace avx2_tiles
namespace baseline_tiles { // SSE2 on x86-64, NEON on arm64
using wide = TileConfig<4, 2, 4, 4>;
using narrow = TileConfig<4, 2, 4, 4>;
} // namespace baseline_tiles

constexpr int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

constexpr int round_up(int a, int b) {
  return ceil_div(a, b) * b;
}

} // namespace flashattn::cpu
