// Block timeline of the Hopper 16-bit prefill kernel (prefill_f16_wg.cu),
// standalone (no MLX), at E = 128 and at E = 64: each block records its SM
// and its start and end (clock64 and %globaltimer, thread 0, written straight to global memory
// so that no register stays live across the kernel). Printed per launch
// shape: the span, how busy the SMs were, the gaps between blocks on one SM,
// how long the SMs that finished first sat idle (the tail), and block
// durations per key/value tile. For work outside the tile loop (prologue,
// epilogue, scheduling) that kernel-level timings cannot separate.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a [-DFA_NO_MARKS] -o /tmp/tl benchmarks/cuda-probes/prefill-timeline.cu && /tmp/tl [short|f32|steps]

#define FA_DTYPE 2
#define FA_E 128
#include <algorithm>
#include <climits>
#include <cstring>
#include <map>

// Marks inside a block (prefill_f16_wg.cu's FA_TIMELINE_MARK), clock64 of
// the first consumer thread (the producer's copying thread for mark 6):
// 1 item 0's Q and first tile copied, 2 an item's Q landed, 3 the last Q K^T
// and softmax done, 4 the last P V done, 5 the rows stored, 6 the producer
// has its tensor maps. The first consumer thread also sums, per mark, the
// cycles since its mark before (s_seg): where a block of many row tiles
// (one block per SM) spends them, item by item.
constexpr int kMarks = 8;
__device__ long long* g_marks;
__device__ long long* g_segs;
__shared__ long long s_seg[kMarks], s_last;
#ifndef FA_NO_MARKS  // -DFA_NO_MARKS: none (their registers made the float32 overlap spill)
#define FA_TIMELINE_MARK(k)                                                                       \
  do {                                                                                            \
    if (threadIdx.x == 0 || ((k) == 6 && threadIdx.x % 128 == 0)) {                               \
      const long long c_ = clock64();                                                             \
      g_marks[(blockIdx.x + gridDim.x * blockIdx.y) * kMarks + (k)] = c_;                         \
      if (threadIdx.x == 0) {                                                                     \
        if ((k) != 1) s_seg[k] += c_ - s_last;                                                    \
        s_last = c_;                                                                              \
      }                                                                                           \
    }                                                                                             \
  } while (0)
#endif
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_f16_wg.cu"
#include "harness.cuh"

using T = __nv_bfloat16;

struct Record {
  long long c0, c1, g0, g1;  // clock64 and globaltimer at start and end
  int sm, pad;
};
__device__ Record* g_records;

