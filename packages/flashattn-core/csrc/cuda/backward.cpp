// The fused backward on MLX's CUDA backend, one node a call
// (backward_node.h) that reads Q, K, V, O and dO where they lie and lays
// dQ, dK and dV out as the inputs. 16-bit inputs up to E = 128
// (kernels/backward_f16.cu): a statistics pass (each row's log-sum-exp, the
// forward's where it kept it, and D), a keys pass for all three gradients
// (dQ as float32 sums; on Hopper kernels/backward_wg.cu's) and the sums'
// cast. Others (kernels/backward.cu, TF32 tensor cores), two launches:
// where the forward kept the log-sum-exp and E <= 128, (lse, D) and a keys
// pass for all three (dQ by atomics into zeros); else the rows pass (dQ and
// the statistics) and the keys pass (dK, dV). Under GQA dK and dV are
// float32 sums of the group's heads, cast to the inputs' dtype after.
// Float32 attention over 16-bit inputs (ops.cpp) comes here with its 16-bit
// inputs: the 16-bit kernels, its output and dO rounded to the inputs'
// dtype. A call the kernels cannot take (a GPU with less shared memory a
// block than they use, sm_86 / sm_89 above E = 64) throws Unsupported:
// ops.cpp then recomputes, and counts why. Attention sinks join each row's
// log-sum-exp in the statistics; their own gradient is taken from the
// statistics after (sinks_gradient, vjp.cpp).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "cuda/backward_node.h"
#include "cuda/dispatch.h"
#include "cuda/driver.h"
#include "cuda/kernel_images.h"
#include "cuda/kernels/backward_shapes.h"
#include "cuda/kernels/mask_bits.h"
#include "cuda/kernels/wg_shapes.h"
#include "cuda/mask_args.h"
#include "cuda/primitive.h"
#include "mlx/fast.h"

