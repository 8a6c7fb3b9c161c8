// Where the tensor-core decodes (decode_mma.cu, decode_tf32.cu) read one KV
// head's key or value rows from: plain rows of the attention's dtype, or
// MLX's affine-quantized rows read in place (packed codes, a scale and a
// bias per group of elements), expanded in registers. A warp loads all of
// a pass's raw fragments first and expands each just before its product,
// so the loads are in flight together and a quantized fragment holds its
// codes (fewer registers than the 16 bytes it expands to) until then.

#pragma once

#include <type_traits>

#include "common.cuh"
#include "mma.cuh"

namespace fa {

// 16 bytes at p, or zeros when !valid; kFetch256: a miss brings the 256
// bytes around p into L2 (the rows the next fragment loads read).
template <bool kFetch256 = false>
__device__ __forceinline__ uint4 load16(const void* p, bool valid) {
  if constexpr (!kFetch256) {
    return valid ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
  } else {
    uint4 r = make_uint4(0, 0, 0, 0);
    if (valid) {
      asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
          : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
          : "l"(p));
    }
    return r;
  }
}

// 4 bytes at p (read-only for the kernel's life), with decode_mma's L2 hint.
template <bool kFetch256 = false>
__device__ __forceinline__ uint32_t load_word(const uint32_t* p) {
  uint32_t r;
  if constexpr (kFetch256) {
    asm("ld.global.nc.L2::256B.u32 %0, [%1];" : "=r"(r) : "l"(p));
  } else {
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  }
  return r;
}

// N = 2 or 4 words at p (8- or 16-byte aligned, read-only), with
// decode_mma's L2 hint, into w.
template <int N, bool kFetch256 = false>
__device__ __forceinline__ void load_words(const uint32_t* p, uint32_t* w) {
  static_assert(N == 2 || N == 4, "8 or 16 bytes");
  if constexpr (N == 4 && kFetch256) {
    asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
        : "l"(p));
  } else if constexpr (N == 4) {
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  } else if constexpr (kFetch256) {
    asm("ld.global.nc.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else {
    asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  }
}

// 8 elements of 16-bit T from any 2-byte boundary (the quantized decode's
// queries: read once a block, so no alignment is asked of them).
template <typename T>
__device__ __forceinline__ uint4 load8_any(const T* p, bool valid) {
  uint32_t w[4] = {0, 0, 0, 0};
  if (valid) {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = uint32_t(s[2 * i]) | uint32_t(s[2 * i + 1]) << 16;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 8 query elements: 16 aligned bytes, or (kAligned false) from anywhere.
template <bool kAligned, typename T>
__device__ __forceinline__ uint4 load_query(const T* p, bool valid) {
  if constexpr (kAligned) {
    return load16(p, valid);
  } else {
    return load8_any(p, valid);
  }
}

// Plain rows of 16-bit T: a fragment is the 16 bytes of 8 elements.
template <typename T, bool kFetch256>
struct PlainRows16 {
  using Raw = uint4;
  static constexpr bool kPrefetch = true, kAlignedQueries = true;
  const T* head;  // row 0 of this KV head
  int sr;         // row stride, in elements (the launch argument)
  __device__ __forceinline__ const T* prefetch_head() const { return head; }
  __device__ __forceinline__ int64_t prefetch_stride() const { return sr; }
  // Dims [d0 + d1, +8) of row `key` (d0 a constant of the unrolled loops:
  // added to the pointer apart, it folds into the load's offset).
  __device__ __forceinline__ Raw load(int key, int d0, int d1, bool valid) const {
    return load16<kFetch256>(head + key * static_cast<int64_t>(sr) + d0 + d1, valid);
  }
  __device__ __forceinline__ uint4 expand(const Raw& r) const { return r; }
  __device__ __forceinline__ int element_dim(int i) const { return i; }
  __device__ __forceinline__ uint4 arrange_query(const uint4& q) const { return q; }
  // Q K^T's fragment kb of lane t (of KB a row): dims [32 kb + 8 t, +8),
  // 16 bytes a load either way.
  template <int KB>
  static __device__ __forceinline__ int key_dim(int kb, int t) { return 32 * kb + 8 * t; }
  template <int KB>
  __device__ __forceinline__ void load_keys(int key, int t, bool valid, Raw (&r)[KB]) const {
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) r[kb] = load(key, 32 * kb, 8 * t, valid);
  }
  // P V's fragments of lane g (DB of a row): dims [64 db + 8 g, +8); slot i
  // of fragment db of the lane of column n lands in output dim out_dim.
  template <int DB>
  __device__ __forceinline__ void load_values(int key, int g, bool valid, Raw (&r)[DB]) const {
#pragma unroll
    for (int db = 0; db < DB; ++db) r[db] = load(key, 64 * db, 8 * g, valid);
  }
  template <int DB>
  __device__ __forceinline__ int out_dim(int db, int n, int i) const { return 64 * db + 8 * n + element_dim(i); }
};

// Arithmetic on two 16-bit values packed in a register (low half first).
// kMagic: a constant whose pattern OR a small integer n in the low mantissa
// bits is the value kMagic + n exactly (1024 + n, n < 1024 for float16;
// 128 + n, n < 128 for bfloat16), so n becomes a 16-bit float in one logic
// operation and a subtraction, with no conversion instruction (those run at
// 1/8 of the FMA rate).
template <typename T>
struct Pair16 {
  static constexpr bool kHalf = std::is_same<T, __half>::value;
  using V = std::conditional_t<kHalf, __half2, __nv_bfloat162>;
  static constexpr uint32_t kMagic = kHalf ? 0x64006400u : 0x43004300u;
  static constexpr int kMagicBits = kHalf ? 10 : 7;
  __device__ __forceinline__ static V of(uint32_t x) { return *reinterpret_cast<V*>(&x); }
  __device__ __forceinline__ static uint32_t bits(V x) { return *reinterpret_cast<uint32_t*>(&x); }
  __device__ __forceinline__ static uint32_t sub(uint32_t a, uint32_t b) { return bits(__hsub2(of(a), of(b))); }
  __device__ __forceinline__ static uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    return bits(__hfma2(of(a), of(b), of(c)));
  }
};

