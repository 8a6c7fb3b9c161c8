// The flash_attention node on a CUDA stream: reads the inputs' strides, then
// runs the planned launches through MLX's custom-kernel primitive (which
// allocates the outputs on MLX's stream-ordered allocator and orders the
// launches in MLX's CUDA graph, as a launch of our own could not).

#include "cuda/primitive.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <utility>

#include "cuda/kernel_images.h"
#include "cuda/module_cache.h"
#include "mlx/allocator.h"
#include "mlx/fast.h"

namespace flashattn::cuda {

namespace {

const std::string& image_of(const std::string& kernel, const mx::Stream& s) {
  const std::string* image = find_image(kernel, s.device.index);
  if (!image) {
    throw std::runtime_error("flash_attention: no CUDA kernel " + kernel + " in this build");
  }
  return *image;
}

// Batch, head and row strides of q, k or v (B..., H, N, E), in elements;
// 0 on axes of size 1.
struct Rows {
  int64_t sb = 0, sh = 0, sr = 0;
};

bool fits_int(int64_t x) {
  return std::abs(x) <= std::numeric_limits<int>::max();
}

// x's rows as they lie, when the kernels can read them there: the head dim
// contiguous, the batch axes collapsing into one (each axis's stride the
// next inner one's times its size), strides that fit the 32-bit launch
// arguments. Otherwise nullopt: MLX copies x first.
std::optional<Rows> rows_in_place(const mx::array& x) {
  const int nd = x.ndim();
  const auto& shape = x.shape();
  const auto& strides = x.strides();
  if (shape[nd - 1] > 1 && strides[nd - 1] != 1) return std::nullopt;
  Rows r;
  r.sh = shape[nd - 3] > 1 ? strides[nd - 3] : 0;
  r.sr = shape[nd - 2] > 1 ? strides[nd - 2] : 0;
  int64_t outer = 0;  // the stride the next outer batch axis must have; 0: none seen
  for (int d = nd - 4; d >= 0; --d) {
    if (shape[d] == 1) continue;
    if (outer == 0) {
      r.sb = strides[d];
    } else if (strides[d] != outer) {
      return std::nullopt;
    }
    outer = strides[d] * shape[d];
    if (outer == 0) return std::nullopt;  // a broadcast batch axis
  }
  if (!fits_int(r.sb) || !fits_int(r.sh) || !fits_int(r.sr)) return std::nullopt;
  return r;
}

// The rows of x's row-contiguous copy.
Rows contiguous_rows(const mx::array& x) {
  const int64_t E = x.shape(-1), N = x.shape(-2), H = x.shape(-3);
  return {H * N * E, N * E, E};
}

// Whether every row starts on a 16-byte boundary (the fast kernels' vector
// loads; the generic kernel reads element by element).
bool rows_aligned(const Rows& r, int64_t offset_bytes, int64_t itemsize) {
  auto ok = [](int64_t bytes) { return bytes % 16 == 0; };
  return ok(offset_bytes) && ok(r.sb * itemsize) && ok(r.sh * itemsize) && ok(r.sr * itemsize);
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

// One launch: MLX's custom-kernel primitive for `step`, evaluated into `out`.
// copy: MLX copies inputs that are not row-contiguous first.
void launch(const Step& step, const std::vector<Scalar>& scalars, const std::vector<mx::array>& in,
            std::vector<mx::array>& out, bool copy, const mx::Stream& s) {
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& o : out) {
    shapes.push_back(o.shape());
    dtypes.push_back(o.dtype());
  }
  auto run = [&](const ModuleSource& m) {
    auto node = mx::fast::precompiled_cuda_kernel(*m.name, *m.module, in, shapes, dtypes, scalars, step.grid,
                                                  step.block, step.smem, poison_value(), copy, s);
    node[0].primitive().eval_gpu(in, out);
  };
  const std::string& image = image_of(step.kernel, s);
  const ModuleSource m = module_source(step.kernel, image);
  if (!m.from_disk) return run(m);
  // MLX keeps a module it loaded (one a GPU): once a kernel's stand-in has
  // launched on this GPU, a later failure of it is not a refusal (memory,
  // say), and goes to the caller as it is. Keyed by the embedded image,
  // which outlives the process: no string made on this path.
  static std::mutex mutex;
  static std::set<std::pair<int, const std::string*>> launched;
  const std::pair<int, const std::string*> key{s.device.index, &image};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (launched.count(key)) return run(m);
  }
  // A refused stand-in fails before MLX adds the kernel to its graph. What
  // it added before (the outputs' fills, the input copies) writes buffers
  // that are then released, and MLX's graph orders every later use of a
  // buffer after its earlier writers: the launch again, with the module.
  try {
    run(m);
  } catch (const std::exception&) {
    module_cache_refused();
    return run({&step.kernel, &image, false});
  }
  std::lock_guard<std::mutex> lock(mutex);
  launched.insert(key);
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
void quantized_inputs(const Launches& run, const std::vector<mx::array>& inputs, std::vector<mx::array>& in,
                      std::vector<Scalar>& scalars, bool& copy) {
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
  for (int i : {0, 1, 2, 3, 5}) {
    const mx::array& x = inputs[i];
    const Rows r = copy && !x.flags().row_contiguous ? contiguous_rows(x) : *place[i];
    scalars.insert(scalars.end(), {static_cast<int>(r.sb), static_cast<int>(r.sh), static_cast<int>(r.sr)});
  }
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
  if (plan_->aligned.attend.quantized) {
    quantized_inputs(plan_->aligned, inputs, in, scalars, copy);
  } else {
    // inputs: q, k, v, and with an array mask or sinks the mask's data (read
    // row-contiguous) and base offsets (cuda/mask_args.h).
    std::array<std::optional<Rows>, 3> in_place;
    const bool mask_inputs = inputs.size() > 3;
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
      rows[i] = copied ? contiguous_rows(x) : *in_place[i];
      aligned &= rows_aligned(rows[i], copied ? 0 : x.offset(), x.itemsize());
    }

    // Tensor maps take no negative stride (a reversed view): those go to the
    // generic kernel.
    bool forward = true;
    for (const Rows& r : rows) forward &= r.sb >= 0 && r.sh >= 0 && r.sr >= 0;
    chosen = aligned && (forward || !plan_->aligned.tma()) ? &plan_->aligned : &plan_->any;
    scalars = chosen->attend.scalars;
    for (const Rows& r : rows) {
      scalars.insert(scalars.end(), {static_cast<int>(r.sb), static_cast<int>(r.sh), static_cast<int>(r.sr)});
    }
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
    launch(run.attend, scalars, in, blob, copy, s);
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
    const size_t used = 1 + (run.attend.lse_output ? 1 : 0) + (run.tma() ? 1 : 0);
    std::vector<mx::array> out(outputs.begin(), outputs.begin() + used);
    launch(run.attend, scalars, in, out, copy, s);
    leave_unused(used, n);
    return;
  }
  // Split, then merged: the partials are the last two outputs (plan.cpp);
  // outputs between are the rows' log-sum-exp (the merge writes it for a
  // gradient) and the tensor maps' scratch of plan.aligned, when this is
  // plan.any's generic split.
  std::vector<mx::array> partials = {outputs[n - 2], outputs[n - 1]};
  launch(run.attend, scalars, in, partials, copy, s);
  std::vector<mx::array> out = {outputs[0]};
  if (run.merge->lse_output) out.push_back(outputs[1]);
  launch(*run.merge, run.merge->scalars, partials, out, false, s);
  leave_unused(out.size(), n - 2);
}

}  // namespace flashattn::cuda
