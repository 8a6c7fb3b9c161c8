// Floors for a decode call on the GPU (no MLX): what an empty launch, a plain
// read of the call's K and V, a read by TMA bulk copies, and the fused
// tensor-core decode itself cost per launch, each timed as MLX runs them:
// 20 launches recorded in one CUDA graph, the graph launched and timed with
// CUDA events (median of reps). K / V: with one copy the same each launch
// (hot in L2, as `flash-eval kernel --kv-sets 1` times calls); with more,
// launch i reads copy i % copies (from memory, as each layer of a model reads
// its own cache and `flash-eval kernel` times calls by default), and the
// timeline's launch follows a read of the other copies (L2 holds none of its
// own).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/df scripts/decode-floor.cu
//   /tmp/df [reps] [floors 0/1] [copies] [qwen05b only 0/1] [bytes between K and V]

#include "probe/timeline.cuh"  // before the kernels: FA_MARK

#define FA_DTYPE 2
#define FA_E 64
#define FA_PARTIAL 2
#include "../packages/flashattn-core/csrc/cuda/kernels/decode_mma.cu"
#include "../packages/flashattn-core/csrc/cuda/kernels/tma.cuh"
#include "../packages/flashattn-core/csrc/cuda/kernels/pingpong.cuh"
#include "probe/harness.cuh"
#include "probe/read.cuh"

using T = __nv_bfloat16;

// Bytes between K and V in each copy (argv[5]; default none).
size_t g_gap_bytes = 0;

__global__ void empty_kernel(uint32_t* sink) {
  if (sink != nullptr && threadIdx.x == 1023) sink[0] = 0;
}

// Block b copies its share (bytes a multiple of 16 * grid) into shared
// memory by 1-d bulk copies of `chunk` bytes, all issued at once by thread
// 0; every warp waits for them all and reads one word of each.
__global__ void bulk_kernel(const char* __restrict__ src, size_t bytes, int chunk, uint32_t* sink) {
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t bar;
  const size_t per = bytes / gridDim.x;
  const char* mine = src + blockIdx.x * per;
  if (threadIdx.x == 0) {
    fa::mbar_init(&bar, 1);
    fa::fence_mbar_init();
    fa::mbar_arrive_expect_tx(&bar, uint32_t(per));
    for (size_t off = 0; off < per; off += chunk) {
      probe::bulk_copy(smem + off, mine + off, uint32_t(min(size_t(chunk), per - off)), &bar);
    }
  }
  __syncthreads();
  fa::mbar_wait(&bar, 0);
  uint32_t acc = 0;
  for (size_t off = threadIdx.x * 16; off < per; off += 16 * blockDim.x) acc ^= *reinterpret_cast<uint32_t*>(smem + off);
  if (acc == 0x12345678u) sink[0] = acc;
}

// W warps, U chunks of keys in flight a warp; NP: each pass asks the next
// into L2; F256: the loads ask L2 for 256 bytes (decode_shapes.h has the
// shipped choices); fused: merged in the launch, else the splits' partials
// alone (the merge's share of the time).
template <int E, int W, int U, bool kFused, bool NP = fa::decode_shapes::mma_prefetch_next_pass(E),
          bool F256 = fa::decode_shapes::mma_fetch_256(E)>
__global__ void __launch_bounds__(32 * W) decode_kernel(const T* q, const T* k, const T* v, T* out, float* o_part,
                                                        float* ml_part, int H_q, int H_kv, int S, int keys_per_split,
                                                        float scale_log2, fa::Layout lay, unsigned long long tag) {
  fa::decode_mma<T, false, E, W, U, NP, F256>(q, k, v, kFused ? out : nullptr, o_part, ml_part, kFused, tag, H_q, H_kv, 1, S,
                              keys_per_split, scale_log2, lay);
}

