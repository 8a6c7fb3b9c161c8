// Tensor-core building blocks (sm_80 and up, as PTX): shared-memory copies,
// ldmatrix, mma.sync, and the output rows of mma accumulators (the
// online-softmax step on them is softmax.cuh's).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 / m16n8k8), with g = lane / 4 and
// t = lane % 4: a C tile (16 x 8) holds rows g and g + 8, columns 2t, 2t + 1.

#pragma once

#include <type_traits>

#include "common.cuh"
#include "softmax.cuh"

namespace fa {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zeros when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
// All but the most recent N committed groups have landed.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// c += a (16 x 16, row) * b (16 x 8, col), float accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a (16 x 8, row) * b (8 x 8, col), TF32 operands held in 32-bit registers.
__device__ __forceinline__ void mma1688_tf32(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// o += what c holds, in float32 (rounded to nearest). The tensor cores
// round the sums they accumulate toward zero: a float32 accumulator carried
// by them over every key tile loses about half an ulp an addition, the
// same way each time, and where o's sum only grows (values of one sign)
// that drifted to 3.6e-4 against float64 over 16,384 keys (H200). So the
// kernels that promise float32 accuracy (forward and backward) take each key
// tile's products (or each 8 keys') in a fresh accumulator and add it here
// (docs/cuda.md).
__device__ __forceinline__ void add_fresh(float (&o)[4], const float (&c)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] += c[i];
}

// Column block kb of W (16 x NB*8, m16n8k8's accumulator layout: rows g,
// g + 8, columns 2t, 2t + 1) as this lane's four A-fragment values (rows g,
// g + 8 x columns t, t + 4), moved by quad shuffles: a tile's P (or dS)
// entering its next product.
template <int NB>
__device__ __forceinline__ void accumulator_to_a(const float (&w)[NB][4], int kb, int lane, float (&x)[4]) {
  const int t = lane & 3;
  const int src1 = (lane & ~3) | (t >> 1), src2 = src1 + 2;
  float y[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    y[i] = __shfl_sync(0xffffffffu, w[kb][i], src1);
    y[4 + i] = __shfl_sync(0xffffffffu, w[kb][i], src2);
  }
  const int odd = t & 1;
  x[0] = odd ? y[1] : y[0];  // row g, column t
  x[1] = odd ? y[3] : y[2];  // row g + 8
  x[2] = odd ? y[5] : y[4];  // row g, column t + 4
  x[3] = odd ? y[7] : y[6];
}

// x = hi + lo for the 3xTF32 split (hi*hi + hi*lo + lo*hi recovers float32
// accuracy on TF32 tensor cores). hi is x truncated to TF32 (one logic op;
// a rounding conversion costs four instructions on sm_90) and lo = x - hi
// exactly; lo goes to the tensor cores as it is, which read the top 19 bits
// of a TF32 operand: its own truncation costs 2^-10 of lo, about 2^-20 of x.
// For x = +-inf, lo is 0 (inf - inf would be NaN); a NaN x gives a NaN lo,
// so NaN still propagates.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  const float h = __uint_as_float(hi);
  lo = __float_as_uint(x == h ? 0.0f : x - h);
}

// split_tf32 for the query side of S = Q K^T, where a zero lo would meet an
// infinite key: lo k_hi = 0 x inf = NaN where x * inf is +-inf (and with
// hi x k_lo the same for an infinite query element against a key that TF32
// holds exactly, k_lo = 0). So a nonzero x that TF32 holds exactly splits
// into hi one TF32 step nearer zero and lo that step (a power of two; still
// hi + lo = x exactly), and an infinite x into a finite hi and an infinite
// lo. Every term then carries x * inf's sign; 0 and NaN split as before.
__device__ __forceinline__ void split_tf32_query(float x, uint32_t& hi, uint32_t& lo) {
  const uint32_t b = __float_as_uint(x);
  const bool exact = (b & 0x1fffu) == 0 && (b << 1) != 0;
  hi = (b & 0xffffe000u) - (exact ? 0x2000u : 0u);
  lo = __float_as_uint(x - __uint_as_float(hi));
}

