// A call as the planner sees it (Dims) and its plan, kept for the thread's
// next calls of the same shape (recent.h): the one route from an
// AttentionCall to a plan, for the plain kernels (dispatch.cpp) and the
// quantized ones (quantized.cpp).

#pragma once

#include <memory>
#include <optional>

#include "../flash_attention.h"
#include "cuda/mask_args.h"
#include "cuda/planner.h"

namespace flashattn::cuda {

// The call's Dims, its mask as `m` passes it (no quantization: the caller
// sets it).
Dims call_dims(const AttentionCall& call, const MaskArgs& m, bool widen);

// plan_call's answer for d, from the thread's last few plans where one of
// them has the same key (nullopt: no kernel takes the call as it is).
std::shared_ptr<const std::optional<Planned>> recent_plan(const Dims& d, mx::Dtype dtype, const mx::Shape& q_shape,
                                                          int device_index);

// The call's node for a plan found (`planned` holds one): its outputs, the
// second each row's log-sum-exp where the plan keeps it. m: the call's mask
// arguments, as the plan was made with them.
std::vector<mx::array> attention_node(const AttentionCall& call, const MaskArgs& m,
                                      const std::shared_ptr<const std::optional<Planned>>& planned);

}  // namespace flashattn::cuda
