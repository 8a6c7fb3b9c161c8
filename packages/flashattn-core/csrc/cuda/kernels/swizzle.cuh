// The 128-byte swizzled tile layout that wgmma reads (wgmma.cuh), in plain
// C++ device code so that kernels without wgmma can share tiles stored so.

#pragma once

namespace fa {

// Element (r, c) of a tile of R rows in wgmma's 128-byte swizzled layout:
// the head dim in column blocks of 64 elements (128 bytes), each block R rows
// of 128 bytes; the 16-byte chunk c of a row r sits at chunk c ^ (r % 8). The
// XOR is on address bits, so every tile starts on a 1024-byte boundary.
// (16-bit elements.)
template <int R>
__device__ __forceinline__ int sw_at(int r, int c) {
  return ((c >> 6) * R + r) * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

}  // namespace fa
