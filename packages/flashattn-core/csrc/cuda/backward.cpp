// The fused backward on MLX's CUDA backend: two launches through MLX's
// custom-kernel API, ordered in MLX's graph by the statistics the second
// reads. 16-bit inputs up to E = 128 (kernels/backward_f16.cu): a statistics
// pass (each row's log-sum-exp, the forward's where it kept it, and D) and a keys pass for all three
// gradients (dQ as float32 sums; on Hopper kernels/backward_wg.cu's). Others (kernels/backward.cu): where the
// forward kept the log-sum-exp and E <= 128, (lse, D) and a keys pass for all
// three (dQ by atomics into zeros); else the rows pass (dQ and the statistics)
// and the keys pass (dK, dV). Under GQA dK and dV are
// float32 sums of the group's heads; sums are cast to the inputs' dtype after. Both read their inputs
// row-contiguous (MLX copies a strided view first: O(L) memory, like the
// gradients themselves). Float32 attention over 16-bit inputs (ops.cpp)
// comes here with its 16-bit inputs: the 16-bit kernels, its output and dO
// rounded to the inputs' dtype. A call the kernels cannot take (a GPU with less
// shared memory a block than they use, sm_86 / sm_89 above E = 64) throws
// Unsupported: ops.cpp then recomputes, and counts why. Attention sinks join
// each row's log-sum-exp in the statistics; their own gradient is taken from
// the statistics after (sinks_gradient, vjp.cpp).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "cuda/dispatch.h"
#include "cuda/driver.h"
#include "cuda/kernel_images.h"
#include "cuda/kernels/backward_shapes.h"
#include "cuda/kernels/mask_bits.h"
#include "cuda/mask_args.h"
#include "cuda/primitive.h"
#include "mlx/fast.h"