// The head's rows in MLX's affine format (bits 4 or 8): element e of row r
// is scale * code + bias, the code at bits (e mod 32 / bits) * bits of word
// e * bits / 32 of the row, scale and bias those of group e / group_size
// (32, 64 or 128: 8 elements at a multiple of 8 lie in one group).
//
// A fragment's 8 elements expand in pairs by Pair16: one fused multiply-add
// of scale and bias in T (one rounding), the codes picked out of their word
// in place. So a register pairs the elements that lie 16 bits apart in the
// word (4 bits: elements j and j + 4; 8 bits: j and j + 2 of each word),
// not neighbours: element_dim says which element the kernel's slot i
// holds, and arrange_query puts the queries' dims in the same order (the
// head-dim sum of Q K^T runs in any order both share). bfloat16's 128 + n
// holds n < 128 only: an 8-bit code goes in as its two nibbles, (16 scale)
// hi + (scale lo + bias) (the inner sum rounded once more).
template <typename T, bool kFetch256, int kBits>
struct QuantRows16 {
  static_assert(kBits == 4 || kBits == 8, "4 or 8 bits (the unit's FA_QUANT_BITS)");
  struct Raw {
    uint32_t w0, w1;  // 8 codes: one word at 4 bits, two at 8
    uint32_t sb;      // the group's scale (low half) and bias, as T
  };
  // No L2 prefetch of the rows ahead (ChunkWalk asks for rows of T), and
  // queries read without alignment (load8_any).
  static constexpr bool kPrefetch = false, kAlignedQueries = false;
  using P = Pair16<T>;
  const uint32_t* packed;  // row 0 of this KV head
  const T* scales;
  const T* biases;
  int psr, ssr;            // row strides: words, groups (launch arguments)
  int group_shift;
  __device__ __forceinline__ const T* prefetch_head() const { return nullptr; }
  __device__ __forceinline__ int64_t prefetch_stride() const { return 0; }

  // The scale (low half) and bias of the group of dim `dim` of row `key`.
  __device__ __forceinline__ uint32_t scale_bias(int key, int dim) const {
    const int64_t gi = key * static_cast<int64_t>(ssr) + (dim >> group_shift);
    const unsigned short s = reinterpret_cast<const unsigned short*>(scales)[gi];
    const unsigned short b = reinterpret_cast<const unsigned short*>(biases)[gi];
    return uint32_t(s) | uint32_t(b) << 16;
  }

