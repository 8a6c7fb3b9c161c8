// Standalone probe of float32 attention on float16 tensor cores, without
// MLX: f32_split.cu makes each of Q, K and V two float16 terms (every
// 128-row tile scaled by a power of two), then prefill_f32s_wg.cu's unit
// takes 3 products for Q K^T and 3 for P V at float16's rate. Against the
// wgmma 3xTF32 kernel (prefill_tf32_wg.cu) on the same inputs: median ms
// (the split and the attention together, and the attention alone) and the
// largest error against float64 on sampled rows, NaN rows where float64
// has them (the tiles with a value that is not finite take plain float32).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/split benchmarks/cuda-probes/prefill-f32split-probe.cu && /tmp/split

#define FA_DTYPE 0
#define FA_E 64
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_f32s_wg.cu"
#include "../../packages/flashattn-core/csrc/cuda/kernels/f32_split.cu"
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_tf32_wg.cu"
#include "harness.cuh"

namespace {

constexpr int E = 64;

struct Inputs {
  int H_q, H_kv, L, S, causal;
  float value_scale = 1.0f;  // V times this
  int nan_key = -1;          // V row of this key (KV head 0) NaN
  int inf_query = -1;        // Q row of this query (head 0): one element +inf
  bool bands = false;        // 128-row bands of q, k and v scaled far apart (tests/gpu's)
};

// Largest |error| against float64 over sampled rows (infinite where NaN
// does not match) and the largest |reference|.
std::pair<double, double> check(const Inputs& c, const std::vector<float>& q, const std::vector<float>& k,
                                const std::vector<float>& v, const std::vector<float>& out) {
  const int ratio = c.H_q / c.H_kv, offset = c.S - c.L;
  std::vector<std::pair<int, int>> picks;
  for (int h : {0, c.H_q / 2, c.H_q - 1})
    for (int i = 0; i < 12; ++i) picks.push_back({h, int((long long)(c.L - 1) * i / 11)});
  for (int r : {c.nan_key - offset - 1, c.nan_key - offset, c.inf_query})
    if (r >= 0 && r < c.L) picks.push_back({0, r});
  double err = 0, big = 0;
  for (auto [h, r] : picks) {
    const size_t kv = size_t(h / ratio) * c.S * E;
    const int last = c.causal ? r + offset : c.S - 1;
    const auto ref = probe::reference_row(&q[(size_t(h) * c.L + r) * E], &k[kv], &v[kv], last, E, 1.0 / std::sqrt(double(E)));
    for (int e = 0; e < E; ++e) {
      const double x = ref[e], y = out[(size_t(h) * c.L + r) * E + e];
      if (std::isnan(x) != std::isnan(y)) err = INFINITY;
      if (!std::isnan(x)) {
        err = std::max(err, std::isnan(y) ? INFINITY : std::abs(x - y));
        big = std::max(big, std::abs(x));
      }
    }
  }
  return {err, big};
}

void compare(const Inputs& c, int reps) {
  const size_t nq = size_t(c.H_q) * c.L * E, nk = size_t(c.H_kv) * c.S * E;
  std::vector<float> q = probe::randn<float>(nq, 1), k = probe::randn<float>(nk, 2), v = probe::randn<float>(nk, 3);
  for (auto& x : v) x *= c.value_scale;
  if (c.nan_key >= 0)
    for (int e = 0; e < E; ++e) v[size_t(c.nan_key) * E + e] = NAN;
  if (c.inf_query >= 0) q[size_t(c.inf_query) * E + 3] = INFINITY;
  if (c.bands) {
    const int qb[4] = {-40, -12, 0, 0}, kb[4] = {-30, -5, 0, 0};
    for (size_t i = 0; i < nq; ++i) q[i] = ldexpf(q[i], qb[(i / E % c.L / 128 * 7 + 1) % 4]);
    for (size_t i = 0; i < nk; ++i) {
      const int band = int(i / E % c.S / 128);
      k[i] = ldexpf(k[i], kb[(band * 5 + 2) % 4]);
      v[i] = ldexpf(v[i], std::min(band * 25 - 60, 60) - 0);
    }
  }
  float *dq = probe::upload(q), *dk = probe::upload(k), *dv = probe::upload(v), *dout;
  __half *q2, *k2, *v2;
  int* shifts;
  const int tq = fa::f32_split::tiles(c.L), tk = fa::f32_split::tiles(c.S);
  CHECK(cudaMalloc(&q2, nq * 2 * sizeof(__half)));
  CHECK(cudaMalloc(&k2, nk * 2 * sizeof(__half)));
  CHECK(cudaMalloc(&v2, nk * 2 * sizeof(__half)));
  CHECK(cudaMalloc(&shifts, (size_t(c.H_q) * tq + 2 * size_t(c.H_kv) * tk) * sizeof(int)));
  CHECK(cudaMalloc(&dout, nq * sizeof(float)));
  unsigned char* scratch;
  int templ[32];
  probe::map_template<__half>(templ);
  CHECK(cudaMalloc(&scratch, 256 * 512));
  static int tag = 1;
  const int smem = fa::wg_shapes::f32s_smem_bytes(), tf32_smem = fa::wg_shapes::tf32_smem_bytes(E);
  CHECK(cudaFuncSetAttribute(fa_prefill_wgs_float32_64, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(fa_prefill_wg_float32_64, cudaFuncAttributeMaxDynamicSharedMemorySize, tf32_smem));
  const float scale_log2 = float(1.0 / std::sqrt(double(E)) * 1.4426950408889634);
  const int kind = c.causal, cs = c.causal ? probe::kNoWindow : 0;
  const int tiles = (c.L + 127) / 128;
  auto split = [&] {
    fa_f32_split_64<<<c.H_q * tq + 2 * c.H_kv * tk, 256>>>(dq, dk, dv, q2, k2, v2, shifts, c.H_q, c.H_kv, c.L, c.S);
  };
  auto attend = [&] {
    const int* m = templ;
    fa_prefill_wgs_float32_64<<<dim3(tiles, c.H_q, 1), 384, smem>>>(
        dq, dk, dv, dq, nullptr, q2, k2, v2, shifts, dout, nullptr, scratch, c.H_q, c.H_kv, c.L, c.S, kind, 0, cs,
        scale_log2, c.H_q * c.L * E, c.L * E, E, c.H_kv * c.S * E, c.S * E, E, c.H_kv * c.S * E, c.S * E, E,
        c.H_q * c.L * E, c.L * E, E, ++tag, 0, m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], m[8], m[9], m[10],
        m[11], m[12], m[13], m[14], m[15], m[16], m[17], m[18], m[19], m[20], m[21], m[22], m[23], m[24], m[25],
        m[26], m[27], m[28], m[29], m[30], m[31]);
  };
  auto tf32 = [&] {
    fa_prefill_wg_float32_64<<<dim3(tiles, c.H_q, 1), fa::kWgThreads, tf32_smem>>>(
        dq, dk, dv, dq, nullptr, dout, nullptr, c.H_q, c.H_kv, c.L, c.S, kind, 0, cs, scale_log2, c.H_q * c.L * E,
        c.L * E, E, c.H_kv * c.S * E, c.S * E, E, c.H_kv * c.S * E, c.S * E, E, c.H_q * c.L * E, c.L * E, E);
  };
  auto result = [&](auto run) {
    CHECK(cudaMemset(dout, 0xff, nq * sizeof(float)));  // NaN: rows never written show
    run();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> out(nq);
    CHECK(cudaMemcpy(out.data(), dout, nq * sizeof(float), cudaMemcpyDeviceToHost));
    return check(c, q, k, v, out);
  };
  const auto [err_s, big] = result([&] { split(); attend(); });
  const auto [err_t, big_t] = result(tf32);
  for (int which = 0; which < 2 && c.bands; ++which) {  // each band's largest relative error (head 0, every 5th row)
    std::printf("  %s\n", which == 0 ? "split + float16" : "3xTF32");
    CHECK(cudaMemset(dout, 0xff, nq * sizeof(float)));
    if (which == 0) {
      split();
      attend();
    } else {
      tf32();
    }
    CHECK(cudaDeviceSynchronize());
    std::vector<float> out(nq);
    CHECK(cudaMemcpy(out.data(), dout, nq * sizeof(float), cudaMemcpyDeviceToHost));
    for (int b0 = 0; b0 < c.L; b0 += 128) {
      double worst = 0;
      for (int r = b0; r < std::min(c.L, b0 + 128); r += 5) {
        const int last = c.causal ? r + c.S - c.L : c.S - 1;
        const auto ref = probe::reference_row(&q[size_t(r) * E], &k[0], &v[0], last, E, 1.0 / std::sqrt(double(E)));
        double num = 0, den = 0;
        for (int e = 0; e < E; ++e) num += (ref[e] - out[size_t(r) * E + e]) * (ref[e] - out[size_t(r) * E + e]), den += ref[e] * ref[e];
        worst = std::max(worst, std::sqrt(num / den));
      }
      std::printf("    rows %d..: worst relative error %.2e\n", b0, worst);
    }
    std::vector<int> sh(size_t(c.H_q) * tq + 2 * size_t(c.H_kv) * tk);
    CHECK(cudaMemcpy(sh.data(), shifts, sh.size() * sizeof(int), cudaMemcpyDeviceToHost));
    std::printf("  shifts q(h0):");
    for (int i = 0; i < tq; ++i) std::printf(" %d", sh[i]);
    std::printf("  k(g0):");
    for (int i = 0; i < tk; ++i) std::printf(" %d", sh[c.H_q * tq + i]);
    std::printf("  v(g0):");
    for (int i = 0; i < tk; ++i) std::printf(" %d", sh[c.H_q * tq + c.H_kv * tk + i]);
    std::printf("\n");
  }
  const float both = probe::median_ms([&] { split(); attend(); }, reps), alone = probe::median_ms(attend, reps);
  const float t32 = probe::median_ms(tf32, reps);
  std::printf("H_q %d H_kv %d L %d S %d %s, V x%g%s%s\n", c.H_q, c.H_kv, c.L, c.S, c.causal ? "causal" : "no mask",
              c.value_scale, c.nan_key >= 0 ? ", a NaN value row" : "", c.inf_query >= 0 ? ", an infinite query" : "");
  std::printf("  split + float16 %8.3f ms (attention %.3f)  max err %.2e | 3xTF32 %8.3f ms  max err %.2e | "
              "max |ref| %.3g | 3xTF32 / split %.2fx\n",
              both, alone, err_s, t32, err_t, big, t32 / both);
  cudaFree(scratch);
  for (void* p : {(void*)dq, (void*)dk, (void*)dv, (void*)q2, (void*)k2, (void*)v2, (void*)shifts, (void*)dout})
    cudaFree(p);
}

}  // namespace

int main(int argc, char** argv) {
  probe::print_gpu();
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  {
    Inputs b{4, 2, 700, 700, 1};
    b.bands = true;
    compare(b, 3);
    b.causal = 0;
    compare(b, 3);
  }
  compare({14, 2, 8192, 8192, 1}, reps);
  compare({14, 2, 4096, 4096, 1}, reps);
  compare({14, 2, 2048, 2048, 1}, reps);
  compare({14, 2, 2048, 8192, 1}, reps);
  compare({14, 2, 1000, 1000, 0}, reps);
  compare({4, 2, 300, 1000, 1}, reps);
  compare({14, 2, 2048, 2048, 1, 1e-30f}, reps);
  compare({14, 2, 2048, 2048, 1, 1e30f}, reps);
  compare({4, 1, 77, 77, 1, 1.0f, 40}, 3);
  compare({4, 1, 200, 333, 1, 1.0f, 250}, 3);
  compare({4, 1, 300, 300, 0, 1.0f, -1, 150}, 3);
  return 0;
}
