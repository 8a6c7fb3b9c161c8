// Standalone probe of the float32 prefill kernels, without MLX: both kernels
// (prefill_tf32.cu on mma.sync, prefill_tf32_wg.cu on wgmma) on the same
// random inputs, checked against a float64 reference on sampled rows and
// timed with CUDA events. For kernel work on a GPU machine where installing
// MLX's CUDA build would cost more than the build itself:
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/probe scripts/prefill-probe.cu && /tmp/probe
//
// The full suite (scripts/cuda-check) remains the correctness test.

#define FA_DTYPE 0
#define FA_E 64
#include "../packages/flashattn-core/csrc/cuda/kernels/prefill_tf32.cu"
#include "../packages/flashattn-core/csrc/cuda/kernels/prefill_tf32_wg.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

namespace {

constexpr int E = 64;

struct Case {
  int H_q, H_kv, L, S, kind;  // kind: 0 none, 1 causal
  int nan_key;                // >= 0: V row of this key (head 0) is NaN
};

std::vector<float> randn(size_t n, uint64_t seed) {
  std::vector<float> x(n);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  auto u = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return ((s >> 11) + 0.5) / 9007199254740992.0;
  };
  for (size_t i = 0; i < n; ++i) x[i] = float(std::sqrt(-2 * std::log(u())) * std::cos(6.283185307179586 * u()));
  return x;
}

using Kernel = void (*)(const float*, const float*, const float*, const void*, const int64_t*, float*, int, int,
                        int, int, int, int, int, float, int, int, int, int, int, int, int, int, int);

struct Launch {
  const char* name;
  Kernel fn;
  int rows, threads, smem;
};

float median(std::vector<float> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

void run(const Case& c, const std::vector<Launch>& launches, int reps) {
  const size_t nq = size_t(c.H_q) * c.L * E, nk = size_t(c.H_kv) * c.S * E;
  std::vector<float> q = randn(nq, 1), k = randn(nk, 2), v = randn(nk, 3);
  if (c.nan_key >= 0)
    for (int e = 0; e < E; ++e) v[size_t(c.nan_key) * E + e] = NAN;
  float *dq, *dk, *dv, *dout;
  CHECK(cudaMalloc(&dq, nq * 4));
  CHECK(cudaMalloc(&dk, nk * 4));
  CHECK(cudaMalloc(&dv, nk * 4));
  CHECK(cudaMalloc(&dout, nq * 4));
  CHECK(cudaMemcpy(dq, q.data(), nq * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, k.data(), nk * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv, v.data(), nk * 4, cudaMemcpyHostToDevice));
  const double scale = 1.0 / std::sqrt(double(E));
  const float scale_log2 = float(scale * 1.4426950408889634);
  const int ratio = c.H_q / c.H_kv, offset = c.S - c.L;

  // Sampled (head, row) pairs and their float64 reference.
  std::vector<std::pair<int, int>> picks;
  for (int h : {0, c.H_q / 2, c.H_q - 1})
    for (int i = 0; i < 12; ++i) picks.push_back({h, int((long long)(c.L - 1) * i / 11)});
  if (c.nan_key >= 0)
    for (int r : {c.nan_key - offset - 1, c.nan_key - offset})
      if (r >= 0 && r < c.L) picks.push_back({0, r});
  std::vector<std::vector<double>> ref;
  for (auto [h, r] : picks) {
    const int kvh = h / ratio;
    const int last = c.kind == 1 ? std::min(c.S - 1, r + offset) : c.S - 1;
    std::vector<double> sc(last + 1), o(E, 0.0);
    double m = -INFINITY, l = 0;
    for (int j = 0; j <= last; ++j) {
      double d = 0;
      for (int e = 0; e < E; ++e) d += double(q[(size_t(h) * c.L + r) * E + e]) * k[(size_t(kvh) * c.S + j) * E + e];
      sc[j] = d * scale;
      m = std::max(m, sc[j]);
    }
    for (int j = 0; j <= last; ++j) {
      const double p = std::exp(sc[j] - m);
      l += p;
      for (int e = 0; e < E; ++e) o[e] += p * v[(size_t(kvh) * c.S + j) * E + e];
    }
    for (auto& x : o) x /= l;
    ref.push_back(o);
  }

  std::printf("H_q %d H_kv %d L %d S %d %s%s\n", c.H_q, c.H_kv, c.L, c.S, c.kind ? "causal" : "none",
              c.nan_key >= 0 ? " (a NaN value row)" : "");
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (const auto& ln : launches) {
    CHECK(cudaFuncSetAttribute(ln.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, ln.smem));
    dim3 grid((c.L + ln.rows - 1) / ln.rows, c.H_q, 1);
    auto go = [&] {
      ln.fn<<<grid, ln.threads, ln.smem>>>(dq, dk, dv, dq, nullptr, dout, c.H_q, c.H_kv, c.L, c.S, c.kind, 0, 0,
                                           scale_log2, c.H_q * c.L * E, c.L * E, E, c.H_kv * c.S * E, c.S * E, E,
                                           c.H_kv * c.S * E, c.S * E, E);
    };
    CHECK(cudaMemset(dout, 0xff, nq * 4));  // NaN: rows never written show
    go();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> out(nq);
    CHECK(cudaMemcpy(out.data(), dout, nq * 4, cudaMemcpyDeviceToHost));
    double err = 0, big = 0;
    int nan_rows = 0, want_nan = 0;
    for (size_t i = 0; i < picks.size(); ++i) {
      auto [h, r] = picks[i];
      bool ref_nan = false, got_nan = false;
      for (int e = 0; e < E; ++e) {
        const double x = ref[i][e], y = out[(size_t(h) * c.L + r) * E + e];
        ref_nan |= std::isnan(x);
        got_nan |= std::isnan(y);
        if (!std::isnan(x)) {
          err = std::max(err, std::isnan(y) ? INFINITY : std::abs(x - y));
          big = std::max(big, std::abs(x));
        }
      }
      want_nan += ref_nan;
      nan_rows += got_nan && ref_nan;
      if (got_nan != ref_nan) err = INFINITY;
    }
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
      CHECK(cudaEventRecord(a));
      go();
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float t;
      CHECK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    CHECK(cudaGetLastError());
    const double flops = 4.0 * c.H_q * E * (c.kind ? double(c.L) * c.S - double(c.L) * c.L / 2 : double(c.L) * c.S);
    const float med = median(ms);
    std::printf("  %-26s %8.3f ms %7.1f TFLOP/s  max err %.2e (max |ref| %.2f)  NaN rows %d/%d\n", ln.name, med,
                flops / med / 1e9, err, big, nan_rows, want_nan);
  }
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // lines survive a timeout's kill
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s\n", prop.name);
  const std::vector<Launch> launches = {
      {"mma.sync 3xTF32", fa_prefill_float32_64, 64, 128, int(sizeof(fa::Tf32Smem<64>))},
      {"wgmma 3xTF32", fa_prefill_wg_float32_64, fa::kWgBr, fa::kWgThreads, int(sizeof(fa::WgSmem<64>))},
  };
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  run({14, 2, 8192, 8192, 1, -1}, launches, reps);
  run({14, 2, 2048, 2048, 1, -1}, launches, reps);
  run({14, 2, 1000, 1000, 0, -1}, launches, reps);
  run({4, 2, 300, 1000, 1, -1}, launches, reps);
  run({4, 1, 77, 77, 1, 40}, launches, 3);
  run({4, 1, 200, 333, 1, 250}, launches, 3);
  return 0;
}
