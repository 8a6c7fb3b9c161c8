#include "mask_layout.h"

namespace flashattn {

MaskLayout mask_layout(const mx::array& q, const mx::array& mask, mx::Stream s) {
  const int nd = q.ndim();
  mx::Shape shape(nd - mask.ndim(), 1);
  shape.insert(shape.end(), mask.shape().begin(), mask.shape().end());
  // Strides of the mask laid out row-contiguously in its own shape, zeroed
  // on broadcast axes.
  std::vector<int64_t> strides(nd, 0);
  int64_t acc = 1;
  for (int d = nd - 1; d >= 0; --d) {
    strides[d] = shape[d] == 1 ? 0 : acc;
    acc *= shape[d];
  }
  MaskLayout layout{mx::reshape(mask, shape, s)};
  layout.row_stride = static_cast<int>(strides[nd - 2]);
  layout.col_stride = static_cast<int>(strides[nd - 1]);
  int64_t count = 1;
  for (int d = 0; d < nd - 2; ++d) count *= q.shape(d);
  layout.base.resize(count);
  for (int64_t i = 0; i < count; ++i) {
    int64_t rem = i, off = 0;
    for (int d = nd - 3; d >= 0; --d) {
      off += (rem % q.shape(d)) * strides[d];
      rem /= q.shape(d);
    }
    layout.base[i] = off;
  }
  return layout;
}

}  // namespace flashattn