// One shape's floors (when asked) and decode variants: variants(variant)
// runs the decode kernels to time, variant(name, kernel, warps, splits,
// fused, timeline).
template <int E, typename Variants>
void shape(const char* name, int H_q, int H_kv, int S, bool floors, int copies, int reps, int sms, uint32_t* sink,
           Variants variants) {
  const size_t nk = size_t(H_kv) * S * E, bytes = 2 * nk * sizeof(T);
  std::vector<T> q = probe::randn<T>(size_t(H_q) * E, 1), kv = probe::randn<T>(2 * nk, 2);
  T *dq, *dkv, *dout;
  float* dpart;
  CHECK(cudaMalloc(&dq, q.size() * sizeof(T)));
  // Copy c: K, then g_gap_bytes, then V (by default V right after K, 2^k
  // bytes on from it at these shapes).
  const size_t gap = g_gap_bytes / sizeof(T), stride = 2 * nk + gap;
  auto kv_of = [&](int i) { return dkv + size_t(i % copies) * stride; };
  auto v_of = [&](int i) { return kv_of(i) + nk + gap; };
  CHECK(cudaMalloc(&dkv, stride * sizeof(T) * copies));
  CHECK(cudaMalloc(&dout, q.size() * sizeof(T)));
  const size_t part_bytes = (size_t(128) * (H_q * (E + 2) + 2 * H_kv) + 64) * sizeof(float);
  CHECK(cudaMalloc(&dpart, part_bytes));
  CHECK(cudaMemcpy(dq, q.data(), q.size() * sizeof(T), cudaMemcpyHostToDevice));
  for (int c = 0; c < copies; ++c) {
    CHECK(cudaMemcpy(kv_of(c), kv.data(), bytes / 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(v_of(c), kv.data() + nk, bytes / 2, cudaMemcpyHostToDevice));
  }
  std::printf("%s S=%d: K/V %.1f MB, %d cop%s\n", name, S, bytes / 1e6, copies, copies == 1 ? "y" : "ies");
  for (int grid : {sms, 2 * sms, 4 * sms}) {
    if (!floors) break;
    for (int threads : {256, 512}) {
      const float t = probe::graph_us(
          [&](cudaStream_t s, int i) {
            read_kernel<8><<<grid, threads, 0, s>>>(reinterpret_cast<const uint4*>(kv_of(i)), bytes / 16, sink);
          },
          reps);
      std::printf("  read, %4d blocks x %3d threads, 8 x 16 B in flight   %6.2f us  %6.0f GB/s\n", grid, threads, t,
                  bytes / (t * 1e3));
    }
  }
  for (int grid : {128, 256, 512}) {
    if (!floors) break;
    const size_t per = bytes / grid;
    if (per > 200 * 1024) continue;
    CHECK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    for (int chunk : {4096, 16384}) {
      const float t = probe::graph_us(
          [&](cudaStream_t s, int i) {
            bulk_kernel<<<grid, 128, per, s>>>(reinterpret_cast<const char*>(kv_of(i)), bytes, chunk, sink);
          },
          reps);
      std::printf("  bulk, %4d blocks, %6zu B each in %5d B copies         %6.2f us  %6.0f GB/s\n", grid, per, chunk,
                  t, bytes / (t * 1e3));
    }
  }
  const fa::Layout lay{{H_q * E, E, E}, {H_kv * S * E, S * E, E}, {H_kv * S * E, S * E, E}};
  const float scale_log2 = FA_LOG2E / 8.0f;
  std::vector<double> ref;
  for (int h = 0; h < H_q; ++h) {
    const size_t at = size_t(h / (H_q / H_kv)) * S * E;
    const std::vector<double> o =
        probe::reference_row(&q[size_t(h) * E], &kv[at], &kv[nk + at], S - 1, E, 0.125f);
    ref.insert(ref.end(), o.begin(), o.end());
  }
  // Before a timeline's launch on copy 0: the other copies read through L2
  // (L2 then holds none of copy 0, as when each layer reads its own cache).
  auto read_others = [&] {
    if (copies > 1)
      read_kernel<8><<<4 * sms, 512>>>(reinterpret_cast<const uint4*>(kv_of(1)), (copies - 1) * stride * sizeof(T) / 16,
                                       sink);
  };
  auto variant = [&](const char* name, auto kernel, int warps, int splits, bool fused, bool timeline = false) {
    const int kps = (S + splits - 1) / splits;
    auto launch = [&](cudaStream_t s, int i) {
      kernel<<<dim3(splits, H_kv), 32 * warps, 0, s>>>(dq, kv_of(i), v_of(i), dout, dpart,
                                                       dpart + size_t(splits) * H_q * E, H_q, H_kv, S, kps,
                                                       scale_log2, lay, 0x100 + i);
    };
    double err = 0;
    if (fused) {
      CHECK(cudaMemset(dpart, 0, part_bytes));
      CHECK(cudaMemset(dout, 0xff, q.size() * sizeof(T)));
      launch(0, 0);
      CHECK(cudaDeviceSynchronize());
      std::vector<T> got(q.size());
      CHECK(cudaMemcpy(got.data(), dout, got.size() * sizeof(T), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < got.size(); ++i) {
        const double d = std::fabs(double(probe::to_float(got[i])) - ref[i]);
        err = std::isnan(d) ? INFINITY : std::max(err, d);
      }
    }
    const float t = probe::graph_us(launch, reps, dpart, part_bytes);
    if (timeline) {
      probe::print_timeline(splits * H_kv, [&] {
        CHECK(cudaMemset(dpart, 0, part_bytes));
        read_others();  // then copy 0's launch
        launch(0, copies * 7);
      });
    }
    std::printf("  %-28s %2d warps, %3d splits  err %.1e  %6.2f us  %6.0f GB/s\n", name, warps, splits, err, t,
                bytes / (t * 1e3));
  };
  // A plain read of as many bytes (K's first; with a gap, not all of V) by
  // as many blocks as the decode's (128 x 256 threads), timed as its
  // timeline is (marks 0 and 1: start, end). (read_kernel's loads are
  // unrolled, but the compiler folds them as they come: 33-38 registers a
  // thread, a few loads in flight, where the decode holds its 32.)
  if (S == 32768) {
    auto read_timeline = [&](const char* what, auto kernel) {
      const float t = probe::graph_us(
          [&](cudaStream_t s, int i) {
            kernel<<<128, 256, 0, s>>>(reinterpret_cast<const uint4*>(kv_of(i)), bytes / 16, sink);
          },
          reps);
      std::printf("  a plain read, 128 blocks x 256 threads, %s: %6.2f us a launch; timeline:\n", what, t);
      probe::print_timeline(128, [&] {
        read_others();
        kernel<<<128, 256>>>(reinterpret_cast<const uint4*>(kv_of(0)), bytes / 16, sink);
      });
    };
    read_timeline("8 x 16 B loads a thread unrolled", read_kernel<8>);
    read_timeline("32 x 16 B loads a thread unrolled", read_kernel<32>);
  }
  variants(variant);
  CHECK(cudaFree(dq));
  CHECK(cudaFree(dkv));
  CHECK(cudaFree(dout));
  CHECK(cudaFree(dpart));
}

int main(int argc, char** argv) {
  const probe::FloorStart start = probe::floor_start(argc, argv);
  const int reps = start.reps, sms = start.sms;
  uint32_t* const sink = start.sink;
  std::printf("empty kernel, 132 x 128 threads        %6.2f us\n",
              probe::graph_us([&](cudaStream_t s, int) { empty_kernel<<<sms, 128, 0, s>>>(sink); }, reps));
  const bool floors = argc > 2 && std::atoi(argv[2]) != 0;
  const int copies = argc > 3 ? std::max(1, std::atoi(argv[3])) : 1;
  if (argc > 5) g_gap_bytes = size_t(std::atol(argv[5]) / 16 * 16);
  if (g_gap_bytes != 0) std::printf("K and V %zu bytes apart past K's end\n", g_gap_bytes);
  for (int S : {8192, 32768}) {
    shape<64>("qwen05b", 14, 2, S, floors, copies, reps, sms, sink, [&](auto variant) {
      for (int splits : {32, 64}) {
        variant("fused W4 U1", decode_kernel<64, 4, 1, true, true, false>, 4, splits, true, false);
        variant("fused W8 U2 plain loads", decode_kernel<64, 8, 2, true, true, false>, 8, splits, true, false);
        variant("fused W8 U2 (shipped)", decode_kernel<64, 8, 2, true>, 8, splits, true, splits == 64);
        variant("split alone W8 U2", decode_kernel<64, 8, 2, false>, 8, splits, false, false);
      }
    });
  }
  if (argc > 4 && std::atoi(argv[4]) != 0) return 0;  // qwen05b only
  for (int S : {8192, 32768}) {
    shape<128>("hd128", 32, 8, S, floors && S == 32768, copies, reps, sms, sink, [&](auto variant) {
      for (int splits : {16, 32, 64}) {
        variant("fused W4 U1", decode_kernel<128, 4, 1, true, true, false>, 4, splits, true, false);
        variant("fused W4 U2 prefetch 1 pass", decode_kernel<128, 4, 2, true, true, false>, 4, splits, true, false);
        variant("fused W4 U2 L2::256B loads", decode_kernel<128, 4, 2, true, false, true>, 4, splits, true, false);
        variant("fused W4 U2 (shipped)", decode_kernel<128, 4, 2, true>, 4, splits, true, splits == 32);
        variant("split alone W4 U2", decode_kernel<128, 4, 2, false>, 4, splits, false, false);
      }
    });
  }
  return 0;
}