namespace flashattn::cuda {

namespace bs = fa::backward_shapes;

std::vector<mx::array> flash_attention_backward(const AttentionCall& call, const mx::array& out,
                                                const mx::array& d_out, const std::optional<mx::array>& lse) {
  const mx::Stream s = call.stream;
  const mx::array &q = call.q, &k = call.k, &v = call.v;
  const int H_q = q.shape(-3), H_kv = k.shape(-3), L = q.shape(-2), S = k.shape(-2), E = q.shape(-1);
  int64_t batch = 1;
  for (int d = 0; d < static_cast<int>(q.ndim()) - 3; ++d) batch *= q.shape(d);
  const int EB = bs::bucket(E);
  // Each launch's threads, as MLX counts them, in an int.
  const int64_t row_blocks = (L + bs::kRows - 1) / bs::kRows * batch * H_q;
  const int bytes = static_cast<int>(q.itemsize());
  const int key_threads = bs::keys_threads(EB, bytes), block_keys = bs::keys_block(EB, bytes);
  const int64_t key_blocks = (S + block_keys - 1) / block_keys * batch * H_q;
  // (and the rows of the 16-bit passes' float32 sums under GQA: GradSums)
  const int64_t sum_rows = batch * H_q * L + 2 * batch * H_kv * S;
  // (and each head's elements: the strides in the kernels' int arguments)
  const int64_t head_elements = std::max<int64_t>(H_q * int64_t{L}, H_kv * int64_t{S}) * E;
  if (std::max({row_blocks * bs::kThreads, key_blocks * key_threads, sum_rows, head_elements}) >
      std::numeric_limits<int>::max()) {
    throw Unsupported(Reason::input, "flash_attention: too many query rows or keys for one CUDA backward launch");
  }

  // Where the forward kept the log-sum-exp, the other kernels' keys pass
  // makes dQ too (fa_backward_keysq) after fa_backward_d's statistics, in
  // place of the rows pass.
  const bool keysq = lse && !bs::f16_kernel(EB, bytes) && EB <= 128;
  const int smem_needed = keysq ? bs::keysq_smem_bytes(EB)
                                : std::max(bs::rows_smem(EB, bytes) + bs::kRows * 4,  // + D's static array
                                           bs::keys_smem(EB, bytes));
  const int smem_allowed = max_shared_memory_per_block(s.device.index);
  if (smem_allowed > 0 && smem_needed > smem_allowed) {
    throw Unsupported(Reason::no_gpu_kernel,
                      "flash_attention: the CUDA backward at head dim " + std::to_string(E) + " needs " +
                          std::to_string(smem_needed) + " bytes of shared memory a block; this GPU allows " +
                          std::to_string(smem_allowed));
  }

  // Sinks ride in the mask's arguments, as in the forward: the statistics
  // count them in each row's log-sum-exp.
  const MaskArgs m = mask_args(q, call.mask_kind, call.mask, call.sinks, call.window, s);
  // (dQ, dK, dV), and the sinks' gradient from the statistics (lse, D) where
  // the call has sinks.
  auto gradients = [&](std::vector<mx::array> result, const mx::array& stats) {
    if (call.sinks) result.push_back(sinks_gradient(stats, *call.sinks, q, s));
    return result;
  };
  // The output in the inputs' dtype, as the kernels read it (float32
  // attention over 16-bit inputs: its float32 output rounded, as dO is).
  const mx::array o = mx::astype(out, q.dtype(), s);
  const std::vector<mx::fast::ScalarArg> scalars = {static_cast<int>(batch * H_q),
                                                     H_q,
                                                     H_kv,
                                                     L,
                                                     S,
                                                     E,
                                                     m.kind | (lse ? fa::kLse : 0),
                                                     m.row_stride,
                                                     m.col_stride,
                                                     call.scale * kLog2e,
                                                     call.scale};
  const std::string suffix = std::string(dtype_name(q.dtype())) + "_" + std::to_string(EB);
  // Kernels compiled for a call with no mask or a causal one at E = 64 or
  // 128 (the mask kind and head dim constants: faster) go by "n_" or "c_"
  // where the others go by "_" (16-bit on Hopper: the keys pass; float32:
  // both passes).
  const int kind = m.kind & fa::kKindBits;
  const bool plain = kind == static_cast<int>(MaskKind::none) || kind == static_cast<int>(MaskKind::causal);
  const std::string fixed =
      E == EB && EB <= 128 && plain ? (kind == static_cast<int>(MaskKind::causal) ? "c_" : "n_") : "_";
  auto step = [&](const std::string& kernel, int64_t blocks, int threads, int smem) {
    return Step{kernel, scalars, {static_cast<int>(blocks) * threads, 1, bs::col_blocks(EB)}, {threads, 1, 1}, smem};
  };
  const bool group_sums = H_q != H_kv;  // the keys pass adds into float32 zeros
  const mx::Dtype kv_dtype = group_sums ? mx::float32 : k.dtype();
  const mx::Shape stats_shape = {static_cast<int>(batch * H_q * L * 2)};
  if (bs::f16_kernel(EB, bytes)) {
    // Statistics (and each row's flag: Q or dO not finite; where the forward
    // kept the log-sum-exp, D and the flags alone: fa_backward_dflags_), then one pass
    // for all three gradients (dQ float32 sums): on Hopper's wgmma where the
    // build has it; then the sums cast. One node (backward_node.h) runs them
    // once strides are known: the kernels read the inputs where they lie.
    // On Hopper, calls with no mask or a causal one at E = 64 or 128 take the
    // keys pass compiled for their mask kind and head dim.
    const std::string general = "fa_backward_keyswg_" + suffix;
    const bool wg = find_image(general, s.device.index) != nullptr;
    const std::string wg_kernel = "fa_backward_keyswg" + fixed + suffix;
    BackwardSteps steps;
    steps.lse = lse.has_value();
    steps.mask_arrays = m.inputs;
    steps.flags_input = wg;
    steps.group_sums = group_sums;
    steps.stats = lse ? step("fa_backward_dflags_" + suffix, row_blocks, bs::kThreads, 0)
                      : step((wg ? "fa_backward_statswg_" : "fa_backward_stats_") + suffix, row_blocks, bs::kThreads,
                             wg ? bs::rows_smem_bytes_wg(EB) : bs::rows_smem(EB, bytes));
    steps.keys = wg ? step(wg_kernel, key_blocks, key_threads,
                           fixed == "_" ? bs::keys_smem_bytes_wg(EB) : bs::keys_smem_total_wg(EB))
                    : step("fa_backward_keysq_" + suffix, key_blocks, key_threads, bs::keys_smem(EB, bytes));
    // The cast: its threads each 4 floats, at most 4,096 blocks of 256.
    constexpr int kCastThreads = 256;
    const int64_t elements = q.size() + (group_sums ? 2 * k.size() : 0);
    const int64_t cast_blocks = std::min<int64_t>((elements / 4 + kCastThreads - 1) / kCastThreads + 1, 4096);
    steps.cast = {std::string("fa_backward_dq_") + dtype_name(q.dtype()),
                  {static_cast<int>(q.size() / E), group_sums ? static_cast<int>(k.size() / E) : 0, E, H_q, L, H_kv, S},
                  {static_cast<int>(cast_blocks) * kCastThreads, 1, 1},
                  {kCastThreads, 1, 1},
                  0};
    // The statistics pass also zeroes the gradients' float32 sums (dQ's, and
    // under GQA dK's and dV's after them: GradSums, backward_tiles16.cuh),
    // which the keys pass then adds into in place (an input it writes):
    // MLX's own fill of an output would be one more launch, slower than these
    // stores.
    const mx::Shape sums_shape = group_sums ? mx::Shape{static_cast<int>(sum_rows), E} : q.shape();
    std::vector<mx::array> inputs = {q, k, v, o, mx::astype(d_out, q.dtype(), s), m.data, m.base};
    if (lse) inputs.push_back(*lse);
    auto outs = mx::array::make_arrays(
        {q.shape(), k.shape(), v.shape(), stats_shape, {static_cast<int>(batch * H_q * L)}, sums_shape, {1}, {1}},
        {q.dtype(), k.dtype(), v.dtype(), mx::float32, mx::int32, mx::float32, k.dtype(), k.dtype()},
        std::make_shared<Backward16>(s, std::move(steps)), std::move(inputs));
    return gradients({outs[0], outs[1], outs[2]}, outs[3]);
  }
  // The other kernels: one node (backward_node.h) runs their two launches
  // once strides are known, so that they too read the inputs where they lie
  // and lay the gradients out as the inputs. Without the forward's
  // log-sum-exp a placeholder stands in (never read; row-contiguous, so MLX
  // copies nothing for it).
  const std::string f32_fixed = q.dtype() == mx::float32 ? fixed : "_";
  BackwardTF32Steps steps;
  // float32 at E = 64 under a causal mask on Hopper: K and V as two float16
  // terms a row and the shifts of Q's, K's, V's and dO's tiles
  // (fa_f32_split4_64), then the keys pass on float16 tensor cores
  // (kernels/backward_f32s_wg.cu), which makes Q's and dO's terms itself.
  // FLASHATTN_CUDA_F32_SPLIT=0 keeps the TF32 kernels, as for the forward.
  const char* split_env = std::getenv("FLASHATTN_CUDA_F32_SPLIT");
  const std::string f32s_kernel = "fa_backward_keyswgsc_float32_64", split_kernel = "fa_f32_split4_64";
  constexpr int kSplitRows = fa::wg_shapes::kF32sSplitRows, kSplitThreads = fa::wg_shapes::kF32sSplitThreads;
  const int64_t q_slices = batch * H_q, kv_slices = batch * H_kv;
  const int64_t split_blocks =
      2 * (q_slices * ((L + kSplitRows - 1) / kSplitRows) + kv_slices * ((S + kSplitRows - 1) / kSplitRows));
  const int64_t f32s_blocks = (S + bs::kKeys16 - 1) / bs::kKeys16 * q_slices;
  const bool f32s = q.dtype() == mx::float32 && keysq && E == bs::kF32sE && fixed == "c_" &&
                    !(split_env && std::string(split_env) == "0") &&
                    (smem_allowed <= 0 || bs::keys_smem_bytes_f32s() <= smem_allowed) &&
                    split_blocks * kSplitThreads <= std::numeric_limits<int>::max() &&
                    find_image(f32s_kernel, s.device.index) && find_image(split_kernel, s.device.index);
  if (f32s) {
    steps.split = Step{split_kernel,
                       {static_cast<int>(q_slices), static_cast<int>(kv_slices), H_q, H_kv, L, S},
                       {static_cast<int>(split_blocks) * kSplitThreads, 1, 1},
                       {kSplitThreads, 1, 1},
                       0};
  }
  steps.keysq = keysq;
  steps.lse = lse.has_value();
  steps.mask_arrays = m.inputs;
  steps.group_sums = group_sums;
  steps.first = keysq ? step("fa_backward_d_" + suffix, row_blocks, bs::kThreads, 0)
                      : step("fa_backward_rows" + f32_fixed + suffix, row_blocks, bs::kThreads, bs::rows_smem(EB, bytes));
  steps.second = f32s    ? step(f32s_kernel, f32s_blocks, bs::kKeysThreads16, bs::keys_smem_bytes_f32s())
                 : keysq ? step("fa_backward_keysq" + fixed + suffix, key_blocks, key_threads, bs::keysq_smem_bytes(EB))
                         : step("fa_backward_keys" + f32_fixed + suffix, key_blocks, key_threads, bs::keys_smem(EB, bytes));
  const mx::array lse_in = lse ? *lse : mx::array({0.0f});
  std::vector<mx::Shape> shapes = {q.shape(), k.shape(), v.shape(), stats_shape};
  std::vector<mx::Dtype> dtypes = {keysq ? mx::float32 : q.dtype(), kv_dtype, kv_dtype, mx::float32};
  if (f32s) {
    // The split's outputs: k's and v's terms (rows of 2E halves), and the
    // tiles' shifts.
    const int kv_rows = static_cast<int>(kv_slices * S);
    shapes.insert(shapes.end(), {{kv_rows, 2 * E}, {kv_rows, 2 * E}, {static_cast<int>(split_blocks)}});
    dtypes.insert(dtypes.end(), {mx::float16, mx::float16, mx::int32});
  }
  auto outs = mx::array::make_arrays(shapes, dtypes, std::make_shared<BackwardTF32>(s, std::move(steps)),
                                     {q, k, v, o, mx::astype(d_out, q.dtype(), s), m.data, m.base, lse_in});
  return gradients({mx::astype(outs[0], q.dtype(), s), mx::astype(outs[1], k.dtype(), s),
                    mx::astype(outs[2], v.dtype(), s)},
                   outs[3]);
}

}  // namespace flashattn::cuda
