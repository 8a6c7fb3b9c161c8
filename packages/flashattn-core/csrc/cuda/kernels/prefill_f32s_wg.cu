// fa_prefill_wgs_float32_64: float32 attention at float32 accuracy on
// Hopper's float16 tensor cores, head dim 64. f32_split.cu has made each of
// Q, K and V two float16 terms a row ([hi | lo], every 128-row tile scaled
// by a power of two); prefill_f16_wg.cu's split-query unit (kQS) then takes
// Q K^T as Q hi K hi + Q hi K lo + Q lo K hi and P V as P hi V hi + P hi V lo
// + P lo V hi, as 3xTF32 does on TF32 tensor cores of half the rate (H200,
// qwen05b causal 8K: 0.65 ms with the split against 1.25 for
// prefill_tf32_wg.cu, benchmarks/cuda-probes/prefill-f32split-probe.cu).
// Tiles holding a value that is not finite (the split marks them) take
// their scores and P V in plain float32 from the float32 inputs.

#define FA_NO_ENTRY
#include "prefill_f16_wg.cu"
#undef FA_NO_ENTRY

#if FA_DTYPE != 0 || FA_E != 64
#error "prefill_f32s_wg.cu: float32 at E = 64"
#endif

namespace fa {

using F32sShape = WhShape<wg_shapes::f16_groups(wg_shapes::kF32sStoredE),
                          wg_shapes::f16_bc(wg_shapes::kF32sStoredE, true), false, 1>;
static_assert(sizeof(WhSmem<__half, wg_shapes::kF32sStoredE, F32sShape, wg_shapes::kF32sStoredE>) ==
                  wg_shapes::f32s_smem_bytes(),
              "the planner's shared memory");

}  // namespace fa

// Inputs q, k, v (float32, read through FA_LAYOUT's strides where a tile is
// marked bad), the mask's data and base offsets, then q2, k2, v2 and shifts
// (f32_split.cu's outputs, packed); outputs the attention output, each row's
// log-sum-exp (where mask_kind has kLse) and the tensor maps' scratch; a
// grid of row tiles x H_q x batch, wg_shapes.h's threads (384) and
// f32s_smem_bytes.
extern "C" __global__ void __launch_bounds__(fa::F32sShape::kThreads, 1) fa_prefill_wgs_float32_64(
    const float* q, const float* k, const float* v, const void* mask, const int64_t* mask_base, const __half* q2,
    const __half* k2, const __half* v2, const int* shifts, float* out, float* lse, void* map_slots, int H_q,
    int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2, FA_LAYOUT_PARAMS,
    int tag_lo, int tag_hi, FA_MAP_TEMPLATE_PARAMS) {
  constexpr int E2 = fa::wg_shapes::kF32sStoredE;
  const fa::Layout lay = FA_LAYOUT;
  const fa::Rows q_rows{H_q * L * E2, L * E2, E2}, kv_rows{H_kv * S * E2, S * E2, E2};
  const fa::MapTemplate templ = FA_MAP_TEMPLATE;
  fa::prefill_wg<__half, E2, fa::F32sShape, true, true, float, true>(
      q2, k2, v2, mask, mask_base, out, lse, H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs, scale_log2, 0, 0, 0,
      fa::Layout{q_rows, kv_rows, kv_rows, lay.o}, &templ, map_slots, fa::call_tag(tag_lo, tag_hi), shifts,
      fa::f32_split::Source{q, k, v, lay});
}
