// The backward's nodes on a CUDA stream (backward_node.h): the inputs' rows
// and the gradients' layouts, then the launches: for the 16-bit kernels the
// statistics pass, the keys pass and the cast of the sums; for the others
// their two passes.

#include "cuda/backward_node.h"

#include <array>
#include <optional>
#include <stdexcept>

#include "cuda/node.h"
#include "cuda/primitive.h"

namespace flashattn::cuda {

void Backward16::eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("flash_attention: the CUDA backward node ran on a CPU stream");
}

namespace {

// Q, K, V, O and dO (inputs 0-4) as the launches read them: where they lie;
// where one cannot be read there (or `copy` already: another input that is
// not row-contiguous), MLX copies every strided input of a launch
// row-contiguous first, as for the forward. Their rows go into `layout`;
// returns whether MLX copies.
bool read_rows(const std::vector<mx::array>& inputs, bool copy, std::vector<Scalar>& layout) {
  std::array<std::optional<Rows>, 5> place;
  for (int i = 0; i < 5; ++i) {
    place[i] = rows_in_place(inputs[i]);
    copy |= !place[i].has_value();
  }
  for (int i = 0; i < 5; ++i) push_rows(layout, rows_as_read(inputs[i], place[i], copy));
  return copy;
}

// dQ, dK and dV (outputs 0-2), each laid out as its input (0-2) where
// `laid_out` says: written into a buffer of its own that the output then
// views (as the forward's output); else row-contiguous, the output itself.
struct Gradients {
  std::array<std::optional<OutLayout>, 3> layout;
  std::array<mx::array, 3> buffers;

  Gradients(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, std::array<bool, 3> laid_out)
      : buffers{outputs[0], outputs[1], outputs[2]} {
    for (int i = 0; i < 3; ++i) {
      if (laid_out[i]) layout[i] = like_queries(inputs[i], outputs[i]);
      if (layout[i]) buffers[i] = mx::array(outputs[i].shape(), outputs[i].dtype(), nullptr, {});
    }
  }
  Rows rows(int i) const {
    return rows_written(layout[i], buffers[i]);
  }
  void view(std::vector<mx::array>& outputs) const {
    for (int i = 0; i < 3; ++i) {
      if (layout[i]) view_in_layout(outputs[i], buffers[i], *layout[i]);
    }
  }
};

// A launch's scalars: its step's, then the arrays' rows.
std::vector<Scalar> with_layout(const Step& step, const std::vector<Scalar>& layout) {
  std::vector<Scalar> scalars = step.scalars;
  scalars.insert(scalars.end(), layout.begin(), layout.end());
  return scalars;
}

}  // namespace

void Backward16::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::Stream s = stream();
  const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2], &o = inputs[3], &d_out = inputs[4];
  const mx::array &mask_data = inputs[5], &mask_base = inputs[6];
  std::vector<Scalar> layout;
  const bool copy = read_rows(
      inputs,
      (steps_.mask_arrays && (!mask_data.flags().row_contiguous || !mask_base.flags().row_contiguous)) ||
          (steps_.lse && !inputs[7].flags().row_contiguous),
      layout);
  Gradients g(inputs, outputs, {true, true, true});
  std::array<mx::array, 3>& grads = g.buffers;
  push_rows(layout, g.rows(1));
  push_rows(layout, g.rows(2));

  // The statistics: (lse, D), the flags, and the sums zeroed.
  std::vector<mx::array> stats = {outputs[3], outputs[4], outputs[5]};
  const std::vector<mx::array> stats_in = steps_.lse ? std::vector<mx::array>{q, o, d_out, inputs[7]}
                                                     : std::vector<mx::array>{q, k, o, d_out, mask_data, mask_base};
  launch(steps_.stats, with_layout(steps_.stats, layout), stats_in, stats, copy, s, poison_value());

  // The keys pass: dK and dV (placeholders under GQA, where it adds into
  // the sums), dQ added into its sums.
  std::vector<mx::array> keys_in = {q, k, v, d_out, stats[0]};
  if (steps_.flags_input) keys_in.push_back(stats[1]);
  keys_in.insert(keys_in.end(), {mask_data, mask_base, stats[2]});
  std::vector<mx::array> keys = steps_.group_sums ? std::vector<mx::array>{outputs[6], outputs[7]}
                                                  : std::vector<mx::array>{grads[1], grads[2]};
  launch(steps_.keys, with_layout(steps_.keys, layout), keys_in, keys, copy, s, poison_value());

  // The sums cast; `after` (an output of the keys pass) orders this launch
  // after it in MLX's graph (kernels/backward_dq.cu).
  std::vector<Scalar> cast_scalars = steps_.cast.scalars;
  for (int i = 0; i < 3; ++i) push_rows(cast_scalars, g.rows(i));
  std::vector<mx::array> cast = steps_.group_sums ? std::vector<mx::array>{grads[0], grads[1], grads[2]}
                                                  : std::vector<mx::array>{grads[0], outputs[6], outputs[7]};
  launch(steps_.cast, cast_scalars, {stats[2], keys[0]}, cast, false, s, poison_value());

  g.view(outputs);
}

