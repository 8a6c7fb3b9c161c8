// The 16-bit backward's node on a CUDA stream (backward_node.h): the
// inputs' rows and the gradients' layouts, then the statistics pass, the
// keys pass and the cast of the sums.

#include "cuda/backward_node.h"

#include <array>
#include <optional>
#include <stdexcept>

#include "cuda/node.h"

namespace flashattn::cuda {

void Backward16::eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("flash_attention: the CUDA backward node ran on a CPU stream");
}

void Backward16::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::Stream s = stream();
  const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2], &o = inputs[3], &d_out = inputs[4];
  const mx::array &mask_data = inputs[5], &mask_base = inputs[6];
  // Q, K, V, O and dO where they lie; where one cannot be read there (or the
  // mask's arrays are not row-contiguous), MLX copies every strided input
  // of a launch row-contiguous first, as for the forward.
  bool copy = (steps_.mask_arrays && (!mask_data.flags().row_contiguous || !mask_base.flags().row_contiguous)) ||
      (steps_.lse && !inputs[7].flags().row_contiguous);
  std::array<std::optional<Rows>, 5> place;
  for (int i = 0; i < 5; ++i) {
    place[i] = rows_in_place(inputs[i]);
    copy |= !place[i].has_value();
  }
  std::vector<Scalar> layout;
  for (int i = 0; i < 5; ++i) {
    const mx::array& x = inputs[i];
    push_rows(layout, rows_as_read(x, place[i], copy));
  }
  // The gradients laid out as their inputs, each written into a buffer of
  // its own that the output then views (as the forward's output).
  std::array<std::optional<OutLayout>, 3> grad_layout;
  std::array<mx::array, 3> grads = {outputs[0], outputs[1], outputs[2]};
  for (int i = 0; i < 3; ++i) {
    grad_layout[i] = like_queries(inputs[i], outputs[i]);
    if (grad_layout[i]) grads[i] = mx::array(outputs[i].shape(), outputs[i].dtype(), nullptr, {});
  }
  auto grad_rows = [&](int i) { return rows_written(grad_layout[i], outputs[i]); };
  push_rows(layout, grad_rows(1));
  push_rows(layout, grad_rows(2));
  auto with_layout = [&](const Step& step) {
    std::vector<Scalar> scalars = step.scalars;
    scalars.insert(scalars.end(), layout.begin(), layout.end());
    return scalars;
  };

  // The statistics: (lse, D), the flags, and the sums zeroed.
  std::vector<mx::array> stats = {outputs[3], outputs[4], outputs[5]};
  const std::vector<mx::array> stats_in = steps_.lse ? std::vector<mx::array>{q, o, d_out, inputs[7]}
                                                     : std::vector<mx::array>{q, k, o, d_out, mask_data, mask_base};
  launch(steps_.stats, with_layout(steps_.stats), stats_in, stats, copy, s);

  // The keys pass: dK and dV (placeholders under GQA, where it adds into
  // the sums), dQ added into its sums.
  std::vector<mx::array> keys_in = {q, k, v, d_out, stats[0]};
  if (steps_.flags_input) keys_in.push_back(stats[1]);
  keys_in.insert(keys_in.end(), {mask_data, mask_base, stats[2]});
  std::vector<mx::array> keys = steps_.group_sums ? std::vector<mx::array>{outputs[6], outputs[7]}
                                                  : std::vector<mx::array>{grads[1], grads[2]};
  launch(steps_.keys, with_layout(steps_.keys), keys_in, keys, copy, s);

  // The sums cast; `after` (an output of the keys pass) orders this launch
  // after it in MLX's graph (kernels/backward_dq.cu).
  std::vector<Scalar> cast_scalars = steps_.cast.scalars;
  for (int i = 0; i < 3; ++i) push_rows(cast_scalars, grad_rows(i));
  std::vector<mx::array> cast = steps_.group_sums ? std::vector<mx::array>{grads[0], grads[1], grads[2]}
                                                  : std::vector<mx::array>{grads[0], outputs[6], outputs[7]};
  launch(steps_.cast, cast_scalars, {stats[2], keys[0]}, cast, false, s);

  for (int i = 0; i < 3; ++i) {
    if (grad_layout[i]) {
      view_in_layout(outputs[i], grads[i], *grad_layout[i]);
    }
  }
}

}  // namespace flashattn::cuda
