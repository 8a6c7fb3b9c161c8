// Standalone probe of the 16-bit backward (backward_f16.cu), without MLX:
// the statistics pass and the keys pass at E = 64 and 128, bfloat16, checked
// against a float64 gradient on small causal shapes (GQA, L != S, rows past
// the tiles) and timed with CUDA events at qwen05b and hd128 causal 8K; the
// Hopper keys pass also as its entry points take their arguments (keyswg_,
// keyswgc_: a kernel whose mask and head dim are constants is faster than
// the one that ships them as arguments).
// With -DFA_BASELINE_DIR=<dir> (a copy of an earlier kernels/ directory,
// e.g. `git archive REV packages/flashattn-core/csrc/cuda/kernels | tar -x`,
// from commit 60016b6 on), that version's wgmma keys pass runs beside this
// tree's on the same inputs.
//
//   scripts/cuda-check probe backward-probe-f16.cu [reps]    (reps = 1: the 8K launches alone, for ncu)

#include <cstdint>

#include "harness.cuh"  // system headers first: the baseline's include lies in a namespace

#define FA_DTYPE 2
#define FA_E 64
#ifdef FA_BASELINE_DIR
#define FA_PASS 0  // the baseline file's entry point is then the statistics one: no clash below
#define FA_STR_(x) #x
#define FA_STR(x) FA_STR_(x)
namespace baseline {
#include FA_STR(FA_BASELINE_DIR/backward_wg.cu)
}
#undef FA_PASS
#endif
#define FA_PASS 1
#include "../../packages/flashattn-core/csrc/cuda/kernels/backward_f16.cu"
#include "../../packages/flashattn-core/csrc/cuda/kernels/backward_wg.cu"

using T = __nv_bfloat16;
namespace bs = fa::backward_shapes;

template <int E>
__global__ void __launch_bounds__(bs::kThreads) stats_kernel(const T* q, const T* k, const T* o, const T* d_out,
                                                             float* stats, int* flags, float* dq, int slices, int H_q,
                                                             int H_kv, int L, int S, float scale_log2) {
  fa::backward_stats16<T, E>(q, k, o, d_out, nullptr, nullptr, stats, flags, dq, slices, H_q, H_kv, L, S, E, fa::kCausal, 0,
                             fa::kNoWindow, scale_log2, fa::contiguous_backward_layout(H_q, H_kv, L, S, E));
}

template <int E>
__global__ void __launch_bounds__(bs::kThreads) stats_wg_kernel(const T* q, const T* k, const T* o, const T* d_out,
                                                                float* stats, int* flags, float* dq, int slices,
                                                                int H_q, int H_kv, int L, int S, float scale_log2) {
  fa::backward_stats16<T, E, true>(q, k, o, d_out, nullptr, nullptr, stats, flags, dq, slices, H_q, H_kv, L, S, E,
                                   fa::kCausal, 0, fa::kNoWindow, scale_log2, fa::contiguous_backward_layout(H_q, H_kv, L, S, E));
}

using KeysFn = void (*)(const T*, const T*, const T*, const T*, const float*, const int*, void*, void*, float*, int,
                        int, int, int, int, float, float);
