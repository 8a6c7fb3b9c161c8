// What the CUDA nodes share when they run (primitive.cpp's attention,
// backward_node.cpp's gradients): the inputs' strides read as the kernels'
// rows, outputs laid out as an input lies, and a launch through MLX's
// custom-kernel primitive.

#pragma once

#include <optional>
#include <vector>

#include "cuda/plan.h"
#include "mlx/array.h"

namespace flashattn::cuda {

// Batch, head and row strides of q, k or v (B..., H, N, E), in elements;
// 0 on axes of size 1.
struct Rows {
  int64_t sb = 0, sh = 0, sr = 0;
};

// x's rows as they lie, when the kernels can read them there (the head dim
// contiguous, the batch axes collapsing into one, strides and one batch
// element's offsets that fit the 32-bit launch arguments); otherwise
// nullopt: MLX copies x first.
std::optional<Rows> rows_in_place(const mx::array& x);

// The rows of x's row-contiguous copy.
Rows contiguous_rows(const mx::array& x);

// Whether every row starts on a 16-byte boundary (the fast kernels' vector
// loads; the generic kernel reads element by element).
bool rows_aligned(const Rows& r, int64_t offset_bytes, int64_t itemsize);

// An output laid out as the queries are, as MLX's own attention allocates
// its output: mlx-lm's queries are (B, L, H, E) transposed, and its
// transpose of the output back to (B, L, H E) then copies nothing (one copy
// a layer a pass otherwise).
struct OutLayout {
  mx::Strides strides;  // dense: q's order of axes, the head dim innermost
  Rows rows;
};

// `out` (x's shape) laid out as x lies; nullopt where that layout is
// row-contiguous anyway, or its rows are not the kernels' (then `out` is
// row-contiguous).
std::optional<OutLayout> like_queries(const mx::array& x, const mx::array& out);

// x's rows as a launch reads them: where they lie, or where MLX copies an
// input that is not row-contiguous first (copy), its copy's.
Rows rows_as_read(const mx::array& x, const std::optional<Rows>& place, bool copy);

// The rows a launch writes `out` in: its layout's, or row-contiguous.
Rows rows_written(const std::optional<OutLayout>& layout, const mx::array& out);

// `out` as a view of `buffer`, which a launch wrote in layout's order.
void view_in_layout(mx::array& out, const mx::array& buffer, const OutLayout& layout);

void push_rows(std::vector<Scalar>& scalars, const Rows& r);

// One launch: MLX's custom-kernel primitive for `step`, evaluated into `out`.
// copy: MLX copies inputs that are not row-contiguous first. init: what
// MLX fills the outputs with first (none, or NaN under
// FLASHATTN_CUDA_POISON: poison_value).
void launch(const Step& step, const std::vector<Scalar>& scalars, const std::vector<mx::array>& in,
            std::vector<mx::array>& out, bool copy, const mx::Stream& s, std::optional<float> init);

}  // namespace flashattn::cuda
