// Standalone probe of the float32 keys pass with dQ (backward.cu's
// fa_backward_keysqc_float32_64, causal, E = 64), without MLX: gradients
// against float64 on small shapes (GQA, L != S), a case with infinite and
// NaN values against the baseline, and the time at qwen05b causal 4K / 8K.
// With -DFA_BASELINE_DIR=<dir> (a copy of an earlier kernels/ directory,
// e.g. `git archive REV packages/flashattn-core/csrc/cuda/kernels | tar -x`)
// that version's keys pass runs beside this tree's on the same inputs.
//
//   scripts/cuda-check probe backward-probe.cu [reps]    (reps = 1: the 8K launches alone, for ncu)

#include <cstdint>

#include "harness.cuh"

#define FA_DTYPE 0
#define FA_E 64
#define FA_KIND 1
#ifdef FA_BASELINE_DIR
#define FA_PASS 2  // the baseline's entry point is then the D pass: no clash below
#define FA_STR_(x) #x
#define FA_STR(x) FA_STR_(x)
namespace baseline {
#include FA_STR(FA_BASELINE_DIR/backward.cu)
}
#undef FA_PASS
#endif
#define FA_PASS 3
#include "../../packages/flashattn-core/csrc/cuda/kernels/backward.cu"

namespace bs = fa::backward_shapes;
constexpr int E = 64;

using KeysFn = void (*)(const float*, const float*, const float*, const float*, const float*, const void*,
                        const int64_t*, void*, void*, float*, int, int, int, int, int, int, int, int, int, float, float,
                        int, int, int, int, int, int, int, int, int, int, int, int, int, int, int, int, int, int, int,
                        int, int, int, int, int);
struct Kernel {
  const char* name;
  KeysFn fn;
  int smem;
};
#ifdef FA_BASELINE_DIR
extern "C" __global__ void __launch_bounds__(128) base_keysq(
    const float* q, const float* k, const float* v, const float* d_out, const float* stats, const void* mask,
    const int64_t* mask_base, void* dk, void* dv, float* dq, int slices, int H_q, int H_kv, int L, int S, int,
    int mask_kind, int mask_rs, int mask_cs, float scale_log2, float scale, FA_BACKWARD_LAYOUT_PARAMS, int dq_sb,
    int dq_sh, int dq_sr) {
  baseline::fa::backward_keys<float, 64, true>(
      q, k, v, d_out, stats, mask, mask_base, dk, dv, dq, slices, H_q, H_kv, L, S, 64, baseline::fa::kCausal, mask_rs,
      mask_cs, scale_log2, scale,
      baseline::fa::BackwardLayout{{q_sb, q_sh, q_sr}, {k_sb, k_sh, k_sr}, {v_sb, v_sh, v_sr}, {o_sb, o_sh, o_sr},
                                   {do_sb, do_sh, do_sr}, {dk_sb, dk_sh, dk_sr}, {dv_sb, dv_sh, dv_sr}},
      baseline::fa::Rows{dq_sb, dq_sh, dq_sr});
}
#endif
const Kernel kKernels[] = {
#ifdef FA_BASELINE_DIR
    {"baseline", base_keysq, baseline::fa::backward_shapes::keysq_smem_bytes(E)},
#endif
    {"this tree", fa_backward_keysqc_float32_64, bs::keysq_smem_bytes(E)}};
constexpr int kCount = sizeof(kKernels) / sizeof(kKernels[0]);

struct Shape {
  int H_q, H_kv, L, S;
};

