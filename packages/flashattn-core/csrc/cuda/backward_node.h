// The backward's nodes of a CUDA graph: the 16-bit kernels' (Backward16)
// and the others' (BackwardTF32). backward.cpp plans their launches from
// shapes; the node runs them once the inputs exist and their
// strides are known, so that the kernels read Q, K, V, O and dO where they
// lie (mlx-lm's transposed views) and store dQ, dK and dV laid out as Q, K
// and V are, so that mlx-lm's transposes of them are views. Copying them
// instead cost 8 launches a backward call (docs/cuda.md, "Gradients in place").
//
// Backward16's inputs: q, k, v, o, dO, the mask's data and base offsets
// (cuda/mask_args.h), and where the forward kept it the rows' log-sum-exp.
// Outputs: dQ, dK, dV, then the launches' own (MLX keeps a node's outputs alive until its kernels
// have run): the statistics (lse, D), the rows' flags, the gradients' float32
// sums, and two placeholders.

#pragma once

#include <memory>
#include <optional>

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

// The other kernels' two launches (kernels/backward.cu: TF32 tensor cores,
// float32 inputs and 16-bit ones above E = 128): where the forward kept
// the log-sum-exp and E <= 128, fa_backward_d_ then the keys pass with dQ
// (keysq); else the rows pass (dQ and the statistics) then the keys pass.
struct BackwardTF32Steps {
  // float32 at E = 64 (fa_f32_split4_64): k and v as two float16 terms a
  // row and the shifts of q's, k's, v's and dO's tiles, the node's outputs
  // 4-6, which the keys pass (fa_backward_keyswgsc_float32_64) reads after
  // its own inputs
  std::optional<Step> split;
  Step first;   // fa_backward_d_ or fa_backward_rows*_
  Step second;  // fa_backward_keysq*_, fa_backward_keyswgsc_ or fa_backward_keys*_
  bool keysq = false;
  bool lse = false;
  bool mask_arrays = false;
  bool group_sums = false;  // GQA: dK and dV float32 sums (zeros first)
};

// Inputs: q, k, v, o, dO, the mask's data and base offsets, the forward's
// log-sum-exp (or a placeholder). Outputs: dQ (float32 sums under keysq),
// dK, dV (float32 sums under GQA), the statistics (lse, D), and the split's
// five where it runs. A gradient in
// its input's dtype is laid out as that input; the sums that are cast after
// are row-contiguous.
class BackwardTF32 : public mx::Primitive {
 public:
  BackwardTF32(mx::Stream stream, BackwardTF32Steps steps) : mx::Primitive(stream), steps_(std::move(steps)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "FlashAttentionBackwardTF32CUDA";
  }

 private:
  BackwardTF32Steps steps_;
};

}  // namespace flashattn::cuda