template <int E>
__global__ void __launch_bounds__(bs::kKeysThreads16) keys_kernel(const T* q, const T* k, const T* v, const T* d_out,
                                                                  const float* stats, const int*, void* dk, void* dv,
                                                                  float* dq,
                                                                  int slices, int H_q, int H_kv, int L, int S,
                                                                  float scale_log2, float scale) {
  fa::backward_keysq16<T, E>(q, k, v, d_out, stats, nullptr, nullptr, dk, dv, dq, slices, H_q, H_kv, L, S, E,
                             fa::kCausal, 0, fa::kNoWindow, scale_log2, scale, fa::contiguous_backward_layout(H_q, H_kv, L, S, E));
}
template <int E>
__global__ void __launch_bounds__(bs::kKeysThreads16, 1) wg_keys_kernel(const T* q, const T* k, const T* v,
                                                                        const T* d_out, const float* stats,
                                                                        const int* flags, void* dk, void* dv, float* dq,
                                                                        int slices, int H_q, int H_kv, int L, int S,
                                                                        float scale_log2, float scale) {
  fa::backward_keys_wg<T, E, false>(q, k, v, d_out, stats, flags, nullptr, nullptr, dk, dv, dq, slices, H_q, H_kv, L, S, E,
                             fa::kCausal, 0, fa::kNoWindow, scale_log2, scale, fa::contiguous_backward_layout(H_q, H_kv, L, S, E));
}
// The wgmma keys pass as the shipped entry points run it: what they take as
// launch arguments read here from device memory, so that the compiler
// cannot fold it. FOLD 0: fa_backward_keyswg_ (head dim and mask at run
// time); 5: fa_backward_keyswgc_ (the head dim and a causal kind folded, the
// window at run time). (The "wgmma" kernel above folds the window too.)
__device__ int g_args[2][4];  // [E == 128]: E, mask_kind, mask_rs, mask_cs
template <int E, int FOLD>
__global__ void __launch_bounds__(bs::kKeysThreads16, 1) wg_keys_rt(const T* q, const T* k, const T* v,
                                                                    const T* d_out, const float* stats,
                                                                    const int* flags, void* dk, void* dv, float* dq,
                                                                    int slices, int H_q, int H_kv, int L, int S,
                                                                    float scale_log2, float scale) {
  const int* a = g_args[E == 128];
  fa::backward_keys_wg<T, E, false>(q, k, v, d_out, stats, flags, nullptr, nullptr, dk, dv, dq, slices, H_q, H_kv, L, S,
                             (FOLD & 1) ? E : a[0], (FOLD & 4) ? fa::kCausal : a[1], a[2], a[3], scale_log2, scale,
                             fa::contiguous_backward_layout(H_q, H_kv, L, S, E));
}
#ifdef FA_BASELINE_DIR
template <int E>
__global__ void __launch_bounds__(bs::kKeysThreads16, 1) base_keys_kernel(const T* q, const T* k, const T* v,
                                                                       const T* d_out, const float* stats,
                                                                       const int* flags, void* dk, void* dv, float* dq, int slices, int H_q,
                                                                       int H_kv, int L, int S, float scale_log2,
                                                                       float scale) {
  baseline::fa::backward_keys_wg<T, E, false>(q, k, v, d_out, stats, flags, nullptr, nullptr, dk, dv, dq, slices, H_q, H_kv,
                                       L, S, E, fa::kCausal, 0, fa::kNoWindow, scale_log2, scale);
}
#endif

// Every keys pass gets the larger of the two kernels' shared memory.
template <int E>
int keys_smem() {
  return std::max(bs::keys_smem(E, 2), bs::keys_smem_bytes_wg(E));
}

struct Shape {
  int H_q, H_kv, L, S;
};

// One gradient: statistics, then keys pass `fn` (outputs zeroed as the host does).
template <int E>
struct Call {
  Shape s;
  const T *q, *k, *v, *o, *d_out;
  float *stats, *dq;
  int* flags;
  void *dk, *dv;
  bool sums() const { return s.H_q != s.H_kv; }
  size_t kv_bytes() const { return size_t(s.H_kv) * s.S * E * (sums() ? 4 : 2); }
  float scale() const { return 1.0f / std::sqrt(float(E)); }
  void stats_pass(bool wg = false) const {
    const int blocks = (s.L + bs::kRows - 1) / bs::kRows * s.H_q;
    (wg ? stats_wg_kernel<E> : stats_kernel<E>)<<<blocks, bs::kThreads, bs::rows_smem(E, 2)>>>(q, k, o, d_out, stats, flags, dq, s.H_q, s.H_q, s.H_kv, s.L,
                                                                  s.S, scale() * 1.4426950408889634f);
  }
  void keys_pass(KeysFn fn) const {
    CHECK(cudaMemsetAsync(dq, 0, size_t(s.H_q) * s.L * E * 4));
    if (sums()) {
      CHECK(cudaMemsetAsync(dk, 0, kv_bytes()));
      CHECK(cudaMemsetAsync(dv, 0, kv_bytes()));
    }
    const int blocks = (s.S + bs::kKeys16 - 1) / bs::kKeys16 * s.H_q;
    fn<<<blocks, bs::kKeysThreads16, keys_smem<E>()>>>(q, k, v, d_out, stats, flags, dk, dv, dq, s.H_q, s.H_q, s.H_kv,
                                                          s.L, s.S, scale() * 1.4426950408889634f, scale());
  }
};

