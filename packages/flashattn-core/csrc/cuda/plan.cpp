// Which CUDA kernel runs: the one place that decides, from the shapes, the
// dtype and the mask kind.
//
//   L <= 8, ratio x L <= 16 query rows per KV head, E in {64, 96, 128}
//       (at E = 96 at least two rows per KV head):
//       decode (FlashDecoding: keys split across blocks and merged in the
//       same launch by a block that finds its group done; up to 1024 keys
//       one block per group, no merge); on tensor cores
//       (decode_mma.cu) for float16 / bfloat16, E in {64, 128} when no key
//       in the range is hidden (no mask, or causal with L = 1); so too for
//       float32 with at most 8 rows per KV head, with the 3xTF32 split
//       (decode_tf32.cu)
//   float16 / bfloat16, E in {64, 80, 96, 128, 256}, L > 8: tensor-core prefill;
//       for E in {64, 80, 96, 128} on Hopper, on wgmma (prefill_f16_wg.cu;
//       80 and 96 in the 128 kernel's tiles)
//   float32, E in {64, 80, 96, 128, 256}, L > 8: 3xTF32 tensor-core prefill;
//       for E = 64 and 128 on Hopper, on wgmma (prefill_tf32_wg.cu)
//       (a prefill kernel whose block needs more shared memory than the GPU
//       has, 16-bit E = 256 or float32 E = 128 on sm_86 / sm_89: the
//       generic kernel)
//   everything else: the generic kernel (keys split and merged when the
//       query rows are few; split, with 16-byte loads where the rows allow:
//       generic_vec.cu)
//   widened (dtype=float32 over float16 / bfloat16 inputs): the float32
//       variants of the 16-bit tensor-core decode and prefill (wgmma on
//       Hopper, mma.sync at E = 256 and elsewhere); other decode calls
//       (L <= 8) the generic kernel's split form (its arithmetic is float32
//       whatever the inputs), reading the 16-bit cache in place; other
//       prefill calls (a block that does not fit the GPU's shared memory)
//       run the float32 path on cast inputs
//   quantized keys and values (MLX's affine format, 4 or 8 bits, K and V
//       alike, scales and biases in the queries' dtype): read in place by
//       the tensor-core decodes where they take the call (sinks too):
//       attention in the queries' 16-bit dtype fa_decode_mmaq<bits>_, float32
//       attention fa_decode_tf32q_; and with float32 attention for L > 8 by
//       the 3xTF32 prefills' quantized variants; otherwise nothing here
//       (quantized.cpp dequantizes)
//
// Each family plans its own launches (plan_decode.cpp, plan_prefill.cpp,
// plan_generic.cpp); here the call takes the first that accepts it, with
// the generic kernel's launches beside them for inputs the fast kernels
// cannot read (plan.h), and the primitive's outputs are sized.

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cuda/kernels/partials.h"
#include "cuda/kernels/wg_shapes.h"
#include "cuda/planner.h"

