// The flash_attention node on a CUDA stream: reads the inputs' strides (and
// lays a prefill's output out as the queries lie), then
// runs the planned launches through MLX's custom-kernel primitive (which
// allocates the outputs on MLX's stream-ordered allocator and orders the
// launches in MLX's CUDA graph, as a launch of our own could not).

#include "cuda/primitive.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "cuda/node.h"
#include "mlx/allocator.h"
#include "mlx/fast.h"

namespace flashattn::cuda {

namespace {

// The output's layout for this launch plan (Launches' out_anywhere).
std::optional<OutLayout> output_layout(const Launches& run, const mx::array& q, const mx::array& out) {
  if (!run.out_anywhere) return std::nullopt;
  return like_queries(q, out);
}

// A number no earlier call of this process had (48 bits, the fused decode's
// tickets: decode_combine.cuh), as the two 24-bit launch arguments it takes.
// Seeded at random so that no value another process left in recycled GPU
// memory is likely to match either.
std::array<int, 2> next_tag() {
  static std::atomic<uint64_t> counter{[] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }()};
  const uint64_t tag = counter.fetch_add(1, std::memory_order_relaxed) & ((uint64_t{1} << 48) - 1);
  return {static_cast<int>(tag & 0xffffff), static_cast<int>(tag >> 24)};
}

}  // namespace

std::optional<float> poison_value() {
  static const bool poison = std::getenv("FLASHATTN_CUDA_POISON") != nullptr;
  return poison ? std::optional<float>(std::nanf("")) : std::nullopt;
}

void Attention::eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("flash_attention: the CUDA node ran on a CPU stream");
}

namespace {

// The quantized kernels' launch: their inputs (q, K's codes, V's, K's
// scales, biases, V's scales, biases; the prefill's also the mask's data
// and base offsets, or q standing in; a decode with sinks the sinks) and the scalars' strides: q's, the
// codes', then the scales' rows (a bias lies as its scale: where they do
// not, MLX copies them all row-contiguous, as where the kernel cannot read
// an input in place, or a mask's data is not row-contiguous).
void quantized_inputs(const Launches& run, const std::vector<mx::array>& inputs, const Rows& out_rows,
                      std::vector<mx::array>& in, std::vector<Scalar>& scalars, bool& copy) {
  std::array<std::optional<Rows>, 7> place;
  const bool mask_inputs = inputs.size() > 7;
  copy = mask_inputs && !inputs[7].flags().row_contiguous;
  for (int i = 0; i < 7; ++i) {
    place[i] = rows_in_place(inputs[i]);
    copy |= !place[i].has_value();
  }
  auto same = [&](int a, int b) {
    return place[a] && place[b] && place[a]->sb == place[b]->sb && place[a]->sh == place[b]->sh &&
        place[a]->sr == place[b]->sr;
  };
  copy |= !same(3, 4) || !same(5, 6);
  scalars = run.attend.scalars;
  auto rows_of = [&](int i) { return rows_as_read(inputs[i], place[i], copy); };
  for (int i : {0, 1, 2}) push_rows(scalars, rows_of(i));
  push_rows(scalars, out_rows);                          // FA_LAYOUT_PARAMS' last
  for (int i : {3, 5}) push_rows(scalars, rows_of(i));  // FA_QUANT_LAYOUT
  in.assign(inputs.begin(), inputs.begin() + 7);
  if (run.attend.mask_inputs) {
    in.insert(in.end(), {mask_inputs ? inputs[7] : inputs[0], mask_inputs ? inputs[8] : inputs[0]});
  } else if (run.attend.sinks_input) {
    in.push_back(inputs[8]);  // the base-offset array: the sinks alone (no mask reaches a decode)
  }
}

}  // namespace

