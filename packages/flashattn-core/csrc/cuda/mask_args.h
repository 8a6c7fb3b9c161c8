// The mask as the CUDA kernels read it: (data, per-(batch, query head) base
// offsets, row stride, column stride). Without an array mask the kernels
// never read either pointer, so the queries stand in (no extra arrays, no
// extra work).

#pragma once

#include <optional>

#include "../flash_attention.h"

namespace flashattn::cuda {

struct MaskArgs {
  mx::array data, base;
  int row_stride = 0, col_stride = 0;
};

MaskArgs mask_args(const mx::array& q, MaskKind kind, const std::optional<mx::array>& mask, mx::Stream s);

// The dtype's name in the kernels' entry points.
const char* dtype_name(mx::Dtype t);

}  // namespace flashattn::cuda