// split_tf32 without its guard for +-inf (lo = inf - inf = NaN there): for
// a probability, never infinite, and for values, whose infinities send the
// tile down the rare path, which reads hi alone where it is infinite. A NaN
// keeps its quiet bit in hi and stays NaN in both.
__device__ __forceinline__ void split_finite(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Whether either 16-bit float of a pair is infinite or NaN (all exponent
// bits set).
template <typename T>
__device__ __forceinline__ bool pair_nonfinite(uint32_t w) {
  constexpr uint32_t e = std::is_same<T, __half>::value ? 0x7C00u : 0x7F80u;
  return (w & e) == e || ((w >> 16) & e) == e;
}

// Element `half` (0: the low 16 bits, pack2's lo) of a pair packed by pack2.
template <typename T>
__device__ __forceinline__ float unpack_half(uint32_t w, int half);
template <>
__device__ __forceinline__ float unpack_half<__nv_bfloat16>(uint32_t w, int half) {
  return __uint_as_float(half ? w & 0xffff0000u : w << 16);
}
template <>
__device__ __forceinline__ float unpack_half<__half>(uint32_t w, int half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(half ? w >> 16 : w & 0xffffu)));
}

// P (in [0, 1]) as kTerms 16-bit terms for the P V product, each the
// rounding of what the terms before it left: bfloat16 keeps 8 significant
// bits a term, so 3 terms hold float32's 24 and 2 terms 16 (each P within
// 2^-17 of its value, relative; BF16_TERMS). float16 keeps 11 but is
// subnormal below 2^-14, so P is scaled by 2^15 first (at most 32768: no
// overflow) and 2 terms hold 22 bits (relative error ~2^-23); o takes the
// scale back before it leaves the warp (the float32 attention over 16-bit
// inputs of decode_mma.cu and prefill_f16_wg.cu).
template <typename T, int BF16_TERMS = 3>
struct PSplit;
template <int BF16_TERMS>
struct PSplit<__nv_bfloat16, BF16_TERMS> {
  static_assert(BF16_TERMS == 2 || BF16_TERMS == 3, "16 or 24 bits");
  static constexpr int kTerms = BF16_TERMS;
  static constexpr float kScale = 1.0f;
};
template <int BF16_TERMS>
struct PSplit<__half, BF16_TERMS> {
  static constexpr int kTerms = 2;
  static constexpr float kScale = 32768.0f;
};

// P (s, in the m16n8 accumulator layout: rows g, g + 8, keys 2t, 2t + 1 of
// each 8-key block) times each row's scale (row g: scale[0], g + 8:
// scale[1]), as P V's A operand in kTerms 16-bit terms, each the rounding of
// what the terms before it left (PSplit; one term: P rounded to 16 bits).
template <typename T, int kTerms, int NK>
__device__ __forceinline__ void pack_p_terms(uint32_t (&p)[kTerms][NK][4], const float (&s)[2 * NK][4],
                                             const float (&scale)[2]) {
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float f = scale[j & 1];
      float lo = s[2 * kk + (j >> 1)][2 * (j & 1)] * f, hi = s[2 * kk + (j >> 1)][2 * (j & 1) + 1] * f;
#pragma unroll
      for (int term = 0; term < kTerms; ++term) {
        p[term][kk][j] = pack2<T>(lo, hi);
        if (term + 1 < kTerms) lo -= unpack_half<T>(p[term][kk][j], 0), hi -= unpack_half<T>(p[term][kk][j], 1);
      }
    }
  }
}

// The same with one scale for both rows.
template <typename T, int kTerms, int NK>
__device__ __forceinline__ void pack_p_terms(uint32_t (&p)[kTerms][NK][4], const float (&s)[2 * NK][4],
                                             float scale) {
  const float both[2] = {scale, scale};
  pack_p_terms<T>(p, s, both);
}

// The rare tile of the prefills (a key hidden from some row, a value not
// finite): o += P V in plain float32 over the keys each row sees, 0 x NaN
// being what would leak a hidden value. P as P V's A operand would take it:
// p[term][kk] holds PSplit's terms (or P itself, kTerms = 1) of rows g and
// g + 8, keys 2t, 2t + 1 of each 8-key block of the 16 from 16 kk; value(c,
// col) reads V's element at the tile's key c. P of key c sits with quad
// thread (c % 8) / 2, which passes it round. The keys run in a rolled loop,
// P indexed through a local copy: the path is rare, and MLX hashes the whole
// module on every launch (unrolled, it was most of a kernel's machine code).
template <typename T, int kTerms, int NK, int NO, typename Value>
__device__ __forceinline__ void rare_pv(float (&o)[NO][4], const uint32_t (&p)[kTerms][NK][4], Value value,
                                        const Mask& mask, int64_t n, int ra, int L, int S, int c0, int keys,
                                        int lane) {
  constexpr int NB = 2 * NK;
  const int t = lane & 3;
  const int64_t rb[2] = {mask.is_array() && ra < L ? mask.row_base(n, ra) : 0,
                         mask.is_array() && ra + 8 < L ? mask.row_base(n, ra + 8) : 0};
  uint32_t p_rows[kTerms][2][NB];  // rows g, g + 8: keys 8 nb .. 8 nb + 7
#pragma unroll
  for (int term = 0; term < kTerms; ++term)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      p_rows[term][0][nb] = p[term][nb >> 1][(nb & 1) * 2];
      p_rows[term][1][nb] = p[term][nb >> 1][(nb & 1) * 2 + 1];
    }
