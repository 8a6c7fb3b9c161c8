// Standalone probe of the bfloat16 prefill kernels, without MLX (see
// prefill-probe.cu): prefill_f16.cu (mma.sync) and prefill_f16_wg.cu (wgmma,
// Hopper) at E = 64 and 128 on the same random inputs, against a float64
// reference on sampled rows, timed with CUDA events.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/probe16 benchmarks/cuda-probes/prefill-probe-f16.cu && /tmp/probe16

#define FA_DTYPE 2
#define FA_E 64
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_f16.cu"
#include "../../packages/flashattn-core/csrc/cuda/kernels/prefill_f16_wg.cu"
#include "harness.cuh"

using T = __nv_bfloat16;

// Entry points for both head dims (the kernel files' own take FA_E's only).
template <int E>
__global__ void __launch_bounds__(fa::f16_shapes::warps(E) * 32) mma_kernel(
    const T* q, const T* k, const T* v, const void* mask, const int64_t* mask_base, T* out, int H_q, int H_kv,
    int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill<T, E>(q, k, v, mask, mask_base, out, nullptr, H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs, scale_log2,
                    FA_LAYOUT);
}
// The wgmma kernel as shipped: a producer warpgroup copying by TMA.
template <int E, int G, int BC, bool OVERLAP, int ITEMS>
__global__ void __launch_bounds__(128 * (G + 1), 1) wg_tma_kernel(
    const T* q, const T* k, const T* v, const void* mask, const int64_t* mask_base, T* out, int H_q, int H_kv,
    int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, int slices, FA_LAYOUT_PARAMS,
    const void* map_template, void* map_slots, unsigned long long tag) {
  fa::prefill_wg<T, E, fa::WhShape<G, BC, OVERLAP, ITEMS>>(
      q, k, v, mask, mask_base, out, nullptr, H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs, scale_log2, slices, 0, 0, FA_LAYOUT,
      static_cast<const fa::MapTemplate*>(map_template), map_slots, tag);
}

// The shipped launches: TMA copies, one block per SM taking many row tiles
// when ITEMS = 2 (E = 128), one row tile a block otherwise (E = 64).
#define WGT(E, G, BC, OV, ITEMS)                                                                    \
  probe::Launch<T> {                                                                                \
    "wgmma bf16 " #G "+1 x " #BC " TMA" #ITEMS, nullptr, 64 * G, 128 * (G + 1),                     \
        int(sizeof(fa::WhSmem<T, E, fa::WhShape<G, BC, OV, ITEMS>>)), nullptr, ITEMS == 2,             \
        wg_tma_kernel<E, G, BC, OV, ITEMS>                                                          \
  }
// (Three tile buffers: 3 x 128 keys at E = 128 would not fit shared memory.)
template <int E>
std::vector<probe::Launch<T>> launches() {
  std::vector<probe::Launch<T>> all = {{"mma.sync bf16", mma_kernel<E>, 16 * fa::f16_shapes::warps(E),
                                        32 * fa::f16_shapes::warps(E), int(sizeof(fa::PrefillSmem<T, E>))},
                                       WGT(E, 2, 128, true, 2)};
  if (E == 64) {
    all.push_back(WGT(E, 3, 128, true, 1));
    all.push_back(WGT(E, 3, 128, true, 2));
  }
  return all;
}

int main(int argc, char** argv) {
  using probe::run;
  probe::print_gpu();
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  run<T, 64>({14, 2, 8192, 8192, 1, -1}, launches<64>(), reps);
  run<T, 128>({32, 8, 4096, 4096, 1, -1}, launches<128>(), reps);
  run<T, 64>({14, 2, 2048, 2048, 1, -1}, launches<64>(), reps);
  run<T, 128>({32, 8, 1000, 1000, 0, -1}, launches<128>(), reps);
  run<T, 64>({4, 2, 300, 1000, 1, -1}, launches<64>(), reps);
  run<T, 128>({4, 1, 77, 77, 1, 40}, launches<128>(), 3);
  run<T, 64>({4, 1, 200, 333, 1, 250}, launches<64>(), 3);
  run<T, 128>({4, 4, 200, 333, 0, -1}, launches<128>(), 3);
  run<T, 128>({32, 8, 4096, 4096, 1, -1, 1}, launches<128>(), reps);  // mlx-lm's transposed queries
  run<T, 64>({14, 2, 1000, 1000, 1, -1, 1}, launches<64>(), reps);
  return 0;
}
