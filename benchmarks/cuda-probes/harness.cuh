// The standalone probes' harness (prefill-probe*.cu, prefill-timeline.cu,
// backward-probe*.cu): random inputs, uploads, a float64 reference on
// sampled rows, NaN-poisoned outputs, relative errors, CUDA-event timing.
// For kernel work on a GPU machine without MLX; the GPU suite
// (scripts/cuda-check test) remains the correctness test.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

namespace probe {

// A causal mask's column-stride argument: no sliding window (causal.h's kNoWindow;
// this header may come before the kernels').
constexpr int kNoWindow = 0x7fffffff;

struct Case {
  int H_q, H_kv, L, S, kind;  // kind: 0 none, 1 causal
  int nan_key;                // >= 0: V row of this key (KV head 0) is NaN
  int tq = 0;                 // 1: Q stored (L, H_q, E), read through its strides (mlx-lm's layout)
};

inline float to_float(float x) { return x; }
inline float to_float(__half x) { return __half2float(x); }
inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
std::vector<T> randn(size_t n, uint64_t seed) {
  std::vector<T> x(n);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  auto u = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return ((s >> 11) + 0.5) / 9007199254740992.0;
  };
  for (size_t i = 0; i < n; ++i)
    x[i] = from_float<T>(float(std::sqrt(-2 * std::log(u())) * std::cos(6.283185307179586 * u())));
  return x;
}

template <typename T>
using Kernel = void (*)(const T*, const T*, const T*, const void*, const int64_t*, T*, int, int, int, int, int,
                        int, int, float, int, int, int, int, int, int, int, int, int, int, int, int);

// The 16-bit wgmma kernels take one more argument (`slices`: 0 for one row
// tile a block, or batch x H_q for one block per SM, prefill_f16_wg.cu).
template <typename T>
using KernelS = void (*)(const T*, const T*, const T*, const void*, const int64_t*, T*, int, int, int, int, int,
                         int, int, float, int, int, int, int, int, int, int, int, int, int, int, int, int);

// The 16-bit wgmma kernels with TMA copies (prefill_f16_wg.cu's TMA) take
// three more: the tensor-map template (device memory), the maps' scratch and
// the call's tag (a new one every launch, as the host gives).
template <typename T>
using KernelT = void (*)(const T*, const T*, const T*, const void*, const int64_t*, T*, int, int, int, int, int,
                         int, int, float, int, int, int, int, int, int, int, int, int, int, int, int, int,
                         const void*, void*,
                         unsigned long long);

template <typename T>
struct Launch {
  const char* name;
  Kernel<T> fn;
  int rows, threads, smem;
  KernelS<T> fn_s = nullptr;  // instead of fn
  bool scheduled = false;     // fn_s with one block per SM
  KernelT<T> fn_t = nullptr;  // instead of fn
};

// The kernels' tensor-map template (cuTensorMapEncodeTiled, as
// flashattn-core's csrc/cuda/driver.cpp makes it: placeholders the kernel
// replaces), into 128 bytes at out.
template <typename T>
void map_template(void* out) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    cudaDriverEntryPointQueryResult found;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                           cudaEnableDefault, &found));
  }
  const cuuint64_t dims[4] = {64, 1 << 16, 1, 1}, strides[3] = {128, 128 << 16, 128 << 16};
  const cuuint32_t box[4] = {64, 128, 1, 1}, element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(static_cast<CUtensorMap*>(out),
                            sizeof(T) == 2 && std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                             : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                            4, reinterpret_cast<void*>(uintptr_t{1} << 12), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(1);
  }
}

// Softmax attention of one query row (E elements at q_row) over keys
// [0, last] of one KV head (k_head, v_head: S x E), in float64.
template <typename T>
std::vector<double> reference_row(const T* q_row, const T* k_head, const T* v_head, int last, int E,
                                  double scale) {
  std::vector<double> sc(last + 1), o(E, 0.0);
  double m = -INFINITY, l = 0;
  for (int j = 0; j <= last; ++j) {
    double d = 0;
    for (int e = 0; e < E; ++e) d += double(to_float(q_row[e])) * to_float(k_head[size_t(j) * E + e]);
    sc[j] = d * scale;
    m = std::max(m, sc[j]);
  }
  for (int j = 0; j <= last; ++j) {
    const double p = std::exp(sc[j] - m);
    l += p;
    for (int e = 0; e < E; ++e) o[e] += p * to_float(v_head[size_t(j) * E + e]);
  }
  for (auto& x : o) x /= l;
  return o;
}

inline float median(std::vector<float> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// Median milliseconds of `reps` calls of launch(), each timed alone with
// CUDA events.
template <typename Launch>
float median_ms(Launch launch, int reps) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return median(ms);
}

