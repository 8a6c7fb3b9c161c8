// The flash_attention node of a CUDA graph. Its launches were planned from
// shapes (plan.h); it runs them through MLX's custom-kernel primitive once
// the inputs exist and their strides are known, so strided views reach the
// kernels without a copy. Outputs: the attention output, then (prefill, or
// a merge for a gradient) the rows' log-sum-exp or its placeholder, (Hopper
// prefill) the tensor maps' scratch, then the key splits' partials when
// there is a merge or the fused decode merges them (MLX keeps a node's
// outputs alive until its kernels have run). The fused decode writes its
// attention output into the first partials array too, and the first output
// is a view of it.

#pragma once

#include <memory>
#include <optional>

#include "cuda/plan.h"
#include "mlx/primitives.h"

namespace flashattn::cuda {

class Attention : public mx::Primitive {
 public:
  // plan: shared with the planner's recent calls (dispatch.cpp), never changed.
  Attention(mx::Stream stream, std::shared_ptr<const Plan> plan) : mx::Primitive(stream), plan_(std::move(plan)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "FlashAttentionCUDA";
  }

 private:
  std::shared_ptr<const Plan> plan_;
};

// FLASHATTN_CUDA_POISON=1 (tests): NaN, which every launch's outputs are
// filled with before its kernel runs, so that an element a kernel forgets
// to write cannot pass; otherwise nullopt.
std::optional<float> poison_value();

}  // namespace flashattn::cuda
