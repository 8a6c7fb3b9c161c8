// The CUDA nodes' shared evaluation: strides as rows, outputs laid out as
// an input, launches (node.h).

#include "cuda/node.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/kernel_images.h"
#include "cuda/module_cache.h"
#include "cuda/primitive.h"
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

bool fits_int(int64_t x) {
  return std::abs(x) <= std::numeric_limits<int>::max();
}

// The rows of an array of this shape and these strides, when the kernels
// can address them: the head dim contiguous, the batch axes collapsing into
// one (each axis's stride the next inner one's times its size), strides
// that fit the 32-bit launch arguments, and offsets within a batch element
// too.
std::optional<Rows> rows_of_layout(const mx::Shape& shape, const mx::Strides& strides) {
  const int nd = static_cast<int>(shape.size());
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
  // One batch element's offsets in an int too (backward.cu adds a head's
  // and a row's in 32 bits).
  const int64_t extent = (shape[nd - 3] - 1) * std::abs(r.sh) + (shape[nd - 2] - 1) * std::abs(r.sr) + shape[nd - 1];
  if (!fits_int(extent)) return std::nullopt;
  return r;
}

}  // namespace

std::optional<Rows> rows_in_place(const mx::array& x) {
  return rows_of_layout(x.shape(), x.strides());
}

Rows contiguous_rows(const mx::array& x) {
  const int64_t E = x.shape(-1), N = x.shape(-2), H = x.shape(-3);
  return {H * N * E, N * E, E};
}

bool rows_aligned(const Rows& r, int64_t offset_bytes, int64_t itemsize) {
  auto ok = [](int64_t bytes) { return bytes % 16 == 0; };
  return ok(offset_bytes) && ok(r.sb * itemsize) && ok(r.sh * itemsize) && ok(r.sr * itemsize);
}

// nullopt where that layout is row-contiguous anyway (every axis of more
// than one element in order), or its rows are not the kernels' (the head
// dim not innermost, batch axes that do not collapse, rows not on 16-byte
// boundaries): then the output is row-contiguous.
std::optional<OutLayout> like_queries(const mx::array& q, const mx::array& out) {
  if (q.flags().row_contiguous) return std::nullopt;
  const int nd = out.ndim();
  // Outermost first by q's strides; axes of one element (any stride) outside.
  std::vector<int> order(nd);
  for (int d = 0; d < nd; ++d) order[d] = d;
  auto key = [&](int d) { return q.shape(d) > 1 ? q.strides(d) : std::numeric_limits<int64_t>::max(); };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key(a) > key(b); });
  if (order[nd - 1] != nd - 1 && out.shape(-1) > 1) return std::nullopt;
  OutLayout o{mx::Strides(nd), {}};
  int64_t stride = 1;
  for (int i = nd - 1; i >= 0; --i) {
    o.strides[order[i]] = stride;
    stride *= out.shape(order[i]);
  }
  bool row_major = true;
  stride = 1;
  for (int d = nd - 1; d >= 0; --d) {
    if (out.shape(d) > 1) row_major &= o.strides[d] == stride;
    stride *= out.shape(d);
  }
  if (row_major) return std::nullopt;
  const std::optional<Rows> rows = rows_of_layout(out.shape(), o.strides);
  if (!rows || !rows_aligned(*rows, 0, out.itemsize())) return std::nullopt;
  o.rows = *rows;
  return o;
}

Rows rows_as_read(const mx::array& x, const std::optional<Rows>& place, bool copy) {
  return copy && !x.flags().row_contiguous ? contiguous_rows(x) : *place;
}

Rows rows_written(const std::optional<OutLayout>& layout, const mx::array& out) {
  return layout ? layout->rows : contiguous_rows(out);
}

void view_in_layout(mx::array& out, const mx::array& buffer, const OutLayout& layout) {
  out.copy_shared_buffer(buffer, layout.strides, {true, false, false}, out.size());
}

void push_rows(std::vector<Scalar>& scalars, const Rows& r) {
  scalars.insert(scalars.end(), {static_cast<int>(r.sb), static_cast<int>(r.sh), static_cast<int>(r.sr)});
}

void launch(const Step& step, const std::vector<Scalar>& scalars, const std::vector<mx::array>& in,
            std::vector<mx::array>& out, bool copy, const mx::Stream& s, std::optional<float> init) {
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& o : out) {
    shapes.push_back(o.shape());
    dtypes.push_back(o.dtype());
  }
  auto run = [&](const ModuleSource& m) {
    auto node = mx::fast::precompiled_cuda_kernel(*m.name, *m.module, in, shapes, dtypes, scalars, step.grid,
                                                  step.block, step.smem, init, copy, s);
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

}  // namespace flashattn::cuda
