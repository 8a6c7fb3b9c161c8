// eval_cpu of the fused backward: D = rowsum(dO * O), then independent work
// items on all cores (isa/backward.h): one a KV head where there are enough
// of them, else the key pass and the query pass as one list, longest first.

#include "backward.h"

#include <algorithm>
#include <atomic>
#include <memory>

#include "../flash_attention.h"
#include "causal.h"
#include "kernels.h"
#include "thread_pool.h"

namespace flashattn::cpu {

namespace {

template <typename T>
void row_dots(const void* d_out, const void* out, int64_t rows, int E, float* D) {
  const T* dO = static_cast<const T*>(d_out);
  const T* O = static_cast<const T*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) {
      sum += static_cast<float>(dO[r * E + e]) * static_cast<float>(O[r * E + e]);
    }
    D[r] = sum;
  }
}

// Whether one item a KV head (five products a tile pair) keeps `threads`
// threads busy enough to beat the two passes (seven): its items are alike,
// so the last round of them decides.
bool group_items_pay(const AttentionProblem& p, int threads) {
  const int64_t groups = p.batch * p.H_kv;
  const int64_t rounds = (groups + threads - 1) / threads;
  return groups >= threads && double(groups) / double(rounds * threads) >= 0.8;
}

std::vector<BackwardItem> plan_backward(const AttentionProblem& p, int threads) {
  std::vector<BackwardItem> items;
  if (group_items_pay(p, threads)) {
    for (int64_t g = 0; g < p.batch * p.H_kv; ++g) {
      items.push_back({BackwardItem::group, g, 0, 0, 1});
    }
    return items;
  }
  const CausalRule rule = p.causal();
  const bool causal = p.mask_kind == MaskKind::causal;
  for (int64_t g = 0; g < p.batch * p.H_kv; ++g) {
    for (int64_t c0 = 0; c0 < p.S; c0 += Bc) {
      const int cols = int(std::min<int64_t>(Bc, p.S - c0));
      const int64_t rows = causal ? rule.row_end(c0 + cols - 1, p.L) - rule.first_row(c0, p.L) : p.L;
      if (rows > 0) {
        items.push_back({BackwardItem::keys, g, c0, cols, rows * p.q_kv_heads_ratio * cols});
      }
    }
  }
  for (int64_t n = 0; n < p.batch * p.H_q; ++n) {
    for (int64_t l0 = 0; l0 < p.L; l0 += kBackwardRows) {
      const int rows = int(std::min<int64_t>(kBackwardRows, p.L - l0));
      const int64_t keys = causal ? rule.key_end(l0 + rows - 1, p.S) - rule.key_begin(l0, p.S) : p.S;
      if (keys > 0) {
        items.push_back({BackwardItem::queries, n, l0, rows, keys * rows});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.cost > b.cost; });
  return items;
}

// Rows no item writes (a causal query row that sees no key, a key no row
// sees) keep zero gradients.
void zero_outputs(const BackwardProblem& bp, size_t element) {
  const auto& p = bp.fwd;
  std::fill_n(static_cast<char*>(bp.dq), p.batch * p.H_q * int64_t(p.L) * p.E * element, 0);
  std::fill_n(static_cast<char*>(bp.dk), p.batch * p.H_kv * int64_t(p.S) * p.E * element, 0);
  std::fill_n(static_cast<char*>(bp.dv), p.batch * p.H_kv * int64_t(p.S) * p.E * element, 0);
}

} // namespace

void run_backward(BackwardProblem bp) {
  const AttentionProblem& p = bp.fwd;
  const Kernels& kernels = select_kernels();
  zero_outputs(bp, mx::size_of(p.dtype));
  const int64_t rows = p.batch * p.H_q * int64_t(p.L);
  std::vector<float> D(rows);
  if (p.dtype == mx::float32) {
    row_dots<float>(bp.d_out, p.out, rows, p.E, D.data());
  } else if (p.dtype == mx::float16) {
    row_dots<mx::float16_t>(bp.d_out, p.out, rows, p.E, D.data());
  } else {
    row_dots<mx::bfloat16_t>(bp.d_out, p.out, rows, p.E, D.data());
  }
  if (bp.d_lse) {
    for (int64_t i = 0; i < rows; ++i) D[i] -= bp.d_lse[i] * kLog2e;  // see vjp.cpp
  }
  bp.D = D.data();

  // Small problems run on the calling thread.
  const int64_t work = p.batch * p.H_q * int64_t(p.L) * p.S * p.E;
  const int threads = work < (int64_t(1) << 20) ? 1 : pool_size();
  const std::vector<BackwardItem> items = plan_backward(p, threads);
  const size_t scratch_bytes = BackwardScratch::bytes(p.E, kernels.backward_width);
  std::atomic<size_t> next{0};
  parallel_run(threads, [&](int) {
    void* scratch = thread_scratch(scratch_bytes);
    for (size_t i = next++; i < items.size(); i = next++) {
      kernels.backward(bp, items[i], scratch);
    }
  });
}

} // namespace flashattn::cpu

namespace flashattn {

// inputs: queries, keys, values[, mask], out, d_out, lse[, d_lse]; outputs:
// dq, dk, dv.
void FlashAttentionVJP::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = cpu::start_encoding(stream(), inputs, outputs);
  const size_t n = inputs.size() - (with_lse_grad_ ? 1 : 0);
  std::vector<mx::array> primals(inputs.begin(), inputs.begin() + (n - 3));
  mx::array out = inputs[n - 3];
  cpu::BackwardProblem bp;
  bp.fwd = cpu::describe_problem(primals, out, scale_, mask_kind_, window_);
  bp.d_out = inputs[n - 2].data<void>();
  bp.lse = inputs[n - 1].data<float>();
  if (with_lse_grad_) bp.d_lse = inputs[n].data<float>();
  bp.dq = outputs[0].data<void>();
  bp.dk = outputs[1].data<void>();
  bp.dv = outputs[2].data<void>();
  encoder.dispatch([bp = std::move(bp)]() { cpu::run_backward(bp); });
}

} // namespace flashattn