#pragma unroll 1
  for (int c = 0; c < keys; ++c) {
    const int i = c & 7, src = (lane & ~3) | (i >> 1), key = c0 + c;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float pr = 0.0f;  // the terms' sum, as the tensor cores take it
#pragma unroll
      for (int term = 0; term < kTerms; ++term)
        pr += unpack_half<T>(__shfl_sync(0xffffffffu, p_rows[term][rr][c >> 3], src), i & 1);
      if (mask.hides(rb[rr], ra + rr * 8, key, L, S)) continue;
#pragma unroll
      for (int eb = 0; eb < NO; ++eb) {
        o[eb][2 * rr] += pr * to_f(value(c, eb * 8 + 2 * t));
        o[eb][2 * rr + 1] += pr * to_f(value(c, eb * 8 + 2 * t + 1));
      }
    }
  }
}

// The slice a prefill block takes: grid (row tiles, H_q, batch). Blocks start
// in the order of their linear index, which is mapped so that the heaviest
// row tiles (under a causal mask, the last) of every head start first: the
// greedy order that leaves the GPU the least ragged tail. (Mapping within
// each head only, qwen05b 8K causal on 132 SMs would end ~13% after the
// balanced time.)
struct PrefillBlock {
  int64_t b, n;     // batch; (batch, query head) slice, b H_q + h
  int h, g;         // query head, its KV head
  int l0;           // first query row of the tile
  int kv_begin, kv_end;  // keys [kv_begin, kv_end) hold every key a row of the tile may see

  // window: a causal mask's sliding window (its mask_cs argument: causal.h's kNoWindow for none).
  __device__ PrefillBlock(int rows_per_tile, int H_q, int H_kv, int L, int S, int mask_kind, int window) {
    const int64_t slices = int64_t(gridDim.y) * gridDim.z;
    const int64_t j = blockIdx.x + int64_t(gridDim.x) * (blockIdx.y + int64_t(gridDim.y) * blockIdx.z);
    place(int(j % slices % gridDim.y), j % slices / gridDim.y, gridDim.x - 1 - int(j / slices), rows_per_tile, H_q,
          H_kv, L, S, mask_kind, window);
  }

  // Row tile `tile` of slice `slice` (= batch x H_q + query head): a block
  // that takes several tiles (prefill_f16_wg.cu).
  __device__ PrefillBlock(int rows_per_tile, int H_q, int H_kv, int L, int S, int mask_kind, int window, int tile,
                          int64_t slice) {
    place(int(slice % H_q), slice / H_q, tile, rows_per_tile, H_q, H_kv, L, S, mask_kind, window);
  }

 private:
  __device__ void place(int head, int64_t batch, int tile, int rows_per_tile, int H_q, int H_kv, int L, int S,
                        int mask_kind, int window) {
    h = head;
    g = h / (H_q / H_kv);
    b = batch;
    n = b * H_q + h;
    l0 = tile * rows_per_tile;
    kv_begin = 0;
    kv_end = S;
    if ((mask_kind & kKindBits) == kCausal) {
      kv_begin = causal_kv_begin(l0, L, S, window);
      kv_end = causal_kv_end(l0, rows_per_tile, L, S);
    }
  }
};

// Where one (batch, head)'s output rows go: row r at out + r sr; lse (not
// null: a gradient will be taken) the rows' log-sum-exp, one float a row.
template <typename T>
struct OutRows {
  T* out;
  int64_t sr;
  float* lse;
};

// Slice n's (b H_q + h) rows of the output, laid out as lay.o says, and of
// the log-sum-exp (row-contiguous over all (B H_q L) rows).
template <typename T>
__device__ __forceinline__ OutRows<T> out_rows(T* out, const Rows& o, int64_t n, int H_q, int L, float* lse) {
  return {out + o.at(n / H_q, n % H_q, 0), o.sr, lse != nullptr ? lse + n * (int64_t)L : nullptr};
}