void Attention::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::Stream s = stream();
  const Launches* chosen = &plan_->aligned;
  std::vector<Scalar> scalars;
  std::vector<mx::array> in;
  bool copy = false;
  std::optional<OutLayout> out_layout;
  if (plan_->aligned.attend.quantized) {
    out_layout = output_layout(plan_->aligned, inputs[0], outputs[0]);
    quantized_inputs(plan_->aligned, inputs, rows_written(out_layout, outputs[0]), in, scalars, copy);
  } else {
    // inputs: q, k, v, and with an array mask or sinks the mask's data (read
    // row-contiguous) and base offsets (cuda/mask_args.h); for the
    // split-query prefill then q, k and v as float16 terms and their shifts.
    std::array<std::optional<Rows>, 3> in_place;
    const size_t split_terms = plan_->aligned.attend.split_inputs ? 4 : 0;
    const bool mask_inputs = inputs.size() - split_terms > 3;
    copy = mask_inputs && !inputs[3].flags().row_contiguous;
    for (int i = 0; i < 3; ++i) {
      in_place[i] = rows_in_place(inputs[i]);
      copy |= !in_place[i].has_value();
    }
    std::array<Rows, 3> rows;
    bool aligned = true;
    for (int i = 0; i < 3; ++i) {
      const mx::array& x = inputs[i];
      const bool copied = copy && !x.flags().row_contiguous;  // MLX copies it: row-contiguous, offset 0
      rows[i] = rows_as_read(x, in_place[i], copy);
      aligned &= rows_aligned(rows[i], copied ? 0 : x.offset(), x.itemsize());
    }

    // Tensor maps take no negative stride (a reversed view): those go to the
    // generic kernel.
    bool forward = true;
    for (const Rows& r : rows) forward &= r.sb >= 0 && r.sh >= 0 && r.sr >= 0;
    chosen = aligned && (forward || !plan_->aligned.tma()) ? &plan_->aligned : &plan_->any;
    scalars = chosen->attend.scalars;
    for (const Rows& r : rows) push_rows(scalars, r);
    out_layout = output_layout(*chosen, inputs[0], outputs[0]);
    push_rows(scalars, rows_written(out_layout, outputs[0]));
    // The kernels that read masks take their two pointers whether or not
    // there is an array mask or sinks (without, the queries stand in, never read).
    in = {inputs[0], inputs[1], inputs[2]};
    if (chosen->attend.mask_inputs) {
      in.insert(in.end(), {mask_inputs ? inputs[3] : inputs[0], mask_inputs ? inputs[4] : inputs[0]});
    } else if (chosen->attend.sinks_input) {
      // No array mask reaches these kernels: the base-offset array holds the
      // sinks alone (cuda/mask_args.cpp).
      in.push_back(inputs[4]);
    }
    if (chosen->attend.split_inputs) in.insert(in.end(), inputs.end() - 4, inputs.end());
  }
  const Launches& run = *chosen;
  if (run.fused || run.tma()) {
    const auto tag = next_tag();
    scalars.insert(scalars.end(), {tag[0], tag[1]});
    scalars.insert(scalars.end(), run.map_template.begin(), run.map_template.end());
  }
  // Outputs [begin, end) that no launch of this run writes (the tensor maps'
  // scratch, or the partials of the other plan's kernels): views of the
  // attention output's buffer, which nothing reads through them. (Allocated,
  // they cost memory until MLX's CUDA backend releases the call's buffers,
  // which a model's forward pass holds for all its layers at once: the
  // partials of float32 attention over a 2,048-row chunk are 7 MiB a call.)
  auto leave_unused = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      mx::array& x = outputs[i];
      x.copy_shared_buffer(outputs[0], mx::Strides(x.ndim(), 0), {false, false, false}, 0);
    }
  };
  const size_t n = outputs.size();
  if (run.fused) {
    // The fused decode's one output is the second to last (plan.cpp): the
    // attention output at its start, then the partials. Each output costs
    // MLX's custom-kernel path host time on every call, and decode calls are
    // short. The last output, the generic kernel's m / l, is left a view of
    // it too (nothing reads it).
    std::vector<mx::array> blob = {outputs[n - 2]};
    launch(run.attend, scalars, in, blob, copy, s, poison_value());
    for (size_t i : {size_t{0}, n - 1}) {
      mx::array& x = outputs[i];
      mx::Strides strides(x.ndim(), 1);
      for (int d = x.ndim() - 2; d >= 0; --d) strides[d] = strides[d + 1] * x.shape(d + 1);
      // The flags MLX gives an array it allocates row-contiguous.
      const size_t max_dim = static_cast<size_t>(*std::max_element(x.shape().begin(), x.shape().end()));
      x.copy_shared_buffer(blob[0], strides, {true, true, x.size() <= 1 || x.size() == max_dim}, x.size());
    }
    return;
  }
  if (!run.merge) {
    // One launch: the output, the rows' log-sum-exp (or its placeholder) and
    // the tensor maps' scratch, as the kernel takes them.
    // In the queries' layout, the kernel writes a buffer of its own that the
    // output then views.
    const size_t used = 1 + (run.attend.lse_output ? 1 : 0) + (run.tma() ? 1 : 0);
    std::vector<mx::array> out(outputs.begin(), outputs.begin() + used);
    if (out_layout) out[0] = mx::array(outputs[0].shape(), outputs[0].dtype(), nullptr, {});
    launch(run.attend, scalars, in, out, copy, s, poison_value());
    if (out_layout) {
      view_in_layout(outputs[0], out[0], *out_layout);
    }
    leave_unused(used, n);
    return;
  }
  // Split, then merged: the partials are the last two outputs (plan.cpp);
  // outputs between are the rows' log-sum-exp (the merge writes it for a
  // gradient) and the tensor maps' scratch of plan.aligned, when this is
  // plan.any's generic split.
  std::vector<mx::array> partials = {outputs[n - 2], outputs[n - 1]};
  launch(run.attend, scalars, in, partials, copy, s, poison_value());
  std::vector<mx::array> out = {outputs[0]};
  if (run.merge->lse_output) out.push_back(outputs[1]);
  launch(*run.merge, run.merge->scalars, partials, out, false, s, poison_value());
  leave_unused(out.size(), n - 2);
}

}  // namespace flashattn::cuda
