// Standalone probe of the float32 prefill at E = 80, 96 or 128 (-DFA_E,
// 128 by default): prefill_tf32.cu's mma.sync kernel against
// prefill_tf32_pairs.cu's and, at E = 128, prefill_tf32_wg.cu's wgmma one,
// on the same random inputs, checked against float64 on sampled rows and
// timed with CUDA events:
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/probe benchmarks/cuda-probes/prefill-pairs-probe.cu && /tmp/probe

#define FA_DTYPE 0
#ifndef FA_E
#define FA_E 128
#endif
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_tf32.cu"
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_tf32_pairs.cu"
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_tf32_wg.cu"
#include "harness.cuh"

__global__ void __launch_bounds__(fa::Tf32Smem<FA_E>::THREADS) mma_kernel(
    const float* q, const float* k, const float* v, const void* mask, const int64_t* mask_base, float* out, int H_q,
    int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill_tf32<FA_E>(fa::Tf32Rows{q, k, v, FA_LAYOUT}, mask, mask_base, out, nullptr, H_q, H_kv, L, S, mask_kind,
                        mask_rs, mask_cs, scale_log2);
}
__global__ void __launch_bounds__(fa::tf32_shapes::pairs::kThreads, 1) pairs_kernel(
    const float* q, const float* k, const float* v, const void* mask, const int64_t* mask_base, float* out, int H_q,
    int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill_tf32_pairs<FA_E>(q, k, v, mask, mask_base, out, nullptr, H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs,
                         scale_log2, FA_LAYOUT);
}

__global__ void __launch_bounds__(fa::kWgThreads, 1) wg_kernel(
    const float* q, const float* k, const float* v, const void* mask, const int64_t* mask_base, float* out, int H_q,
    int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, FA_LAYOUT_PARAMS) {
  if constexpr (fa::wg_shapes::tf32_has(FA_E)) {
    fa::prefill_tf32_wg<FA_E>(fa::Tf32Rows{q, k, v, FA_LAYOUT}, mask, mask_base, out, nullptr, H_q, H_kv, L, S,
                              mask_kind, mask_rs, mask_cs, scale_log2);
  }
}

int main(int argc, char** argv) {
  using probe::run;
  probe::print_gpu();
  namespace tp = fa::tf32_shapes::pairs;
  std::vector<probe::Launch<float>> launches = {
      {"mma.sync 3xTF32", mma_kernel, 64, 128, int(sizeof(fa::Tf32Smem<FA_E>))},
      {"pairs 3xTF32", pairs_kernel, tp::kRows, tp::kThreads, tp::smem_bytes(FA_E)},
  };
  namespace ws = fa::wg_shapes;
  if (ws::tf32_has(FA_E)) launches.push_back({"wgmma 3xTF32", wg_kernel, ws::kTf32Rows, ws::kTf32Threads, ws::tf32_smem_bytes(FA_E)});
  if (std::getenv("CHECK")) {  // the edge cases alone: masks, NaN values, ragged tiles
    run<float, FA_E>({32, 8, 1000, 1000, 0, 500}, launches, 3);
    run<float, FA_E>({4, 2, 300, 1000, 1, 700}, launches, 3);
    run<float, FA_E>({4, 2, 77, 1003, 1, -1}, launches, 3);
    run<float, FA_E>({4, 1, 200, 333, 1, 250}, launches, 3);
    run<float, FA_E>({4, 1, 129, 129, 1, -1}, launches, 3);
    return 0;
  }
  const int reps = argc > 1 ? std::atoi(argv[1]) : 10;
  run<float, FA_E>({32, 8, 8192, 8192, 1, -1}, launches, reps);
  run<float, FA_E>({32, 8, 2048, 8192, 1, -1}, launches, reps);
  run<float, FA_E>({32, 8, 2048, 2048, 1, -1}, launches, reps);
  run<float, FA_E>({32, 8, 1000, 1000, 0, 500}, launches, 3);
  run<float, FA_E>({4, 2, 300, 1000, 1, 700}, launches, 3);
  return 0;
}
