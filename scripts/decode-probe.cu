// Decode on tensor cores, standalone (no MLX): split + merge in two launches
// (fa_decode_mma_split + fa_merge, as the planner launched them before the
// fused kernel) against the fused kernel (one launch, the last block of a
// group merges) at several split counts. Checks every output row against a
// float64 reference and times launches back to back with CUDA events, on the
// same K / V ("hot": in L2 where it fits, as `flash-eval kernel` times calls)
// and rotating through copies larger than L2 ("cold").
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/dp scripts/decode-probe.cu && /tmp/dp

#define FA_DTYPE 2
#define FA_E 64
#define FA_PARTIAL 2
#include "../packages/flashattn-core/csrc/cuda/kernels/decode_mma.cu"
#include "../packages/flashattn-core/csrc/cuda/kernels/generic.cu"
#include "probe/harness.cuh"

using T = __nv_bfloat16;

template <int E, bool kFused>
__global__ void __launch_bounds__(32 * fa::decode_shapes::mma_warps(E)) attend(const T* q, const T* k, const T* v, T* out, float* o_part,
                                              float* ml_part, int H_q, int H_kv, int S, int keys_per_split,
                                              float scale_log2, fa::Layout lay, unsigned long long tag) {
  fa::decode_mma<T, false, E>(q, k, v, kFused ? out : nullptr, o_part, ml_part, kFused, tag, H_q, H_kv, 1, S,
                       keys_per_split, scale_log2, lay);
}

__global__ void __launch_bounds__(fa::merge_shapes::kThreads) merge(const float* o_part, const float* ml_part,
                                                                   T* out, int rows, int E, int splits) {
  fa::merge_splits<T>(o_part, ml_part, out, rows, E, splits);
}

struct Shape {
  const char* name;
  int H_q, H_kv, E, S;
};