void BackwardTF32::eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("flash_attention: the CUDA backward node ran on a CPU stream");
}

void BackwardTF32::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::Stream s = stream();
  const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2], &o = inputs[3], &d_out = inputs[4];
  const mx::array &mask_data = inputs[5], &mask_base = inputs[6], &lse = inputs[7];
  std::vector<Scalar> layout;
  const bool copy = read_rows(
      inputs,
      (steps_.mask_arrays && (!mask_data.flags().row_contiguous || !mask_base.flags().row_contiguous)) ||
          !lse.flags().row_contiguous,
      layout);
  // A gradient in its input's dtype is the gradient (the cast after is
  // none); float32 sums cast after stay row-contiguous.
  Gradients g(inputs, outputs,
              {outputs[0].dtype() == q.dtype(), outputs[1].dtype() == k.dtype(), outputs[2].dtype() == v.dtype()});
  push_rows(layout, g.rows(1));
  push_rows(layout, g.rows(2));
  push_rows(layout, g.rows(0));
  std::array<mx::array, 3>& grads = g.buffers;
  std::vector<mx::array> stats = {outputs[3]};
  if (steps_.keysq) {
    // (lse, D), then all three gradients; dQ's sums (and dK's and dV's
    // under GQA) added into zeros. The keys pass on float16 terms reads the
    // split's outputs after its inputs; the split reads Q's, K's, V's and
    // dO's rows.
    std::vector<mx::array> keys_in = {q, k, v, d_out, stats[0], mask_data, mask_base};
    if (steps_.split) {
      std::vector<mx::array> terms(outputs.begin() + 4, outputs.begin() + 7);
      std::vector<Scalar> scalars = steps_.split->scalars;
      scalars.insert(scalars.end(), layout.begin(), layout.begin() + 9);        // q, k, v
      scalars.insert(scalars.end(), layout.begin() + 12, layout.begin() + 15);  // dO
      launch(*steps_.split, scalars, {q, k, v, d_out}, terms, copy, s, std::nullopt);
      keys_in.insert(keys_in.end(), terms.begin(), terms.end());
    }
    launch(steps_.first, with_layout(steps_.first, layout), {o, d_out, lse}, stats, copy, s, poison_value());
    std::vector<mx::array> keys = {grads[1], grads[2], grads[0]};
    launch(steps_.second, with_layout(steps_.second, layout), keys_in, keys, copy, s, 0.0f);
  } else {
    // dQ and (lse, D), then dK and dV.
    std::vector<mx::array> rows = {grads[0], stats[0]};
    launch(steps_.first, with_layout(steps_.first, layout), {q, k, v, o, d_out, mask_data, mask_base, lse}, rows, copy,
           s, poison_value());
    std::vector<mx::array> keys = {grads[1], grads[2]};
    launch(steps_.second, with_layout(steps_.second, layout), {q, k, v, d_out, rows[1], mask_data, mask_base}, keys,
           copy, s, steps_.group_sums ? std::optional<float>(0.0f) : poison_value());
  }
  g.view(outputs);
}

}  // namespace flashattn::cuda