__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int sm_id() {
  int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// The shipped shapes (wg_shapes.h: G consumer warpgroups, the producer, key
// tiles of 128) with ITEMS = 1 (a row tile a block) or 2 (one block per SM,
// `slices` > 0).
// F32: the float32 attention over 16-bit inputs (fa_prefill_wg32_*: no
// overlap, a float32 output).
// OV: the overlap as the kernels take it (-1), or forced off (0) / on (1).
template <int E, int G, int ITEMS, bool F32 = false, int OV = -1>
using Shape = fa::WhShape<G, 128, OV < 0 ? fa::wg_shapes::f16_overlap(E, F32, true) : OV == 1, ITEMS>;

template <int E, int G, int ITEMS, bool F32 = false, int OV = -1>
__global__ void __launch_bounds__(128 * (G + 1), 1) timed(const T* q, const T* k, const T* v, const void* mask,
                                                const int64_t* mask_base, void* out, int H_q, int H_kv, int L, int S,
                                                int mask_kind, int mask_rs, int mask_cs, float scale_log2,
                                                int slices, int split_from, int splits, FA_LAYOUT_PARAMS,
                                                const void* map_template, void* scratch, unsigned long long tag) {
  const int b = blockIdx.x + gridDim.x * blockIdx.y;
  if (threadIdx.x == 0) {
    g_records[b].c0 = clock64(), g_records[b].g0 = global_ns();
    for (int k = 0; k < kMarks; ++k) s_seg[k] = 0;
  }
  using TO = std::conditional_t<F32, float, T>;
  fa::prefill_wg<T, E, Shape<E, G, ITEMS, F32, OV>, F32>(q, k, v, mask, mask_base, static_cast<TO*>(out), nullptr, H_q, H_kv, L,
                                                     S, mask_kind, mask_rs, mask_cs, scale_log2, slices, split_from,
                                                     splits, FA_LAYOUT, static_cast<const fa::MapTemplate*>(map_template),
                                                     scratch, tag);
  __syncthreads();
  if (threadIdx.x == 0) {
    Record& r = g_records[blockIdx.x + gridDim.x * blockIdx.y];
    r.c1 = clock64(), r.g1 = global_ns(), r.sm = sm_id();
    for (int k = 0; k < kMarks; ++k) g_segs[b * kMarks + k] = s_seg[k];
  }
}

// L query rows against S keys (causal: the rows are the last L of S).
// splits > 1 (ITEMS = 1): row tiles past the first split_from in that many
// key pieces, a block each (key_split.cuh).
template <int E, int G, int ITEMS, bool F32 = false, int OV = -1>
void timeline(const char* name, int H_q, int H_kv, int L, int S, int causal, int reps, int split_from = 0,
              int splits = 0) {
  constexpr int Br = 64 * G, Bc = 128, threads = 128 * (G + 1);
  const int row_tiles = (L + Br - 1) / Br;
  const size_t nq = size_t(H_q) * L * E, nk = size_t(H_kv) * S * E;
  const std::vector<T> q = probe::randn<T>(nq, 1), k = probe::randn<T>(nk, 2), v = probe::randn<T>(nk, 3);
  T *dq, *dk, *dv, *dout;
  Record* drec;
  CHECK(cudaMalloc(&dq, nq * sizeof(T)));
  CHECK(cudaMalloc(&dk, nk * sizeof(T)));
  CHECK(cudaMalloc(&dv, nk * sizeof(T)));
  CHECK(cudaMalloc(&dout, nq * (F32 ? 4 : sizeof(T))));
  CHECK(cudaMemcpy(dq, q.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, k.data(), nk * sizeof(T), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv, v.data(), nk * sizeof(T), cudaMemcpyHostToDevice));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const bool split = splits > 1;
  const int units = row_tiles * H_q;
  const dim3 grid = ITEMS == 2 ? dim3(std::min(units, sms), 1)
                    : split    ? dim3(split_from + (units - split_from) * splits, 1)
                               : dim3(row_tiles, H_q);
  const int blocks = grid.x * grid.y;
  CHECK(cudaMalloc(&drec, blocks * sizeof(Record)));
  CHECK(cudaMemcpyToSymbol(g_records, &drec, sizeof(drec)));
  long long* dmarks;
  CHECK(cudaMalloc(&dmarks, blocks * kMarks * sizeof(long long)));
  CHECK(cudaMemset(dmarks, 0, blocks * kMarks * sizeof(long long)));
  CHECK(cudaMemcpyToSymbol(g_marks, &dmarks, sizeof(dmarks)));
  long long* dsegs;
  CHECK(cudaMalloc(&dsegs, blocks * kMarks * sizeof(long long)));
  CHECK(cudaMemcpyToSymbol(g_segs, &dsegs, sizeof(dsegs)));
  // The TMA copies' map template, then scratch: the maps' slots, the pieces' tickets and states.
  unsigned char* templ = nullptr;
  {
    alignas(64) unsigned char host[128];
    probe::map_template<T>(host);
    CHECK(cudaMalloc(&templ, 128));
    CHECK(cudaMemcpy(templ, host, 128, cudaMemcpyHostToDevice));
  }
  void* scratch = nullptr;
  const size_t scratch_bytes = fa::wg_shapes::kMapSlots * fa::wg_shapes::kMapSlotBytes +
      (split ? fa::wg_shapes::split_scratch_bytes(units - split_from, splits, E, G) : 0);
  CHECK(cudaMalloc(&scratch, scratch_bytes));
  CHECK(cudaMemset(scratch, 0, scratch_bytes));
  unsigned long long tag = 1;  // a new one each launch: the tickets stay in scratch
  const int smem = sizeof(fa::WhSmem<T, E, Shape<E, G, ITEMS, F32, OV>>);
  CHECK(cudaFuncSetAttribute(timed<E, G, ITEMS, F32, OV>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const float scale_log2 = 1.4426950408889634f / std::sqrt(float(E));
  const float med = probe::median_ms(
      [&] {
        timed<E, G, ITEMS, F32, OV><<<grid, threads, smem>>>(dq, dk, dv, dq, nullptr, dout, H_q, H_kv, L, S, causal, 0,
                                                    causal ? fa::kNoWindow : 0, scale_log2,
                                                    ITEMS == 2 || split ? H_q : 0, split_from, splits,
                                                    H_q * L * E, L * E, E, H_kv * S * E, S * E, E, H_kv * S * E,
                                                    S * E, E, H_q * L * E, L * E, E, templ, scratch, tag++);
      },
      reps);
  std::vector<Record> rec(blocks);  // the last launch's
  CHECK(cudaMemcpy(rec.data(), drec, blocks * sizeof(Record), cudaMemcpyDeviceToHost));

  long long first = LLONG_MAX, last = 0;
  for (const Record& r : rec) first = std::min(first, r.g0), last = std::max(last, r.g1);
  std::map<int, std::vector<Record>> per_sm;
  for (const Record& r : rec) per_sm[r.sm].push_back(r);
  double busy = 0, gaps = 0, tail = 0, cycles = 0;
  int n_gaps = 0;
  for (auto& [sm, list] : per_sm) {
    std::sort(list.begin(), list.end(), [](const Record& x, const Record& y) { return x.g0 < y.g0; });
    for (size_t i = 0; i < list.size(); ++i) {
      busy += list[i].g1 - list[i].g0;
      cycles += list[i].c1 - list[i].c0;
      if (i > 0) gaps += list[i].g0 - list[i - 1].g1, ++n_gaps;
    }
    tail += last - list.back().g1;
  }
  const double span = last - first, n_sm = per_sm.size();
  std::printf("%s: median %.3f ms; last launch: %d blocks on %d SMs over %.1f us, clock %.0f MHz\n", name,
              med, blocks, int(n_sm), span / 1e3, cycles / busy * 1e3);
  std::printf("  SMs busy %.1f%% of the span; gaps between blocks %.2f us (%d); idle after their last block %.2f us "
              "a SM\n",
              100 * busy / (span * n_sm), n_gaps ? gaps / n_gaps / 1e3 : 0.0, n_gaps, tail / n_sm / 1e3);
  // Key/value tiles of each block (the kernel's schedule, restated).
  std::vector<long long> tiles(blocks, 0);
  auto tiles_of_row_tile = [&](int p) {
    const int kv_end = causal ? fa::causal_kv_end(p * Br, Br, L, S) : S;
    return (kv_end + Bc - 1) / Bc;
  };
  if (ITEMS == 2) {
    const long long units = (long long)row_tiles * H_q, P = grid.x;
    for (int bx = 0; bx < blocks; ++bx)
      for (long long i = 0;; ++i) {
        const long long u = i * P + (i % 2 == 0 ? bx : P - 1 - bx);
        if (u >= units) break;
        tiles[bx] += tiles_of_row_tile(row_tiles - 1 - int(u / H_q));
      }
  } else {
    for (int i = 0; i < blocks; ++i) {  // PrefillBlock: heaviest first across the slices
      const long long at = split ? i - split_from : -1, j = at < 0 ? i : split_from + at / splits;
      const int n = tiles_of_row_tile(row_tiles - 1 - int(j / H_q)), piece = at < 0 ? 0 : int(at % splits);
      tiles[i] = at < 0 ? n
                        : std::max(1, fa::wg_shapes::piece_first_tile(n, piece + 1, splits) -
                                          fa::wg_shapes::piece_first_tile(n, piece, splits));
    }
  }
  std::vector<float> per_tile;
  for (int i = 0; i < blocks; ++i) per_tile.push_back(float(rec[i].c1 - rec[i].c0) / tiles[i]);
  // cycles = fixed + per_tile x tiles, least squares over the blocks: a
  // block's part outside its tile loop, which short sequences pay most.
  double sx = 0, sy = 0, sxx = 0, sxy = 0, longest = 0;
  for (int i = 0; i < blocks; ++i) {
    const double x = double(tiles[i]), y = double(rec[i].c1 - rec[i].c0);
    sx += x, sy += y, sxx += x * x, sxy += x * y;
    longest = std::max(longest, double(rec[i].g1 - rec[i].g0));
  }
  const double slope = (blocks * sxy - sx * sy) / (blocks * sxx - sx * sx), fixed = (sy - slope * sx) / blocks;
  std::printf("  fit: %.0f cycles a block + %.0f a key/value tile; longest block %.2f us\n", fixed, slope,
              longest / 1e3);
  std::sort(per_tile.begin(), per_tile.end());
#ifdef FA_NO_MARKS
  if (false) {
#else
  if (ITEMS == 1) {  // the marks' mean cycles from the block's start (blocks of >= 2 tiles)
#endif
    std::vector<long long> marks(size_t(blocks) * kMarks);
    CHECK(cudaMemcpy(marks.data(), dmarks, marks.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    double sum[kMarks] = {}, end = 0, tiles_sum = 0;
    int n = 0;
    for (int i = 0; i < blocks; ++i) {
      if (tiles[i] < 2) continue;
      ++n, tiles_sum += tiles[i], end += rec[i].c1 - rec[i].c0;
      for (int k = 1; k < 7; ++k) sum[k] += marks[size_t(i) * kMarks + k] - rec[i].c0;
    }
    std::printf("  marks (mean cycles from the start, %d blocks of %.1f tiles): copied %.0f, last "
                "softmax %.0f, last PV %.0f, stored %.0f, end %.0f; producer's maps %.0f\n",
                n, tiles_sum / n, sum[1] / n, sum[3] / n, sum[4] / n, sum[5] / n, end / n, sum[6] / n);
  }
#ifndef FA_NO_MARKS
  if (ITEMS == 2) {  // the segments' mean cycles a block, and a block's items and tiles
    std::vector<long long> segs(size_t(blocks) * kMarks);
    CHECK(cudaMemcpy(segs.data(), dsegs, segs.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    double sum[kMarks] = {}, end = 0, tiles_sum = 0;
    for (int i = 0; i < blocks; ++i) {
      tiles_sum += tiles[i], end += rec[i].c1 - rec[i].c0;
      for (int k = 2; k < 6; ++k) sum[k] += segs[size_t(i) * kMarks + k];
    }
    const double items = double(row_tiles) * H_q / blocks;
    std::printf("  segments (cycles a block of %.1f items, %.1f tiles; a block %.0f): to Q landed %.0f, "
                "tiles %.0f (%.0f a tile), last PV %.0f, store %.0f; a item's end %.0f\n",
                items, tiles_sum / blocks, end / blocks, sum[2] / blocks, sum[3] / blocks, sum[3] / tiles_sum,
                sum[4] / blocks, sum[5] / blocks, (sum[2] + sum[4] + sum[5]) / blocks / items);
  }
#endif
  std::printf("  cycles per key/value tile of a block: min %.0f, median %.0f, max %.0f\n", per_tile.front(),
              per_tile[per_tile.size() / 2], per_tile.back());
  CHECK(cudaFree(dq));
  CHECK(cudaFree(dk));
  CHECK(cudaFree(dv));
  CHECK(cudaFree(dout));
  CHECK(cudaFree(drec));
  CHECK(cudaFree(dmarks));
  CHECK(cudaFree(dsegs));
  CHECK(cudaFree(scratch));
  CHECK(cudaFree(templ));
}

// short: causal prompts of 2K-4K tokens (and 8K to compare), where the
// blocks' part outside their tile loop weighs most; otherwise the launch
// shapes of long prompts, mlx-lm's chunks and key splits.
int main(int argc, char** argv) {
  probe::print_gpu();
  if (argc > 1 && std::strcmp(argv[1], "f32") == 0) {  // float32 over bfloat16 at E = 64: the overlap off / on
    for (int rep = 0; rep < 2; ++rep) {
      timeline<64, 2, 1, true, 0>("qwen05b chunk L=2048 S=8192, f32 over bf16, no overlap", 14, 2, 2048, 8192, 1, 30);
      timeline<64, 2, 1, true, 1>("qwen05b chunk L=2048 S=8192, f32 over bf16, overlap", 14, 2, 2048, 8192, 1, 30);
      timeline<64, 2, 1, true, 0>("qwen05b causal 8K, f32 over bf16, no overlap", 14, 2, 8192, 8192, 1, 20);
      timeline<64, 2, 1, true, 1>("qwen05b causal 8K, f32 over bf16, overlap", 14, 2, 8192, 8192, 1, 20);
    }
    return 0;
  }
  // steps: the shipped shapes whose key-tile step the softmax sets (docs/cuda.md's
  // softmax without a tile maximum was measured on these), twice.
  if (argc > 1 && std::strcmp(argv[1], "steps") == 0) {
    for (int rep = 0; rep < 2; ++rep) {
      timeline<64, 3, 1, true>("f32/bf16 qwen05b chunk L=2048 S=16384", 14, 2, 2048, 16384, 1, 20);
      timeline<64, 3, 1, true>("f32/bf16 qwen05b chunk L=2048 S=8192", 14, 2, 2048, 8192, 1, 20);
      timeline<64, 3, 1, true>("f32/bf16 qwen05b causal 8K", 14, 2, 8192, 8192, 1, 20);
      timeline<64, 3, 1>("bf16 qwen05b chunk L=2048 S=16384", 14, 2, 2048, 16384, 1, 20);
      timeline<64, 3, 1>("bf16 qwen05b causal 8K", 14, 2, 8192, 8192, 1, 20);
      timeline<128, 2, 2>("bf16 hd128 causal 8K", 32, 8, 8192, 8192, 1, 10);
      timeline<128, 2, 2>("bf16 hd128 causal 2K", 32, 8, 2048, 2048, 1, 30);
    }
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "short") == 0) {
    timeline<64, 3, 1>("qwen05b causal 2K, three consumers", 14, 2, 2048, 2048, 1, 50);
    timeline<64, 2, 1>("qwen05b causal 2K, two consumers", 14, 2, 2048, 2048, 1, 50);
    timeline<64, 2, 2>("qwen05b causal 2K, two consumers, one block per SM", 14, 2, 2048, 2048, 1, 50);
    timeline<64, 3, 1>("qwen05b causal 4K, three consumers", 14, 2, 4096, 4096, 1, 50);
    timeline<64, 2, 1>("qwen05b causal 4K, two consumers", 14, 2, 4096, 4096, 1, 50);
    timeline<64, 3, 1>("qwen05b causal 8K, three consumers", 14, 2, 8192, 8192, 1, 20);
    timeline<128, 2, 2>("hd128 causal 2K, one block per SM", 32, 8, 2048, 2048, 1, 50);
    timeline<128, 2, 1>("hd128 causal 2K, a row tile a block", 32, 8, 2048, 2048, 1, 50);
    timeline<128, 2, 2>("hd128 causal 4K, one block per SM", 32, 8, 4096, 4096, 1, 20);
    return 0;
  }
  timeline<128, 2, 2>("hd128 causal 4K, one block per SM", 32, 8, 4096, 4096, 1, 20);
  timeline<128, 2, 1>("hd128 causal 4K, a row tile a block", 32, 8, 4096, 4096, 1, 20);
  timeline<128, 2, 2>("hd128 full 4K, one block per SM", 32, 8, 4096, 4096, 0, 20);
  timeline<128, 2, 2>("hd128 causal 8K, one block per SM", 32, 8, 8192, 8192, 1, 10);
  // mlx-lm's prefill chunks (2048 rows against every key so far): at E = 64
  // a row tile a block, 11 x 14 = 154 blocks on an H200's 132 SMs.
  timeline<64, 3, 1>("qwen05b causal 8K, a row tile a block", 14, 2, 8192, 8192, 1, 20);
  timeline<64, 3, 1>("qwen05b chunk L=2048 S=4096", 14, 2, 2048, 4096, 1, 20);
  timeline<64, 3, 1>("qwen05b chunk L=2048 S=8192", 14, 2, 2048, 8192, 1, 20);
  // The same chunk in row tiles of 128 (two consumers): 224 blocks, or one
  // block per SM taking a share of them.
  timeline<64, 2, 1>("qwen05b chunk L=2048 S=8192, 2 consumers", 14, 2, 2048, 8192, 1, 20);
  timeline<64, 2, 2>("qwen05b chunk L=2048 S=8192, 2 consumers, one block per SM", 14, 2, 2048, 8192, 1, 20);
  timeline<128, 2, 2>("hd128 chunk L=2048 S=4096, one block per SM", 32, 8, 2048, 4096, 1, 20);
  // Key splits of the last row tiles (wg_launch.cpp's choices on an H200 and others).
  for (int splits : {4, 6, 8}) {
    char name[96];
    std::snprintf(name, sizeof name, "qwen05b chunk L=2048 S=8192, last 22 row tiles in %d pieces", splits);
    timeline<64, 3, 1>(name, 14, 2, 2048, 8192, 1, 20, 132, splits);
  }
  timeline<64, 3, 1>("qwen05b L=200 S=32768", 14, 2, 200, 32768, 1, 20);
  // The patch's float32 attention over the same 16-bit chunk (two consumers, row tiles of 128: 224 blocks).
  timeline<64, 2, 1, true>("qwen05b chunk L=2048 S=8192, float32 over bfloat16", 14, 2, 2048, 8192, 1, 20);
  for (int splits : {2, 4}) {
    char name[96];
    std::snprintf(name, sizeof name, "  the same, last 92 row tiles in %d pieces", splits);
    timeline<64, 2, 1, true>(name, 14, 2, 2048, 8192, 1, 20, 132, splits);
  }
  timeline<64, 3, 1>("qwen05b L=200 S=32768, 9 pieces a row tile", 14, 2, 200, 32768, 1, 20, 0, 9);
  return 0;
}
