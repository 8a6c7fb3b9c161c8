// eval_cpu: plan the work, run the items on all cores with the best kernels
// this CPU has, merge split-key partials (FlashDecoding).

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "../flash_attention.h"
#include "kernels.h"
#include "merge.h"
#include "thread_pool.h"
#include "work.h"

namespace flashattn::cpu {

namespace {

// Below this many multiply-adds a call is not worth waking other threads.
constexpr int64_t kMinParallelWork = int64_t(1) << 20;

bool cpu_has(const char* feature) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (std::strcmp(feature, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  if (std::strcmp(feature, "avx2") == 0) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c");
  }
#endif
  return false;
}

Kernels choose_kernels() {
  const char* env = std::getenv("FLASHATTN_ISA");
  std::string cap = env ? env : "";
#if defined(__x86_64__)
  if (cap != "avx2" && cap != "baseline" && cpu_has("avx512")) {
    return avx512_kernels();
  }
  if (cap != "baseline" && cpu_has("avx2")) {
    return avx2_kernels();
  }
#endif
  return baseline_kernels();
}

} // namespace

// The decode kernel hides keys past a row's last one only: a sliding window
// must leave every row of a tile the same first key (one query position).
// Quantized keys and values it takes both or neither.
bool decode_kernel_fits(const AttentionProblem& p) {
  const bool quantized_alike = (p.k_quantized.bits == 0) == (p.v_quantized.bits == 0);
  return p.E % 8 == 0 && p.E <= 256 && p.k.col_stride == 1 && p.v.col_stride == 1 && quantized_alike &&
      (p.mask_kind == MaskKind::none || p.mask_kind == MaskKind::causal) && (p.window == 0 || p.L == 1);
}

const Kernels& select_kernels() {
  static const Kernels kernels = choose_kernels();
  return kernels;
}

namespace {

void run(const AttentionProblem& p) {
  const Kernels& kernels = select_kernels();
  int64_t work = p.batch * p.H_q * int64_t(p.L) * p.S * p.E;
  int threads = work < kMinParallelWork ? 1 : pool_size();
  WorkPlan plan = plan_work(p, kernels.wide_rows, kernels.narrow_rows, threads);
  AttendFn attend = plan.narrow ? kernels.narrow : kernels.wide;
  if (plan.narrow && kernels.decode && decode_kernel_fits(p)) {
    attend = kernels.decode;
  }
  size_t scratch_bytes = ScratchView::bytes(p.E, plan.RB);

  std::atomic<size_t> next{0};
  parallel_run(threads, [&](int) {
    void* scratch = thread_scratch(scratch_bytes);
    for (size_t i = next++; i < plan.items.size(); i = next++) {
      attend(p, plan, plan.items[i], scratch);
    }
  });
  if (plan.splits > 1) {
    if (p.dtype == mx::float32) {
      merge_all<float>(p, plan);
    } else if (p.dtype == mx::float16) {
      merge_all<mx::float16_t>(p, plan);
    } else {
      merge_all<mx::bfloat16_t>(p, plan);
    }
  }
}

} // namespace

} // namespace flashattn::cpu

namespace flashattn {

void FlashAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& encoder = cpu::start_encoding(stream(), inputs, outputs);
  mx::array* lse = with_lse_ ? &outputs[1] : nullptr;
  auto problem = cpu::describe_problem(inputs, outputs[0], scale_, mask_kind_, window_, lse, quantization_);
  encoder.dispatch([p = std::move(problem)]() { cpu::run(p); });
}

} // namespace flashattn
