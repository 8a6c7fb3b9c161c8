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
__global__ void __launch_bounds__(fa::prefill_warps<E>() * 32) mma_kernel(
    const T* q, const T* k, const T* v, const void* mask, const int64_t* mask_base, T* out, int H_q, int H_kv,
    int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill<T, E>(q, k, v, mask, mask_base, out, H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs, scale_log2,
                    FA_LAYOUT);
}
template <int E, int G, int BC, bool OVERLAP, bool PRODUCER = false, int ITEMS = 1>
__global__ void __launch_bounds__(128 * (G + PRODUCER), 1) wg_kernel(
    const T* q, const T* k, const T* v, const void* mask, const int64_t* mask_base, T* out, int H_q, int H_kv,
    int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, int slices, FA_LAYOUT_PARAMS) {
  fa::prefill_wg<T, E, fa::WhShape<G, BC, OVERLAP, PRODUCER, ITEMS>>(q, k, v, mask, mask_base, out, H_q, H_kv, L, S,
                                                                     mask_kind, mask_rs, mask_cs, scale_log2, slices, 0, 0,
                                                                     FA_LAYOUT);
}

// The same with TMA copies (the shipped 16-bit kernels: wg_shapes.h's kF16Tma).
template <int E, int G, int BC, bool OVERLAP, int ITEMS>
__global__ void __launch_bounds__(128 * (G + 1), 1) wg_tma_kernel(
    const T* q, const T* k, const T* v, const void* mask, const int64_t* mask_base, T* out, int H_q, int H_kv,
    int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, int slices, FA_LAYOUT_PARAMS,
    const void* map_template, void* map_slots, unsigned long long tag) {
  fa::prefill_wg<T, E, fa::WhShape<G, BC, OVERLAP, true, ITEMS, true>>(
      q, k, v, mask, mask_base, out, H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs, scale_log2, slices, 0, 0, FA_LAYOUT,
      static_cast<const fa::MapTemplate*>(map_template), map_slots, tag);
}

// A wgmma kernel of G warpgroups and key/value tiles of BC keys, every one
// copying and computing (the baseline of the producer variants below; the
// shipped shapes are in wg_shapes.h).
#define WG(E, G, BC, OV)                                                                    \
  probe::Launch<T> {                                                                        \
    "wgmma bf16 " #G " x " #BC " overlap " #OV, nullptr, 64 * G, 128 * G,                   \
        int(sizeof(fa::WhSmem<T, E, fa::WhShape<G, BC, OV>>)), wg_kernel<E, G, BC, OV>        \
  }
// The same with a producer warpgroup (G consumers + 1).
#define WGP(E, G, BC, OV)                                                                   \
  probe::Launch<T> {                                                                        \
    "wgmma bf16 " #G "+1 x " #BC " overlap " #OV, nullptr, 64 * G, 128 * (G + 1),           \
        int(sizeof(fa::WhSmem<T, E, fa::WhShape<G, BC, OV, true>>)), wg_kernel<E, G, BC, OV, true> \
  }
// The same with one block per SM taking many row tiles (the shipped E = 128 launch).
#define WGP2(E, G, BC, OV)                                                                  \
  probe::Launch<T> {                                                                        \
    "wgmma bf16 " #G "+1 x " #BC " scheduled", nullptr, 64 * G, 128 * (G + 1),              \
        int(sizeof(fa::WhSmem<T, E, fa::WhShape<G, BC, OV, true, 2>>)),                        \
        wg_kernel<E, G, BC, OV, true, 2>, true                                              \
  }
// The shipped launches: TMA copies, one block per SM taking many row tiles
// when ITEMS = 2 (E = 128), one row tile a block otherwise (E = 64).
#define WGT(E, G, BC, OV, ITEMS)                                                                    \
  probe::Launch<T> {                                                                                \
    "wgmma bf16 " #G "+1 x " #BC " TMA" #ITEMS, nullptr, 64 * G, 128 * (G + 1),                     \
        int(sizeof(fa::WhSmem<T, E, fa::WhShape<G, BC, OV, true, ITEMS, true>>)), nullptr, ITEMS == 2, \
        wg_tma_kernel<E, G, BC, OV, ITEMS>                                                          \
  }
// (Three tile buffers: 3 x 128 keys at E = 128 would not fit shared memory.)
template <int E>
std::vector<probe::Launch<T>> launches() {
  std::vector<probe::Launch<T>> all = {{"mma.sync bf16", mma_kernel<E>, 16 * fa::prefill_warps<E>(),
                                        32 * fa::prefill_warps<E>(), int(sizeof(fa::PrefillSmem<T, E>))},
                                       WG(E, 2, 128, true), WGP(E, 2, 128, true), WGP2(E, 2, 128, true),
                                       WGT(E, 2, 128, true, 2)};
  if (E == 64) {
    all.push_back(WGP(E, 3, 128, true));
    all.push_back(WGP2(E, 3, 128, true));
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
