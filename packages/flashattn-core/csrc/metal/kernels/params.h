// What the host and the Metal kernels must agree on: the index of each launch
// parameter in the int32 `params` input, the mask kinds the kernels see, and
// the tile sizes that fix each kernel's grid. dispatch.cpp includes this file;
// CMake embeds it ahead of common.metal, so the kernels read the same text.
// It is written in the subset of C++ that Metal's language shares (enums and
// constexpr functions, no namespace-scope variables).

#ifndef FLASHATTN_METAL_PARAMS_H
#define FLASHATTN_METAL_PARAMS_H

namespace fa {

enum Param : int {
  kHeadsQ = 0,       // H_q
  kHeadsKV = 1,      // H_kv
  kL = 2,            // query rows per head
  kS = 3,            // keys per head
  kE = 4,            // head dimension
  kMaskKind = 5,     // MaskKind below
  kMaskRowStride = 6,
  kMaskColStride = 7,
  kKeysPerSplit = 8, // keys one threadgroup walks (decode splits S)
  kRowsPerGroup = 9, // query rows of one threadgroup of the rows kernel
  kScaleLog2 = 10,   // softmax scale x log2(e), as float bits
  kRowsTotal = 11,   // B x H_q x L: slots of the split partials
  kSplits = 12,
  kScale = 13,       // the softmax scale itself, as float bits (the backward's dQ, dK)
  kWindow = 14,      // causal masks: a sliding window of this many keys (0: none)
  kKVBits = 15,      // quantized keys and values (the *_q kernels): bits a field
  kKVGroupSize = 16, //   and elements a scale and bias
  kLseKept = 17,     // the backward's rows pass: 1 where its lse input holds the forward's log-sum-exp
  kParamCount = 18,
};

// Boolean masks arrive as additive ones (0 or -inf); both are "additive".
enum MaskKind : int { kMaskNone = 0, kMaskCausal = 1, kMaskAdditive = 3 };

// flash_rows: Br query rows (SIMD groups) per threadgroup, 32 up to E = 128
// (EPT <= 4 head-dim elements per lane), 16 beyond (E <= 256).
constexpr int rows_per_threadgroup(int EPT) {
  return EPT <= 4 ? 32 : 16;
}

// The backward kernels: rows (or keys) per threadgroup, a SIMD group each,
// half the forward's: each SIMD group stages two vectors of E floats (q and
// dO, or k and v), and Apple GPUs have 32 KiB of threadgroup memory.
constexpr int backward_rows_per_threadgroup(int EPT) {
  return EPT <= 4 ? 16 : 8;
}

// flash_mma: Br = 32 query rows in 4 SIMD groups (128 threads), Bc keys a tile.
enum : int { kMmaThreads = 128 };
constexpr int mma_rows() {
  return 32;
}
constexpr int mma_keys(int E) {
  return E <= 96 ? 32 : 16;
}

}  // namespace fa

#endif  // FLASHATTN_METAL_PARAMS_H