template <int E>
Call<E> make_call(const Shape& s, const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                  const std::vector<T>& o, const std::vector<T>& d_out) {
  Call<E> c{s, probe::upload(q), probe::upload(k), probe::upload(v), probe::upload(o), probe::upload(d_out)};
  CHECK(cudaMalloc(&c.stats, size_t(s.H_q) * s.L * 2 * 4));
  CHECK(cudaMalloc(&c.flags, size_t(s.H_q) * s.L * 4));
  CHECK(cudaMalloc(&c.dq, size_t(s.H_q) * s.L * E * 4));
  CHECK(cudaMalloc(&c.dk, c.kv_bytes()));
  CHECK(cudaMalloc(&c.dv, c.kv_bytes()));
  return c;
}

template <typename X>
std::vector<double> download(const void* p, size_t n) {
  std::vector<X> h(n);
  CHECK(cudaMemcpy(h.data(), p, n * sizeof(X), cudaMemcpyDeviceToHost));
  std::vector<double> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = probe::to_float(h[i]);
  return r;
}

// The float64 gradient of causal attention (bottom-right aligned for L != S)
// and the forward's output O, rounded to T as the kernels take it.
template <int E>
void check(const Shape& s, KeysFn fn, const char* name) {
  using probe::to_float;
  const size_t nq = size_t(s.H_q) * s.L * E, nk = size_t(s.H_kv) * s.S * E;
  std::vector<T> q = probe::randn<T>(nq, 11), k = probe::randn<T>(nk, 12), v = probe::randn<T>(nk, 13),
                 d_out = probe::randn<T>(nq, 14), o(nq);
  const double scale = 1.0 / std::sqrt(double(E));
  const int ratio = s.H_q / s.H_kv, offset = s.S - s.L;
  std::vector<double> dq(nq, 0), dk(nk, 0), dv(nk, 0);
  for (int h = 0; h < s.H_q; ++h) {
    const size_t kv = size_t(h / ratio) * s.S * E;
    for (int r = 0; r < s.L; ++r) {
      const size_t row = (size_t(h) * s.L + r) * E;
      const int end = std::min(s.S, r + offset + 1);
      std::vector<double> p(std::max(end, 0)), dp(p.size());
      double m = -INFINITY, l = 0;
      for (int j = 0; j < end; ++j) {
        double d = 0;
        for (int e = 0; e < E; ++e) d += double(to_float(q[row + e])) * to_float(k[kv + size_t(j) * E + e]);
        p[j] = d * scale;
        m = std::max(m, p[j]);
      }
      for (int j = 0; j < end; ++j) l += (p[j] = std::exp(p[j] - m));
      std::vector<double> out(E, 0.0);
      for (int j = 0; j < end; ++j) {
        p[j] /= l;
        for (int e = 0; e < E; ++e) out[e] += p[j] * to_float(v[kv + size_t(j) * E + e]);
      }
      double D = 0;
      for (int e = 0; e < E; ++e) {
        o[row + e] = probe::from_float<T>(float(out[e]));
        D += double(to_float(d_out[row + e])) * to_float(o[row + e]);
      }
      for (int j = 0; j < end; ++j) {
        double x = 0;
        for (int e = 0; e < E; ++e) x += double(to_float(d_out[row + e])) * to_float(v[kv + size_t(j) * E + e]);
        const double ds = p[j] * (x - D);
        for (int e = 0; e < E; ++e) {
          dv[kv + size_t(j) * E + e] += p[j] * to_float(d_out[row + e]);
          dq[row + e] += scale * ds * to_float(k[kv + size_t(j) * E + e]);
          dk[kv + size_t(j) * E + e] += scale * ds * to_float(q[row + e]);
        }
      }
    }
  }
  Call<E> c = make_call<E>(s, q, k, v, o, d_out);
  // The two statistics passes agree (the keys pass below reads the wgmma one's).
  c.stats_pass();
  const std::vector<double> st = download<float>(c.stats, size_t(s.H_q) * s.L * 2);
  c.stats_pass(true);
  const std::vector<double> st_wg = download<float>(c.stats, size_t(s.H_q) * s.L * 2);
  double dmax = 0;
  for (size_t i = 0; i < st.size(); ++i) dmax = std::max(dmax, std::abs(st[i] - st_wg[i]));
  c.keys_pass(fn);
  CHECK(cudaDeviceSynchronize());
  const std::vector<double> gq = download<float>(c.dq, nq);
  const std::vector<double> gk = c.sums() ? download<float>(c.dk, nk) : download<T>(c.dk, nk);
  const std::vector<double> gv = c.sums() ? download<float>(c.dv, nk) : download<T>(c.dv, nk);
  const double eq = probe::rel_error(gq, dq), ek = probe::rel_error(gk, dk), ev = probe::rel_error(gv, dv);
  std::printf("check %-9s E=%3d H %2d/%d L=%4d S=%4d: dQ %.1e dK %.1e dV %.1e, statistics differ by %.1e %s\n", name,
              E, s.H_q, s.H_kv, s.L, s.S, eq, ek, ev, dmax, std::max({eq, ek, ev}) < 2e-2 && dmax < 1e-4 ? "ok" : "FAILED");
}

