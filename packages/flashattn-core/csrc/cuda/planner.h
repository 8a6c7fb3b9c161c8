// The planner's parts: a call as the planner sees it (Dims), each kernel
// family's launches (plan_decode.cpp, plan_prefill.cpp, plan_generic.cpp)
// and the choice among them with the primitive's outputs (plan.cpp).

#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cuda/kernels/causal.h"
#include "cuda/kernels/mask_bits.h"
#include "cuda/plan.h"

namespace flashattn::cuda {

// Threads of a generic or decode.cu block.
inline constexpr int kThreads = 128;
inline constexpr int kMinPrefillL = 9;  // below: the decode path

// What the launches depend on, from the shapes.
struct Dims {
  int64_t batch;
  int H_q, H_kv, L, S, E;
  std::string dt;
  int kind, mask_rs, mask_cs;
  float scale_log2;
  bool widen;     // float32 attention over 16-bit inputs, float32 output
  int kind_arg;   // the kernels' mask_kind argument: kind, and the sinks' bits (kernels/mask_bits.h)
  // Keys and values both quantized alike (MLX's affine format), read in
  // place by the quantized decode or prefill: bits and group size; 0
  // otherwise.
  int quant_bits = 0, quant_group = 0;
  // A gradient may be taken: the prefill kernels (or the generic kernel's
  // merge) also write each row's log-sum-exp, which the backward reads
  // instead of taking it again.
  bool lse = false;
  // Widened 16-bit prefill: the output E / 2 wide, each row's two halves
  // added (kernels/mask_bits.h's kFold; quantized.cpp's two terms).
  bool fold = false;
  // With fold, on Hopper's two-term units (fa_prefill_wg32t_): the queries
  // E / 2 wide, read twice (the keys and values [hi | lo], E wide).
  bool two_terms = false;
  // Widened, a 16-bit output asked for (flash_attention's out_dtype): the
  // wgmma prefill's fa_prefill_wg32h_ stores it (fa_prefill_wg32th_ over
  // two terms), and the generic kernel's
  // merge for rows that prefill cannot read; plan_call clears it where the
  // planned kernels write float32 (the caller then casts).
  bool out16 = false;
  bool sinks() const { return (kind_arg & fa::kSinks) != 0; }
  // A causal mask's sliding window (carried in mask_cs: kernels/mask_bits.h), else 0.
  int window() const {
    return kind == static_cast<int>(MaskKind::causal) && mask_cs != fa::kNoWindow ? mask_cs : 0;
  }
  bool quantized() const { return quant_bits != 0; }
  // log2 of the group size (the quantized kernels' group_shift argument).
  int quant_group_shift() const {
    int shift = 0;
    while ((1 << shift) < quant_group) ++shift;
    return shift;
  }
};

// The decode launches, when decode takes the call; splits: the key splits chosen.
std::optional<Launches> decode_launches(const Dims& d, int& splits);

// The tensor-core prefill's launches, when one takes the call and fits the
// GPU's shared memory.
std::optional<Launches> prefill_launches(const Dims& d, mx::Dtype dtype, int device_index);

// The generic kernel's key splits when it is the planned kernel: as many as
// keep the GPU busy when the rows are few.
int generic_splits(const Dims& d);

// The generic kernel: one warp per query row, any head dim, any strides.
// Widened (16-bit inputs, float32 output) always in its split form, even
// with one split: its partials are float32, and fa_merge_float32 writes a
// float32 output; so too with d.lse (fa_merge_lse_ writes the rows'
// log-sum-exp). aligned: every row starts on a 16-byte boundary, so the
// split form may take 16-byte loads (generic_vec.cu; the same partials).
Launches generic_launches(const Dims& d, int splits, bool aligned = false);

// A call's launches and its primitive's outputs (the attention output, the
// rows' log-sum-exp where a launch takes it, then scratch: the tensor maps',
// the partials). lse: the second output holds each row's log-sum-exp
// (d.lse, and a kernel of both plans writes it); else where it is there it
// is a placeholder.
struct Planned {
  Plan plan;
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  bool lse = false;
};

// nullopt: a widened call that no kernel takes as it is (the caller casts).
std::optional<Planned> plan_call(const Dims& d, mx::Dtype dtype, const mx::Shape& q_shape, int device_index);

}  // namespace flashattn::cuda