std::vector<double> download(const float* p, size_t n) {
  std::vector<float> h(n);
  CHECK(cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return std::vector<double>(h.begin(), h.end());
}

// One keys pass: dQ (and dK / dV where a group sums them) zeroed first, as
// the host does.
struct Call {
  Shape s;
  float *q, *k, *v, *d_out, *stats, *dq, *dk, *dv;
  size_t nq() const { return size_t(s.H_q) * s.L * E; }
  size_t nk() const { return size_t(s.H_kv) * s.S * E; }
  void run(const Kernel& kn) const {
    CHECK(cudaMemsetAsync(dq, 0, nq() * 4));
    if (s.H_q != s.H_kv) {
      CHECK(cudaMemsetAsync(dk, 0, nk() * 4));
      CHECK(cudaMemsetAsync(dv, 0, nk() * 4));
    }
    const float scale = 1.0f / std::sqrt(float(E));
    const fa::BackwardLayout lay = fa::contiguous_backward_layout(s.H_q, s.H_kv, s.L, s.S, E);
    const int blocks = (s.S + bs::kKeys - 1) / bs::kKeys * s.H_q;
    kn.fn<<<blocks, bs::kThreads, kn.smem>>>(
        q, k, v, d_out, stats, nullptr, nullptr, dk, dv, dq, s.H_q, s.H_q, s.H_kv, s.L, s.S, E, fa::kCausal, 0,
        probe::kNoWindow, scale * 1.4426950408889634f, scale, lay.q.sb, lay.q.sh, lay.q.sr, lay.k.sb, lay.k.sh,
        lay.k.sr, lay.v.sb, lay.v.sh, lay.v.sr, lay.o.sb, lay.o.sh, lay.o.sr, lay.d_out.sb, lay.d_out.sh,
        lay.d_out.sr, lay.dk.sb, lay.dk.sh, lay.dk.sr, lay.dv.sb, lay.dv.sh, lay.dv.sr, lay.q.sb, lay.q.sh, lay.q.sr);
    CHECK(cudaGetLastError());
  }
};

Call make_call(const Shape& s, const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
               const std::vector<float>& d_out, const std::vector<float>& stats) {
  Call c{s, probe::upload(q), probe::upload(k), probe::upload(v), probe::upload(d_out), probe::upload(stats)};
  CHECK(cudaMalloc(&c.dq, c.nq() * 4));
  CHECK(cudaMalloc(&c.dk, c.nk() * 4));
  CHECK(cudaMalloc(&c.dv, c.nk() * 4));
  return c;
}

// The float64 gradient of causal attention (bottom-right aligned for L !=
// S), and the statistics the keys pass reads: each row's log-sum-exp (log2
// domain) and D = rowsum(dO * O).
struct Reference {
  std::vector<double> dq, dk, dv;
  std::vector<float> stats;
};
Reference reference(const Shape& s, const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, const std::vector<float>& d_out) {
  const double scale = 1.0 / std::sqrt(double(E));
  const int ratio = s.H_q / s.H_kv, offset = s.S - s.L;
  Reference r{std::vector<double>(q.size()), std::vector<double>(k.size()), std::vector<double>(k.size()),
              std::vector<float>(size_t(s.H_q) * s.L * 2)};
  for (int h = 0; h < s.H_q; ++h) {
    const size_t kv = size_t(h / ratio) * s.S * E;
    for (int i = 0; i < s.L; ++i) {
      const size_t row = (size_t(h) * s.L + i) * E;
      const int end = std::min(s.S, i + offset + 1);
      std::vector<double> p(std::max(end, 0));
      double m = -INFINITY, l = 0;
      for (int j = 0; j < end; ++j) {
        double d = 0;
        for (int e = 0; e < E; ++e) d += double(q[row + e]) * k[kv + size_t(j) * E + e];
        m = std::max(m, p[j] = d * scale);
      }
      for (int j = 0; j < end; ++j) l += (p[j] = std::exp(p[j] - m));
      double D = 0;
      for (int e = 0; e < E; ++e) {
        double o = 0;
        for (int j = 0; j < end; ++j) o += p[j] / l * v[kv + size_t(j) * E + e];
        D += double(d_out[row + e]) * float(o);
      }
      r.stats[(size_t(h) * s.L + i) * 2] = end > 0 ? float((m + std::log(l)) * 1.4426950408889634) : INFINITY;
      r.stats[(size_t(h) * s.L + i) * 2 + 1] = float(D);
      for (int j = 0; j < end; ++j) {
        p[j] /= l;
        double x = 0;
        for (int e = 0; e < E; ++e) x += double(d_out[row + e]) * v[kv + size_t(j) * E + e];
        const double ds = p[j] * (x - D);
        for (int e = 0; e < E; ++e) {
          r.dv[kv + size_t(j) * E + e] += p[j] * d_out[row + e];
          r.dq[row + e] += scale * ds * k[kv + size_t(j) * E + e];
          r.dk[kv + size_t(j) * E + e] += scale * ds * q[row + e];
        }
      }
    }
  }
  return r;
}

void check(const Shape& s) {
  std::vector<float> q = probe::randn<float>(size_t(s.H_q) * s.L * E, 11), k = probe::randn<float>(size_t(s.H_kv) * s.S * E, 12),
                     v = probe::randn<float>(size_t(s.H_kv) * s.S * E, 13), d_out = probe::randn<float>(q.size(), 14);
  const Reference ref = reference(s, q, k, v, d_out);
  const Call c = make_call(s, q, k, v, d_out, ref.stats);
  for (const Kernel& kn : kKernels) {
    c.run(kn);
    CHECK(cudaDeviceSynchronize());
    const double eq = probe::rel_error(download(c.dq, c.nq()), ref.dq),
                 ek = probe::rel_error(download(c.dk, c.nk()), ref.dk),
                 ev = probe::rel_error(download(c.dv, c.nk()), ref.dv);
    std::printf("check %-8s H %d/%d L=%4d S=%4d: dQ %.1e dK %.1e dV %.1e %s\n", kn.name, s.H_q, s.H_kv, s.L, s.S, eq,
                ek, ev, std::max({eq, ek, ev}) < 2e-5 ? "ok" : "FAILED");
  }
}

// Values that are not finite: an infinite Q element, a NaN V row and an
// infinite K element; the first and last kernels' gradients side by side
// (NaN where the other has NaN, else within float32 accuracy).
void check_non_finite(const Shape& s) {
  std::vector<float> q = probe::randn<float>(size_t(s.H_q) * s.L * E, 21), k = probe::randn<float>(size_t(s.H_kv) * s.S * E, 22),
                     v = probe::randn<float>(size_t(s.H_kv) * s.S * E, 23), d_out = probe::randn<float>(q.size(), 24);
  const Reference ref = reference(s, q, k, v, d_out);  // statistics of the finite inputs
  q[size_t(5) * E + 3] = INFINITY;
  for (int e = 0; e < E; ++e) v[size_t(s.S - 40) * E + e] = NAN;
  k[size_t(s.S + 70) * E + 9] = -INFINITY;  // KV head 1
  const Call c = make_call(s, q, k, v, d_out, ref.stats);
  std::vector<std::vector<double>> out[2];
  for (int i = 0; i < 2; ++i) {
    c.run(kKernels[i % kCount]);
    CHECK(cudaDeviceSynchronize());
    out[i] = {download(c.dq, c.nq()), download(c.dk, c.nk()), download(c.dv, c.nk())};
  }
  const char* names[3] = {"dQ", "dK", "dV"};
  for (int g = 0; g < 3; ++g) {
    size_t nan_a = 0, nan_b = 0, differ = 0;
    double num = 0, den = 0;
    for (size_t i = 0; i < out[0][g].size(); ++i) {
      const double a = out[0][g][i], b = out[1][g][i];
      nan_a += std::isnan(a), nan_b += std::isnan(b);
      if (std::isnan(a) != std::isnan(b) || (std::isinf(a) || std::isinf(b)) && a != b) {
        ++differ;
      } else if (std::isfinite(a)) {
        num += (a - b) * (a - b), den += a * a;
      }
    }
    std::printf("non-finite %s: NaN %zu / %zu, elements that differ in kind %zu, relative difference %.1e %s\n",
                names[g], nan_a, nan_b, differ, std::sqrt(num / den),
                differ == 0 && std::sqrt(num / den) < 2e-5 ? "ok" : "FAILED");
  }
}

void timing(const Shape& s, int reps) {
  const size_t nq = size_t(s.H_q) * s.L * E, nk = size_t(s.H_kv) * s.S * E;
  std::vector<float> stats(size_t(s.H_q) * s.L * 2);
  for (size_t i = 0; i < stats.size(); i += 2) stats[i] = 8.0f, stats[i + 1] = 0.1f;  // any finite statistics
  const Call c = make_call(s, probe::randn<float>(nq, 1), probe::randn<float>(nk, 2), probe::randn<float>(nk, 3),
                           probe::randn<float>(nq, 4), stats);
  const double half = double(s.H_q) * s.L * s.S * E / 2;  // causal: half the scores; 5 products of them
  std::printf("time H %d/%d L=%d:", s.H_q, s.H_kv, s.L);
  for (const Kernel& kn : kKernels) {
    const float t = probe::median_ms([&] { c.run(kn); }, reps);
    std::printf("  %s %.3f ms (%.0f TF/s)", kn.name, t, 10 * half / t / 1e9);
  }
  std::printf("\n");
}

int main(int argc, char** argv) {
  probe::print_gpu();
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  for (const Kernel& kn : kKernels)
    CHECK(cudaFuncSetAttribute(kn.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kn.smem));
  if (reps == 1) {  // for Nsight Compute: one launch each at 8K
    timing({14, 2, 8192, 8192}, 1);
    return 0;
  }
  check({4, 2, 300, 300});
  check({2, 2, 77, 333});
  check({7, 1, 1000, 1000});
  if (kCount > 1) {
    check_non_finite({4, 2, 200, 200});
  } else {
    std::printf("non-finite: compared against a baseline only (-DFA_BASELINE_DIR)\n");
  }
  for (int r = 0; r < 3; ++r) {
    timing({14, 2, 8192, 8192}, reps);
    timing({14, 2, 4096, 4096}, reps);
  }
  return 0;
}