// Times of the statistics pass and each keys pass at one shape (causal).
template <int E>
void timing(const Shape& s, const std::vector<std::pair<const char*, KeysFn>>& fns, int reps) {
  const size_t nq = size_t(s.H_q) * s.L * E, nk = size_t(s.H_kv) * s.S * E;
  Call<E> c = make_call<E>(s, probe::randn<T>(nq, 1), probe::randn<T>(nk, 2), probe::randn<T>(nk, 3),
                           probe::randn<T>(nq, 4), probe::randn<T>(nq, 5));
  // Causal, L = S: half the score matrix; the keys pass takes 5 products of it.
  const double half = double(s.H_q) * s.L * s.S * E / 2;
  const float st = probe::median_ms([&] { c.stats_pass(); }, reps);
  const float st_wg = probe::median_ms([&] { c.stats_pass(true); }, reps);
  std::printf("time E=%3d H %2d/%d L=%d: stats %.3f ms, on wgmma %.3f", E, s.H_q, s.H_kv, s.L, st, st_wg);
  for (const auto& f : fns) {
    const float t = probe::median_ms([&] { c.keys_pass(f.second); }, reps);
    std::printf("  %s %.3f ms (%.0f TF/s)", f.first, t, 10 * half / t / 1e9);
  }
  std::printf("\n");
}

template <int E>
std::vector<std::pair<const char*, KeysFn>> keys_fns() {
  std::vector<std::pair<const char*, KeysFn>> f = {{"keys", keys_kernel<E>},
                                                   {"wgmma", wg_keys_kernel<E>},
                                                   {"keyswg_", wg_keys_rt<E, 0>},
                                                   {"keyswgc_", wg_keys_rt<E, 5>}};
#ifdef FA_BASELINE_DIR
  f.push_back({"baseline", base_keys_kernel<E>});
#endif
  return f;
}

template <int E>
void setup() {
  CHECK(cudaFuncSetAttribute(stats_kernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize, bs::rows_smem(E, 2)));
  CHECK(cudaFuncSetAttribute(stats_wg_kernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize, bs::rows_smem(E, 2)));
  for (auto [name, fn] : keys_fns<E>())
    CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, keys_smem<E>()));
}

int main(int argc, char** argv) {
  probe::print_gpu();
  const int args[2][4] = {{64, fa::kCausal, 0, fa::kNoWindow}, {128, fa::kCausal, 0, fa::kNoWindow}};
  CHECK(cudaMemcpyToSymbol(g_args, args, sizeof(args)));
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  setup<64>();
  setup<128>();
  if (reps == 1) {  // for Nsight Compute: one launch of each pass at each 8K shape, no checks
    timing<64>({14, 2, 8192, 8192}, keys_fns<64>(), 1);
    timing<128>({32, 8, 8192, 8192}, keys_fns<128>(), 1);
    return 0;
  }
  for (auto [name, fn] : keys_fns<64>()) {
    check<64>({4, 2, 300, 300}, fn, name);
    check<64>({2, 2, 77, 333}, fn, name);
  }
  for (auto [name, fn] : keys_fns<128>()) {
    check<128>({4, 2, 300, 300}, fn, name);
    check<128>({2, 2, 77, 333}, fn, name);
  }
  timing<64>({14, 2, 8192, 8192}, keys_fns<64>(), reps);
  timing<128>({32, 8, 8192, 8192}, keys_fns<128>(), reps);
  timing<64>({14, 2, 4096, 4096}, keys_fns<64>(), reps);
  timing<128>({32, 8, 4096, 4096}, keys_fns<128>(), reps);
  return 0;
}