namespace flashattn::cuda {

std::optional<Planned> plan_call(const Dims& call, mx::Dtype dtype, const mx::Shape& q_shape, int device_index) {
  Planned out;
  Plan& plan = out.plan;
  int splits = 0;
  Dims d = call;
  auto decode = decode_launches(d, splits);
  // The decodes keep no log-sum-exp (a gradient's backward takes it again).
  if (decode) d.lse = false;
  auto prefill = decode ? std::nullopt : prefill_launches(d, dtype, device_index);
  // A 16-bit output from the wgmma prefills' fa_prefill_wg32h_ and
  // fa_prefill_wg32th_ (and, for rows they cannot read, the generic kernel's
  // merge) only; elsewhere the caller casts (a decode's rows are few, and
  // the other prefills are not the patch's path on Hopper).
  if (!prefill || !prefill->out16) d.out16 = false;
  // Quantized keys and values: the quantized decode or prefill, or nothing
  // (the caller dequantizes them for the other kernels).
  if (d.quantized() && !decode && !prefill) return std::nullopt;
  // Rows' halves added (quantized.cpp's two terms): the widened 16-bit
  // prefills alone (kernels/mma.cuh's store_output).
  if (d.fold && (decode || !prefill || !d.widen || dtype == mx::float32 || d.E % 16 != 0)) {
    return std::nullopt;
  }
  // A widened decode that no tensor-core decode takes (other head dims, an
  // array mask) goes to the generic kernel on the 16-bit inputs: a cast would
  // copy the whole cache to float32 on every call. A widened prefill that no
  // tensor-core prefill takes (its block too large for the GPU's shared
  // memory) goes to the float32 kernels on cast inputs, far faster than the
  // generic one.
  if (d.widen && !decode && !prefill && d.L >= kMinPrefillL) return std::nullopt;
  if (decode) {
    plan.aligned = *decode;
  } else if (prefill) {
    plan.aligned = *prefill;
    splits = 1;
  } else {
    splits = generic_splits(d);
    plan.aligned = generic_launches(d, splits, true);
  }
  // The same splits: the partials (outputs of the primitive) have one shape.
  // The quantized decode reads rows anywhere (it is its own fallback); a
  // folded call's inputs are fresh row-contiguous arrays (quantized.cpp).
  plan.any = d.quantized() || d.fold ? plan.aligned : generic_launches(d, splits);
  for (Launches* l : {&plan.aligned, &plan.any}) {
    l->out_anywhere = !l->fused && !l->merge && l->attend.kernel.rfind("fa_prefill", 0) == 0;
  }
  const int rows = static_cast<int>(d.batch * d.H_q * d.L);
  std::vector<mx::Shape>& shapes = out.shapes;
  std::vector<mx::Dtype>& dtypes = out.dtypes;
  shapes = {q_shape};
  if (d.fold && !d.two_terms) shapes[0].back() /= 2;  // two terms: q is E / 2 wide already
  dtypes = {d.widen && !d.out16 ? mx::float32 : dtype};
  // The rows' log-sum-exp (q's shape but E), or the prefill kernels'
  // placeholder for it (never written).
  out.lse = d.lse;
  if (out.lse || plan.aligned.attend.lse_output) {
    shapes.push_back(out.lse ? mx::Shape(q_shape.begin(), q_shape.end() - 1) : mx::Shape{1});
    dtypes.push_back(mx::float32);
  }
  if (plan.aligned.tma()) {  // scratch for the tensor maps
    namespace ws = fa::wg_shapes;
    const int64_t words = (ws::kMapSlots * ws::kMapSlotBytes + plan.aligned.split_bytes) / 4;
    if (words > std::numeric_limits<int>::max()) {
      throw Unsupported(Reason::input, "flash_attention: too many query rows for one CUDA prefill call");
    }
    shapes.push_back({static_cast<int>(words)});
    dtypes.push_back(mx::uint32);
  }
  if (plan.aligned.merge || plan.aligned.fused || plan.any.merge) {
    // The partials, always the last two outputs (primitive.cpp): o, then m /
    // l per split and row. The fused decode takes the first as its one
    // output (kernels/partials.h: its attention output, then its partials
    // and tickets), which the generic kernel of plan.any, writing o from its
    // start, would share.
    namespace fp = fa::partials;
    int64_t o_floats = static_cast<int64_t>(splits) * rows * d.E;
    if (plan.aligned.fused) {
      const int64_t out_bytes = static_cast<int64_t>(rows) * d.E * (d.widen ? 4 : dtype.size());
      o_floats = fp::fused_offset_floats(out_bytes) + fp::floats(splits, rows, d.E) + plan.aligned.fused;
    }
    const int64_t ml_floats = static_cast<int64_t>(splits) * rows * 2;
    if (o_floats > std::numeric_limits<int>::max()) {
      throw Unsupported(Reason::input, "flash_attention: too many query rows for one CUDA decode call");
    }
    if (plan.aligned.fused) {
      shapes.push_back({static_cast<int>(o_floats)});
    } else {
      shapes.push_back({splits, rows, d.E});
    }
    shapes.push_back({static_cast<int>(ml_floats)});
    dtypes.insert(dtypes.end(), {mx::float32, mx::float32});
  }
  return out;
}

}  // namespace flashattn::cuda
