// How the GPU kernels address a mask without broadcasting it: the mask stays
// in its own shape (made row-contiguous by the launch), and each (batch,
// query head) slice of the (B..., H_q, L, S) target starts at a base offset;
// row and column strides are 0 where the mask broadcasts.

#pragma once

#include <cstdint>
#include <vector>

#include "flash_attention.h"

namespace flashattn {

struct MaskLayout {
  mx::array data;             // the mask, reshaped to the queries' rank
  std::vector<int64_t> base;  // one offset per (B..., H_q) slice
  int row_stride = 0;
  int col_stride = 0;
};

MaskLayout mask_layout(const mx::array& q, const mx::array& mask, mx::Stream s);

}  // namespace flashattn
