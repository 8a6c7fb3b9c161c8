// Can Intel's AMX tiles make the CPU's float32 products faster? Measures, on
// one machine and in one run, float32 FMA throughput (AVX-512, 12 independent
// chains a thread) against bfloat16 TDPBF16PS throughput (four independent
// 16 x 16 accumulators a thread), on 1 and 2 threads. float32 accuracy from
// bfloat16 tiles needs each operand as three bfloat16 terms and six products
// (the terms below 2^-24 dropped), so the tiles pay for float32 only where
// AMX's multiply-adds a second exceed six times the FMA units'.
//
//   g++ -O3 -march=native -pthread -o /tmp/amx-probe benchmarks/cpu-probes/amx-probe.cpp && /tmp/amx-probe
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

static float fma_chains(long n) {
  __m512 a[12];
  const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(float(i));
  for (long k = 0; k < n; ++k)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
  float s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(a[i]);
  return s;
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static float amx_products(long n) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) a[i] = b[i] = 0x3c00;  // bfloat16 2^-7
  _tile_loadd(4, a, 64); _tile_loadd(5, b, 64); _tile_loadd(6, a, 64); _tile_loadd(7, b, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (long k = 0; k < n; ++k) {
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 6, 5); _tile_dpbf16ps(3, 6, 7);
  }
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0];
}

// Multiply-adds a second (1e9) over `threads` threads, each running f(n).
template <typename F>
static double rate(F f, long n, double per_call, int threads) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&] { volatile float r = f(n); (void)r; });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return per_call * n * threads / s / 1e9;
}

int main() {
  // Linux hands out AMX's tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::printf("AMX: refused by the kernel (or absent)\n");
    return 1;
  }
  for (int round = 0; round < 3; ++round)
    for (int threads : {1, 2}) {
      const double fma = rate(fma_chains, 100000000, 12.0 * 16, threads);
      const double amx = rate(amx_products, 5000000, 4.0 * 16 * 16 * 32, threads);
      std::printf("round %d, %d thread(s): float32 FMA %6.1f G multiply-adds/s, bfloat16 AMX %6.1f (%.1fx; "
                  "float32 from six bfloat16 products %.2fx)\n",
                  round, threads, fma, amx, amx / fma, amx / fma / 6);
    }
}