template <int E>
void run(const Shape& sh, int reps) {
  const int H_q = sh.H_q, H_kv = sh.H_kv, S = sh.S;
  const size_t nq = size_t(H_q) * E, nk = size_t(H_kv) * S * E;
  const size_t kv_bytes = 2 * nk * sizeof(T);
  const int copies = std::max<size_t>(1, (size_t(160) << 20) / kv_bytes + 1);  // cold: more than L2
  std::vector<T> q = probe::randn<T>(nq, 1), k = probe::randn<T>(nk, 2), v = probe::randn<T>(nk, 3);
  const float scale = 1.0f / std::sqrt(float(E));

  // float64 reference, every row
  std::vector<double> ref;
  const int ratio = H_q / H_kv;
  for (int h = 0; h < H_q; ++h) {
    const size_t kv = size_t(h / ratio) * S * E;
    const std::vector<double> o = probe::reference_row(&q[size_t(h) * E], &k[kv], &v[kv], S - 1, E, scale);
    ref.insert(ref.end(), o.begin(), o.end());
  }

  T *dq, *dkv, *dout;
  float *dpart;
  CHECK(cudaMalloc(&dq, nq * sizeof(T)));
  CHECK(cudaMalloc(&dkv, kv_bytes * copies));
  CHECK(cudaMalloc(&dout, nq * sizeof(T)));
  const int max_splits = fa::merge_shapes::kMaxSplits;
  const size_t part_floats = size_t(max_splits) * (H_q * (E + 2) + 2 * H_kv) + 2 * H_kv;  // + claims
  CHECK(cudaMalloc(&dpart, part_floats * sizeof(float)));
  CHECK(cudaMemcpy(dq, q.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
  for (int c = 0; c < copies; ++c) {
    CHECK(cudaMemcpy(dkv + 2 * nk * c, k.data(), nk * sizeof(T), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dkv + 2 * nk * c + nk, v.data(), nk * sizeof(T), cudaMemcpyHostToDevice));
  }
  // garbage where the arrival words will lie: the kernel must not trust it
  CHECK(cudaMemset(dpart, 0x5a, part_floats * sizeof(float)));
  const fa::Layout lay{{H_q * E, E, E}, {H_kv * S * E, S * E, E}, {H_kv * S * E, S * E, E}};
  unsigned long long tag = 0x123456;

  struct Variant {
    const char* name;
    bool fused;
    int splits_cap;
    bool merge = true;  // false: the split kernel alone (its share of the time)
  };
  // the planner's old rule: ~512 blocks, splits of 128-key steps
  const int old_splits = std::min(1024, std::max(1, std::min((512 + H_kv - 1) / H_kv, (S + 127) / 128)));
  const Variant variants[] = {{"split + merge", false, old_splits}, {"split alone", false, old_splits, false},
                              {"split alone", false, 32, false}, {"split alone", false, 64, false},
                              {"split alone", false, 128, false}, {"fused", true, 16}, {"fused", true, 32},
                              {"fused", true, 64}, {"fused", true, 128}};
  std::printf("%s  S=%d  bf16  K/V %.1f MB\n", sh.name, S, kv_bytes / 1e6);
  for (const Variant& var : variants) {
    int kps = (S + var.splits_cap - 1) / var.splits_cap;
    kps = (kps + 127) / 128 * 128;
    const int splits = (S + kps - 1) / kps;
    const int rows = H_q;
    auto launch = [&](int copy) {
      const T* kk = dkv + 2 * nk * copy;
      const T* vv = kk + nk;
      ++tag;
      if (var.fused) {
        attend<E, true><<<dim3(splits, H_kv, 1), 32 * fa::decode_shapes::mma_warps(E)>>>(dq, kk, vv, dout, dpart, dpart + size_t(splits) * rows * E,
                                                        H_q, H_kv, S, kps, scale * FA_LOG2E, lay, tag);
      } else {
        attend<E, false><<<dim3(splits, H_kv, 1), 32 * fa::decode_shapes::mma_warps(E)>>>(dq, kk, vv, nullptr, dpart,
                                                         dpart + size_t(splits) * rows * E, H_q, H_kv, S, kps,
                                                         scale * FA_LOG2E, lay, tag);
        if (var.merge) {
          merge<<<rows, fa::merge_shapes::kThreads>>>(dpart, dpart + size_t(splits) * rows * E, dout, rows, E,
                                                      splits);
        }
      }
    };
    // correctness: poisoned output, every element against the reference
    double err = 0;
    for (int trial = 0; trial < (var.merge ? 3 : 0); ++trial) {
      CHECK(cudaMemset(dout, 0xff, nq * sizeof(T)));
      launch(trial % copies);
      CHECK(cudaDeviceSynchronize());
      std::vector<T> got(nq);
      CHECK(cudaMemcpy(got.data(), dout, nq * sizeof(T), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < nq; ++i) {
        const double d = std::fabs(double(probe::to_float(got[i])) - ref[i]);
        err = std::isnan(d) ? INFINITY : std::max(err, d);
      }
    }
    float best[2];
    for (int cold = 0; cold < 2; ++cold) {
      cudaEvent_t a, b;
      CHECK(cudaEventCreate(&a));
      CHECK(cudaEventCreate(&b));
      std::vector<float> per;
      constexpr int kBatch = 20;
      for (int r = 0; r < reps; ++r) {
        CHECK(cudaEventRecord(a));
        for (int i = 0; i < kBatch; ++i) launch(cold ? (r * kBatch + i) % copies : 0);
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        per.push_back(ms * 1000 / kBatch);
      }
      best[cold] = probe::median(per);
    }
    std::printf("  %-14s splits %4d (%5d keys) blocks %4d  err %.1e  hot %6.2f us  cold %6.2f us (%5.0f GB/s)\n",
                var.name, splits, kps, splits * H_kv, err, best[0], best[1], kv_bytes / (best[1] * 1e3));
  }
  CHECK(cudaFree(dq));
  CHECK(cudaFree(dkv));
  CHECK(cudaFree(dout));
  CHECK(cudaFree(dpart));
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  for (int S : {8192, 32768}) run<64>({"qwen05b", 14, 2, 64, S}, reps);
  run<128>({"hd128", 32, 8, 128, 32768}, reps);
  return 0;
}