  // F fragments of dims [dim, dim + 8 F) of row `key` (one group), zeros
  // when !valid: their codes in one or two vector loads where the rows lie
  // 16 bytes apart from a 16-byte boundary (else word by word), one scale
  // and bias. A lane takes a run of its row: a load a fragment (a word, a
  // scale and a bias) took 3 F load instructions and half of each sector.
  template <int F>
  __device__ __forceinline__ void load_run(int key, int dim, bool valid, Raw (&r)[F]) const {
    constexpr int kWords = F * kBits / 4;
    static_assert(kWords == 1 || kWords == 2 || kWords == 4 || kWords == 8, "4 to 32 bytes of codes");
    uint32_t w[kWords] = {};
    uint32_t sb = 0u;
    if (valid) {
      const uint32_t* p = packed + key * static_cast<int64_t>(psr) + ((dim * kBits) >> 5);
      if constexpr (F == 1) {  // E = 64's value fragments: one or two words
        w[0] = load_word<kFetch256>(p);
        if constexpr (kWords == 2) w[1] = load_word<kFetch256>(p + 1);
      } else if (((reinterpret_cast<uintptr_t>(packed) | (static_cast<uintptr_t>(psr) * 4)) & 15) == 0) {
        load_words<(kWords < 4 ? kWords : 4), kFetch256>(p, w);
        if constexpr (kWords == 8) load_words<4, kFetch256>(p + 4, w + 4);
      } else {
#pragma unroll
        for (int i = 0; i < kWords; ++i) w[i] = load_word<kFetch256>(p + i);
      }
      sb = scale_bias(key, dim);
    }
#pragma unroll
    for (int f = 0; f < F; ++f) r[f] = kBits == 4 ? Raw{w[f], 0u, sb} : Raw{w[2 * f], w[2 * f + 1], sb};
  }

  // Q K^T's fragments: lane t takes the KB fragments of dims [8 KB t,
  // 8 KB (t + 1)) of its key (the queries in the same order).
  template <int KB>
  static __device__ __forceinline__ int key_dim(int kb, int t) { return 8 * KB * t + 8 * kb; }
  template <int KB>
  __device__ __forceinline__ void load_keys(int key, int t, bool valid, Raw (&r)[KB]) const {
    load_run<KB>(key, key_dim<KB>(0, t), valid, r);
  }

  // P V's fragments: lane g takes the DB fragments of dims [8 DB g,
  // 8 DB (g + 1)) of its value row, so slot i of fragment db of column n is
  // output dim out_dim(db, n, i) (the kernel puts o's dims back in order as
  // it stores them).
  template <int DB>
  __device__ __forceinline__ void load_values(int key, int g, bool valid, Raw (&r)[DB]) const {
    load_run<DB>(key, 8 * DB * g, valid, r);
  }
  template <int DB>
  __device__ __forceinline__ int out_dim(int db, int n, int i) const { return 8 * DB * n + 8 * db + element_dim(i); }

  // The 8 elements as 4 registers of T pairs; slot i (register i / 2, half
  // i % 2) holds element element_dim(i).
  __device__ __forceinline__ uint4 expand(const Raw& r) const {
    const uint32_t s2 = __byte_perm(r.sb, 0, 0x1010), b2 = __byte_perm(r.sb, 0, 0x3232);
    auto value = [&](uint32_t field_pair) { return P::fma(P::sub(field_pair | P::kMagic, P::kMagic), s2, b2); };
    uint32_t x[4];
    if constexpr (kBits == 4) {
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = value((r.w0 >> (4 * j)) & 0x000F000Fu);
    } else if constexpr (P::kMagicBits >= 8) {
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = value(((j < 2 ? r.w0 : r.w1) >> (8 * (j & 1))) & 0x00FF00FFu);
    } else {
      const uint32_t s16 = P::fma(s2, 0x41804180u, 0u);  // 16 scale, exact (bfloat16 16.0 = 0x4180)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t w = (j < 2 ? r.w0 : r.w1) >> (8 * (j & 1));
        const uint32_t lo = P::sub((w & 0x000F000Fu) | P::kMagic, P::kMagic);
        const uint32_t hi = P::sub(((w >> 4) & 0x000F000Fu) | P::kMagic, P::kMagic);
        x[j] = P::fma(hi, s16, P::fma(lo, s2, b2));
      }
    }
    return make_uint4(x[0], x[1], x[2], x[3]);
  }

  // The element of the 8 that slot i holds (above).
  __device__ __forceinline__ int element_dim(int i) const {
    return kBits == 4 ? (i >> 1) + 4 * (i & 1) : 4 * (i >> 2) + ((i >> 1) & 1) + 2 * (i & 1);
  }

  // 8 query elements in plain order (slot i element i) into expand's.
  __device__ __forceinline__ uint4 arrange_query(const uint4& q) const {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    uint32_t x[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      // slot 2r + h holds element element_dim(2r + h): for 4 bits r + 4h
      // (register r / 2 and 2 + r / 2, half r % 2), for 8 bits
      // 4 (r / 2) + r % 2 + 2h (registers 2 (r / 2) and 2 (r / 2) + 1, half r % 2).
      const uint32_t sel = (r & 1) ? 0x7632 : 0x5410;
      x[r] = kBits == 4 ? __byte_perm(w[r >> 1], w[2 + (r >> 1)], sel)
                        : __byte_perm(w[2 * (r >> 1)], w[2 * (r >> 1) + 1], sel);
    }
    return make_uint4(x[0], x[1], x[2], x[3]);
  }
};

}  // namespace fa