namespace flashattn::cuda {

namespace bs = fa::backward_shapes;

namespace {

// dQ in q's dtype from its float32 sums, which the keys pass wrote in place,
// and under GQA dK and dV from theirs after them (kernels/backward_dq.cu:
// one launch); `after`, an output of that pass, orders the launch after it.
// Without GQA the last two are placeholders.
std::vector<mx::array> grads_from_sums(const mx::array& sums, const mx::array& after, const mx::array& q,
                                       const mx::array& k, bool group_sums, mx::Stream s) {
  const std::string kernel = std::string("fa_backward_dq_") + dtype_name(q.dtype());
  const std::string* image = find_image(kernel, s.device.index);
  if (!image) throw std::runtime_error("flash_attention: no CUDA kernel " + kernel + " in this build");
  constexpr int kThreads = 256;
  const int64_t elements = q.size() + (group_sums ? 2 * k.size() : 0);
  const int64_t blocks = std::min<int64_t>((elements / 4 + kThreads - 1) / kThreads + 1, 4096);
  const int E = q.shape(-1);
  const std::vector<mx::fast::ScalarArg> scalars = {static_cast<int>(q.size() / E),
                                                     group_sums ? static_cast<int>(k.size() / E) : 0, E};
  const mx::Shape kv_shape = group_sums ? k.shape() : mx::Shape{1};
  return mx::fast::precompiled_cuda_kernel(kernel, *image, {sums, after}, {q.shape(), kv_shape, kv_shape},
                                           {q.dtype(), k.dtype(), k.dtype()}, scalars,
                                           {static_cast<int>(blocks) * kThreads, 1, 1}, {kThreads, 1, 1}, 0,
                                           std::nullopt, /* ensure_row_contiguous */ true, s);
}

}  // namespace

std::vector<mx::array> flash_attention_backward(const AttentionCall& call, const mx::array& out,
                                                const mx::array& d_out, const std::optional<mx::array>& lse) {
  const mx::Stream s = call.stream;
  // Row-contiguous once for both launches: each launch copies a strided input
  // for itself (mlx-lm's transposed Q, K, V and dO), the mask's placeholders
  // (Q) again: 248 copies a LoRA step of Qwen2-0.5B at 8K, 3.4 ms (H100).
  auto rows_of = [&](const mx::array& x) { return mx::contiguous(x, false, s); };
  const mx::array q = rows_of(call.q), k = rows_of(call.k), v = rows_of(call.v);
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
  if (std::max({row_blocks * bs::kThreads, key_blocks * key_threads, sum_rows}) > std::numeric_limits<int>::max()) {
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
  auto launch = [&](const std::string& kernel, const std::vector<mx::array>& inputs,
                    const std::vector<mx::Shape>& shapes, const std::vector<mx::Dtype>& dtypes, int64_t blocks,
                    int threads, int smem, std::optional<float> init) {
    const std::string* image = find_image(kernel, s.device.index);
    if (!image) throw std::runtime_error("flash_attention: no CUDA kernel " + kernel + " in this build");
    const std::tuple<int, int, int> grid{static_cast<int>(blocks) * threads, 1, bs::col_blocks(EB)};
    return mx::fast::precompiled_cuda_kernel(kernel, *image, inputs, shapes, dtypes, scalars, grid,
                                             {threads, 1, 1}, smem, init,
                                             /* ensure_row_contiguous */ true, s);
  };
  const mx::array dO = rows_of(mx::astype(d_out, q.dtype(), s));
  const bool group_sums = H_q != H_kv;  // the keys pass adds into float32 zeros
  const mx::Dtype kv_dtype = group_sums ? mx::float32 : k.dtype();
  const mx::Shape stats_shape = {static_cast<int>(batch * H_q * L * 2)};
  if (bs::f16_kernel(EB, bytes)) {
    // Statistics (and each row's flag: Q or dO not finite; where the forward
    // kept the log-sum-exp, D and the flags alone: fa_backward_dflags_), then one pass
    // for all three gradients (dQ float32 sums): on Hopper's wgmma where the
    // build has it.
    // On Hopper, calls with no mask or a causal one at E = 64 or 128 take the
    // keys pass compiled for their mask kind and head dim.
    const std::string general = "fa_backward_keyswg_" + suffix;
    const bool wg = find_image(general, s.device.index) != nullptr;
    const std::string wg_kernel = "fa_backward_keyswg" + fixed + suffix;
    // The statistics pass also zeroes the gradients' float32 sums (dQ's, and
    // under GQA dK's and dV's after them: GradSums, backward_tiles16.cuh),
    // which the keys pass then adds into in place (an input it writes):
    // MLX's own fill of an output would be one more launch, slower than these
    // stores.
    const mx::Shape sums_shape =
        group_sums ? mx::Shape{static_cast<int>(sum_rows), E} : q.shape();
    const std::vector<mx::Shape> stats_shapes = {stats_shape, {static_cast<int>(batch * H_q * L)}, sums_shape};
    const std::vector<mx::Dtype> stats_dtypes = {mx::float32, mx::int32, mx::float32};
    auto stats = lse ? launch("fa_backward_dflags_" + suffix, {q, o, dO, *lse}, stats_shapes, stats_dtypes, row_blocks,
                              bs::kThreads, 0, poison_value())
                     : launch((wg ? "fa_backward_statswg_" : "fa_backward_stats_") + suffix,
                              {q, k, o, dO, m.data, m.base}, stats_shapes, stats_dtypes, row_blocks, bs::kThreads,
                              wg ? bs::rows_smem_bytes_wg(EB) : bs::rows_smem(EB, bytes), poison_value());
    const mx::array& dq_sums = stats[2];
    // Under GQA the keys pass's outputs are placeholders that order the cast
    // after it; its gradients are sums.
    const std::vector<mx::Shape> grad_shapes =
        group_sums ? std::vector<mx::Shape>{{1}, {1}} : std::vector<mx::Shape>{k.shape(), v.shape()};
    const std::vector<mx::Dtype> grad_dtypes = {k.dtype(), k.dtype()};
    const std::optional<float> kv_init = poison_value();
    auto grads = wg ? launch(wg_kernel, {q, k, v, dO, stats[0], stats[1], m.data, m.base, dq_sums}, grad_shapes,
                             grad_dtypes, key_blocks, key_threads,
                             fixed == "_" ? bs::keys_smem_bytes_wg(EB) : bs::keys_smem_total_wg(EB), kv_init)
                    : launch("fa_backward_keysq_" + suffix, {q, k, v, dO, stats[0], m.data, m.base, dq_sums},
                             grad_shapes, grad_dtypes, key_blocks, key_threads, bs::keys_smem(EB, bytes), kv_init);
    std::vector<mx::array> result = grads_from_sums(dq_sums, grads[0], q, k, group_sums, s);
    if (!group_sums) result[1] = grads[0], result[2] = grads[1];
    return gradients(std::move(result), stats[0]);
  }
  if (keysq) {
    auto stats = launch("fa_backward_d_" + suffix, {o, dO, *lse}, {stats_shape}, {mx::float32}, row_blocks,
                        bs::kThreads, 0, poison_value());
    // dK and dV stored (sums under GQA) and dQ's sums, all zeros first.
    auto keys = launch("fa_backward_keysq" + fixed + suffix, {q, k, v, dO, stats[0], m.data, m.base},
                       {k.shape(), v.shape(), q.shape()}, {kv_dtype, kv_dtype, mx::float32}, key_blocks, key_threads,
                       bs::keysq_smem_bytes(EB), 0.0f);
    return gradients({mx::astype(keys[2], q.dtype(), s), mx::astype(keys[0], k.dtype(), s),
                      mx::astype(keys[1], v.dtype(), s)},
                     stats[0]);
  }
  // The forward's log-sum-exp, which the float32 rows pass then reads
  // (kLse; without it the output stands in, never read: row-contiguous, so
  // MLX copies nothing for it).
  const mx::array lse_in = lse ? *lse : o;
  const std::string f32_fixed = q.dtype() == mx::float32 ? fixed : "_";
  auto rows = launch("fa_backward_rows" + f32_fixed + suffix, {q, k, v, o, dO, m.data, m.base, lse_in}, {q.shape(), stats_shape},
                     {q.dtype(), mx::float32}, row_blocks, bs::kThreads, bs::rows_smem(EB, bytes), poison_value());
  auto keys = launch("fa_backward_keys" + f32_fixed + suffix, {q, k, v, dO, rows[1], m.data, m.base}, {k.shape(), v.shape()},
                     {kv_dtype, kv_dtype}, key_blocks, key_threads, bs::keys_smem(EB, bytes),
                     group_sums ? std::optional<float>(0.0f) : poison_value());
  return gradients({rows[0], mx::astype(keys[0], k.dtype(), s), mx::astype(keys[1], v.dtype(), s)}, rows[1]);
}

}  // namespace flashattn::cuda
