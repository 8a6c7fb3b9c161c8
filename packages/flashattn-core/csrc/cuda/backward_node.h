// The 16-bit backward's node of a CUDA graph. backward.cpp plans its three
// launches from shapes; the node runs them once the inputs exist and their
// strides are known, so that the kernels read Q, K, V, O and dO where they
// lie (mlx-lm's transposed views) and store dQ, dK and dV laid out as Q, K
// and V are, so that mlx-lm's transposes of them are views. Copying them
// instead cost 8 launches a backward call (docs/cuda.md, "Gradients in place").
//
// Inputs: q, k, v, o, dO, the mask's data and base offsets (cuda/mask_args.h),
// and where the forward kept it the rows' log-sum-exp. Outputs: dQ, dK, dV,
// then the launches' own (MLX keeps a node's outputs alive until its kernels
// have run): the statistics (lse, D), the rows' flags, the gradients' float32
// sums, and two placeholders.

#pragma once

#include <memory>

#include "cuda/plan.h"
#include "mlx/primitives.h"

namespace flashattn::cuda {

struct BackwardSteps {
  Step stats;  // fa_backward_dflags_ (with the log-sum-exp) or a statistics pass
  Step keys;   // fa_backward_keyswg*_ (takes the flags) or fa_backward_keysq_
  Step cast;   // fa_backward_dq_: dQ (and under GQA dK, dV) from the sums
  bool lse = false;
  bool mask_arrays = false;  // the mask's data and offsets are read (else placeholders)
  bool flags_input = false;  // the keys pass reads the statistics' flags
  bool group_sums = false;   // GQA: dK and dV summed in float32, cast after
};

class Backward16 : public mx::Primitive {
 public:
  Backward16(mx::Stream stream, BackwardSteps steps) : mx::Primitive(stream), steps_(std::move(steps)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "FlashAttentionBackwardCUDA";
  }

 private:
  BackwardSteps steps_;
};

}  // namespace flashattn::cuda
