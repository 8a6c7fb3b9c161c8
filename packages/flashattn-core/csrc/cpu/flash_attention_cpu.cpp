// eval_cpu: plan the work, run the items on all cores with the best kernels
// this CPU has, merge split-key partials (FlashDecoding).

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "../flash_attention.h"
#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
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

bool decode_kernel_fits(const AttentionProblem& p) {
  return p.E % 8 == 0 && p.E <= 256 && p.k.col_stride == 1 && p.v.col_stride == 1 &&
      (p.mask_kind == MaskKind::none || p.mask_kind == MaskKind::causal);
}

const Kernels& select_kernels() {
  static const Kernels kernels = choose_kernels();
  return kernels;
}

namespace {

thread_local std::unique_ptr<char[]> t_scratch;
thread_local size_t t_scratch_bytes = 0;

void* thread_scratch(size_t bytes) {
  if (t_scratch_bytes < bytes) {
    t_scratch.reset(new char[bytes]);
    t_scratch_bytes = bytes;
  }
  return t_scratch.get();
}

// Combines the key splits of each row tile:
//   m = max_s m_s,  l = sum_s 2^(m_s - m) l_s,  O = sum_s 2^(m_s - m) o_s / l
template <typename T>
void merge_partials(const AttentionProblem& p, WorkPlan& plan, int64_t tile) {
  const int RB = plan.RB, E = p.E, ratio = p.q_kv_heads_ratio;
  const int64_t group = tile / plan.row_tiles;
  const int row_tile = int(tile % plan.row_tiles);
  const int64_t b = group / p.H_kv, g = group % p.H_kv;
  const int first = row_tile * RB;
  const int rows = std::min(RB, plan.rows_per_group - first);
  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int s = 0; s < plan.splits; ++s) {
      m = std::max(m, plan.partial(tile, s).m(r));
    }
    float m_use = std::isinf(m) && m < 0 ? 0.0f : m;
    float l = 0.0f;
    float o[256] = {};
    for (int s = 0; s < plan.splits; ++s) {
      const Partial part = plan.partial(tile, s);
      float w = std::exp2(part.m(r) - m_use);
      l += w * part.l(r);
      for (int e = 0; e < E; ++e) {
        o[e] += w * part.o(e, r);
      }
    }
    float inv = l == 0.0f ? 0.0f : 1.0f / l;
    int64_t l_pos = (first + r) / ratio;
    int64_t n = b * p.H_q + g * ratio + (first + r) % ratio;
    T* dst = out + (n * p.L + l_pos) * E;
    for (int e = 0; e < E; ++e) {
      dst[e] = static_cast<T>(o[e] * inv);
    }
  }
}

template <typename T>
void merge_all(const AttentionProblem& p, WorkPlan& plan) {
  for (int64_t tile = 0; tile < plan.groups * plan.row_tiles; ++tile) {
    merge_partials<T>(p, plan, tile);
  }
}

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
    mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  auto problem = cpu::describe_problem(inputs, out, scale_, mask_kind_);
  encoder.dispatch([p = std::move(problem)]() { cpu::run(p); });
}

} // namespace flashattn