// O = o / l for this thread's rows ra and ra + 8 of one (batch, head), l
// summed over the quad that shares a row, with the head's sink (sink2, log2
// domain; -inf: none) in the sum. Rows that saw no visible key (l = 0) are
// zeros; rows past L (the last tile's padding) are not written.
//
// 16-bit outputs, in groups of four column blocks (E = 80: blocks 8 and 9
// as 32-bit stores, below): a quad holds columns 8 eb + 2 t, +1 of
// a row for every eb (t: the thread's place in the quad). Per group of four
// eb the quad transposes its 4 x 4 pairs (two butterfly stages over lanes
// t ^ 1 and t ^ 2, two shuffles each) so that thread t holds the 8 columns
// of eb0 + t and stores them in one 16-byte store, instead of four 4-byte
// stores that fill half a sector each, which queued in the epilogue of a
// block whose warpgroups store at once.
//
// rows.lse (not null: a gradient will be taken): each row's log-sum-exp too, in
// the log2 domain with the sink in it, +inf for a row that sees no key, as
// the backward's statistics pass would take it again (backward_parts.cuh's
// lse_final), one float a row of all (B H_q L).
template <typename T, int NO>
__device__ __forceinline__ void store_rows(const float (&o)[NO][4], const float* m_i, const float* l_i,
                                           float sink2, const OutRows<T>& rows, int L, int E, int ra, int t) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float l_sum = l_i[rr];
    l_sum += __shfl_xor_sync(0xffffffffu, l_sum, 1);
    l_sum += __shfl_xor_sync(0xffffffffu, l_sum, 2);
    const bool seen = l_sum != 0.0f;
    float m = m_i[rr];
    const float a = add_sink(m, l_sum, sink2);
    const float inv = a * inverse_sum(l_sum);
    const int r = ra + rr * 8;
    if (rows.lse != nullptr && t == 0 && r < L) rows.lse[r] = row_lse(seen, m, l_sum);
    T* dst = rows.out + r * rows.sr;
    constexpr int kGrouped = sizeof(T) == 2 ? NO / 4 * 4 : 0;  // blocks stored 16 bytes a thread
    if constexpr (kGrouped > 0) {  // (float outputs: pack2 has no float form)
#pragma unroll
      for (int eb0 = 0; eb0 < kGrouped; eb0 += 4) {
        uint32_t v[4];  // v[i]: this thread's pair of block eb0 + i, then (below) thread i's of block eb0 + t
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = pack2<T>(o[eb0 + i][2 * rr] * inv, o[eb0 + i][2 * rr + 1] * inv);
        // Stage b (lane bit b): the slots whose bit b differs from t's go to
        // lane t ^ (1 << b), which sends back its slots of the same pattern.
        // After both, slot i holds thread i's pair of block eb0 + t.
        const bool t0 = t & 1, t1 = t & 2;
#pragma unroll
        for (int a = 0; a < 2; ++a) {  // slots 2a, 2a + 1: t0 gives 2a + 1 - t0
          const uint32_t got = __shfl_xor_sync(0xffffffffu, t0 ? v[2 * a] : v[2 * a + 1], 1);
          v[2 * a] = t0 ? got : v[2 * a];
          v[2 * a + 1] = t0 ? v[2 * a + 1] : got;
        }
#pragma unroll
        for (int a = 0; a < 2; ++a) {  // slots a, a + 2: t1 gives a + 2 (1 - t1)
          const uint32_t got = __shfl_xor_sync(0xffffffffu, t1 ? v[a] : v[a + 2], 2);
          v[a] = t1 ? got : v[a];
          v[a + 2] = t1 ? v[a + 2] : got;
        }
        if (r < L) *reinterpret_cast<uint4*>(dst + (eb0 + t) * 8) = make_uint4(v[0], v[1], v[2], v[3]);
      }
    }
    if (r >= L) continue;
    // The other blocks: columns 2t, 2t + 1 in one store (E is even and rows
    // start aligned: half the stores of one per element, which queued in the
    // epilogue).
#pragma unroll
    for (int eb = kGrouped; eb < NO; ++eb) {
      const float a = o[eb][2 * rr] * inv, b = o[eb][2 * rr + 1] * inv;
      if constexpr (sizeof(T) == 2) {
        *reinterpret_cast<uint32_t*>(dst + eb * 8 + 2 * t) = pack2<T>(a, b);
      } else {
        *reinterpret_cast<float2*>(dst + eb * 8 + 2 * t) = make_float2(a, b);
      }
    }
  }
}

}  // namespace fa