template <typename T, int E>
void run(const Case& c, const std::vector<Launch<T>>& launches, int reps) {
  const size_t nq = size_t(c.H_q) * c.L * E, nk = size_t(c.H_kv) * c.S * E;
  std::vector<T> q = randn<T>(nq, 1), k = randn<T>(nk, 2), v = randn<T>(nk, 3);
  if (c.nan_key >= 0)
    for (int e = 0; e < E; ++e) v[size_t(c.nan_key) * E + e] = from_float<T>(NAN);
  T *dq, *dk, *dv, *dout;
  const size_t b = sizeof(T);
  CHECK(cudaMalloc(&dq, nq * b));
  CHECK(cudaMalloc(&dk, nk * b));
  CHECK(cudaMalloc(&dv, nk * b));
  CHECK(cudaMalloc(&dout, nq * b));
  CHECK(cudaMemcpy(dq, q.data(), nq * b, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, k.data(), nk * b, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv, v.data(), nk * b, cudaMemcpyHostToDevice));
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
    const size_t kv = size_t(kvh) * c.S * E;
    const size_t q_row = c.tq ? size_t(r) * c.H_q + h : size_t(h) * c.L + r;
    ref.push_back(reference_row(&q[q_row * E], &k[kv], &v[kv], last, E, scale));
  }

  std::printf("E %d H_q %d H_kv %d L %d S %d %s%s%s\n", E, c.H_q, c.H_kv, c.L, c.S, c.kind ? "causal" : "none",
              c.nan_key >= 0 ? " (a NaN value row)" : "", c.tq ? " (Q transposed)" : "");
  const int q_sh = c.tq ? E : c.L * E, q_sr = c.tq ? c.H_q * E : E;  // Q's head and row strides
  // The TMA kernels' template, then scratch for their maps (256 slots of 512 bytes).
  unsigned char* maps = nullptr;
  static unsigned long long tag = 1;
  {
    alignas(64) unsigned char templ[128];
    map_template<T>(templ);
    CHECK(cudaMalloc(&maps, 128 + 256 * 512));
    CHECK(cudaMemcpy(maps, templ, 128, cudaMemcpyHostToDevice));
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (const auto& ln : launches) {
    if (ln.fn_t != nullptr) {
      CHECK(cudaFuncSetAttribute(ln.fn_t, cudaFuncAttributeMaxDynamicSharedMemorySize, ln.smem));
    } else if (ln.fn_s != nullptr) {
      CHECK(cudaFuncSetAttribute(ln.fn_s, cudaFuncAttributeMaxDynamicSharedMemorySize, ln.smem));
    } else {
      CHECK(cudaFuncSetAttribute(ln.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, ln.smem));
    }
    const int tiles = (c.L + ln.rows - 1) / ln.rows;
    const dim3 grid = ln.scheduled ? dim3(std::min(tiles * c.H_q, sms), 1, 1) : dim3(tiles, c.H_q, 1);
    const int mask_cs = c.kind == 1 ? kNoWindow : 0;
    auto go = [&] {
      if (ln.fn_t != nullptr) {
        ln.fn_t<<<grid, ln.threads, ln.smem>>>(dq, dk, dv, dq, nullptr, dout, c.H_q, c.H_kv, c.L, c.S, c.kind, 0, mask_cs,
                                               scale_log2, ln.scheduled ? c.H_q : 0, c.H_q * c.L * E, q_sh, q_sr,
                                               c.H_kv * c.S * E, c.S * E, E, c.H_kv * c.S * E, c.S * E, E,
                                               c.H_q * c.L * E, c.L * E, E, maps, maps + 128, ++tag);
      } else if (ln.fn_s != nullptr) {
        ln.fn_s<<<grid, ln.threads, ln.smem>>>(dq, dk, dv, dq, nullptr, dout, c.H_q, c.H_kv, c.L, c.S, c.kind, 0, mask_cs,
                                               scale_log2, ln.scheduled ? c.H_q : 0, c.H_q * c.L * E, q_sh, q_sr,
                                               c.H_kv * c.S * E, c.S * E, E, c.H_kv * c.S * E, c.S * E, E,
                                               c.H_q * c.L * E, c.L * E, E);
      } else {
        ln.fn<<<grid, ln.threads, ln.smem>>>(dq, dk, dv, dq, nullptr, dout, c.H_q, c.H_kv, c.L, c.S, c.kind, 0, mask_cs,
                                             scale_log2, c.H_q * c.L * E, q_sh, q_sr, c.H_kv * c.S * E, c.S * E, E,
                                             c.H_kv * c.S * E, c.S * E, E, c.H_q * c.L * E, c.L * E, E);
      }
    };
    CHECK(cudaMemset(dout, 0xff, nq * b));  // NaN: rows never written show
    go();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<T> out(nq);
    CHECK(cudaMemcpy(out.data(), dout, nq * b, cudaMemcpyDeviceToHost));
    double err = 0, big = 0;
    int nan_rows = 0, want_nan = 0;
    for (size_t i = 0; i < picks.size(); ++i) {
      auto [h, r] = picks[i];
      bool ref_nan = false, got_nan = false;
      for (int e = 0; e < E; ++e) {
        const double x = ref[i][e], y = to_float(out[(size_t(h) * c.L + r) * E + e]);
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
    const double flops = 4.0 * c.H_q * E * (c.kind ? double(c.L) * c.S - double(c.L) * c.L / 2 : double(c.L) * c.S);
    const float med = median_ms(go, reps);
    std::printf("  %-26s %8.3f ms %7.1f TFLOP/s  max err %.2e (max |ref| %.2f)  NaN rows %d/%d\n", ln.name, med,
                flops / med / 1e9, err, big, nan_rows, want_nan);
  }
  cudaFree(maps);
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
}

// x in a fresh device allocation.
template <typename X>
X* upload(const std::vector<X>& x) {
  X* d;
  CHECK(cudaMalloc(&d, x.size() * sizeof(X)));
  CHECK(cudaMemcpy(d, x.data(), x.size() * sizeof(X), cudaMemcpyHostToDevice));
  return d;
}

// ||x - ref|| / ||ref|| (Frobenius), infinite where x has a NaN.
inline double rel_error(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = x[i] - ref[i];
    num += std::isnan(d) ? INFINITY : d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

inline void print_gpu() {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // lines survive a timeout's kill
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s\n", prop.name);
}

}  // namespace probe
