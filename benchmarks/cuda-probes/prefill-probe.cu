// Standalone probe of the float32 prefill kernels, without MLX: both kernels
// (prefill_tf32.cu on mma.sync, prefill_tf32_wg.cu on wgmma) on the same
// random inputs, checked against a float64 reference on sampled rows and
// timed with CUDA events. For kernel work on a GPU machine where installing
// MLX's CUDA build would cost more than the build itself:
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/probe benchmarks/cuda-probes/prefill-probe.cu && /tmp/probe
//
// The GPU suite (scripts/cuda-check test) remains the correctness test.

#define FA_DTYPE 0
#define FA_E 64
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_tf32.cu"
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_tf32_wg.cu"
#include "harness.cuh"

// Entry points without the log-sum-exp output (the harness's kernel type).
__global__ void __launch_bounds__(fa::Tf32Smem<64>::THREADS) mma_kernel(
    const float* q, const float* k, const float* v, const void* mask, const int64_t* mask_base, float* out, int H_q,
    int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill_tf32<64>(fa::Tf32Rows{q, k, v, FA_LAYOUT}, mask, mask_base, out, nullptr, H_q, H_kv, L, S, mask_kind,
                       mask_rs, mask_cs, scale_log2);
}
__global__ void __launch_bounds__(fa::kWgThreads, 1) wg_kernel(
    const float* q, const float* k, const float* v, const void* mask, const int64_t* mask_base, float* out, int H_q,
    int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill_tf32_wg<64>(fa::Tf32Rows{q, k, v, FA_LAYOUT}, mask, mask_base, out, nullptr, H_q, H_kv, L, S,
                          mask_kind, mask_rs, mask_cs, scale_log2);
}

int main(int argc, char** argv) {
  using probe::run;
  probe::print_gpu();
  const std::vector<probe::Launch<float>> launches = {
      {"mma.sync 3xTF32", mma_kernel, 64, 128, int(sizeof(fa::Tf32Smem<64>))},
      {"wgmma 3xTF32", wg_kernel, fa::kWgBr, fa::kWgThreads, fa::wg_shapes::tf32_smem_bytes(64)},
  };
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  run<float, 64>({14, 2, 8192, 8192, 1, -1}, launches, reps);
  run<float, 64>({14, 2, 2048, 2048, 1, -1}, launches, reps);
  run<float, 64>({14, 2, 1000, 1000, 0, -1}, launches, reps);
  run<float, 64>({4, 2, 300, 1000, 1, -1}, launches, reps);
  run<float, 64>({4, 1, 77, 77, 1, 40}, launches, 3);
  run<float, 64>({4, 1, 200, 333, 1, 250}, launches, 3);
  return 0;
}
