// The kernel bodies: the threadgroup arrays (sized from the template
// arguments) and the call. MLX writes the signature from the input and
// output names and the [[attribute]] names a body mentions.

#include "metal/kernels.h"

#include <stdexcept>

namespace flashattn::metal {

namespace {

// sinks: one float32 logit per query head (-inf: none).
const std::vector<std::string> kAttentionInputs = {"q", "k", "v", "mask", "mask_base", "params", "sinks"};
// Quantized keys and values: packed words, and float32 scales and biases.
const std::vector<std::string> kQuantizedInputs = {
    "q", "k", "k_scales", "k_biases", "v", "v_scales", "v_biases", "mask", "mask_base", "params", "sinks"};

// The key and value sources of a body: fa::PlainRows<T> over k and v, or
// fa::QuantizedRows over their packed words, scales and biases.
std::string rows_sources(const std::string& source) {
  if (source == "PlainRows") {
    return "  const fa::PlainRows<T> k_rows{k, params[fa::kE]}, v_rows{v, params[fa::kE]};\n";
  }
  return "  const fa::QuantizedRows k_rows{k, k_scales, k_biases, params[fa::kE], params[fa::kKVBits],\n"
         "                                 params[fa::kKVGroupSize]};\n"
         "  const fa::QuantizedRows v_rows{v, v_scales, v_biases, params[fa::kE], params[fa::kKVBits],\n"
         "                                 params[fa::kKVGroupSize]};\n";
}

// lse: the body of a *_lse kernel, which writes each row's log-sum-exp into
// its second output (for a gradient).
std::string rows_body(const std::string& source, bool lse = false) {
  return "\n" + rows_sources(source) + R"(  threadgroup float q_tile[fa::rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float p_tile[fa::rows_per_threadgroup(EPT) * 32];
  fa::flash_rows<T, EPT>(q, k_rows, v_rows, mask, mask_base, params, sinks, out, )" + (lse ? "lse" : "nullptr") +
         R"(, threadgroup_position_in_grid,
                         simdgroup_index_in_threadgroup, thread_index_in_simdgroup, q_tile, p_tile);
)";
}

std::string decode_body(const std::string& source) {
  return "\n" + rows_sources(source) + R"(  threadgroup float q_tile[fa::rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float p_tile[fa::rows_per_threadgroup(EPT) * 32];
  fa::flash_decode<T, EPT>(q, k_rows, v_rows, mask, mask_base, params, o_part, ml_part,
                           threadgroup_position_in_grid, simdgroup_index_in_threadgroup,
                           thread_index_in_simdgroup, q_tile, p_tile);
)";
}

std::string mma_body(const std::string& source, bool lse = false) {
  return "\n" + rows_sources(source) + R"(  threadgroup float o_tile[fa::mma_rows() * E];
  threadgroup float kv_tile[fa::mma_keys(E) * E];
  threadgroup float s_tile[fa::mma_rows() * 32];
  threadgroup float alpha_tile[fa::mma_rows()];
  threadgroup uchar hidden_tile[fa::mma_rows() * 32];
  threadgroup int flags[1];
  fa::flash_mma<T, E>(q, k_rows, v_rows, mask, mask_base, params, sinks, out, )" + std::string(lse ? "lse" : "nullptr") +
         R"(, threadgroup_position_in_grid,
                      simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
                      thread_index_in_threadgroup, o_tile, kv_tile, s_tile, alpha_tile,
                      hidden_tile, flags);
)";
}

}  // namespace

const std::vector<MetalKernel>& metal_kernels() {
  static const std::vector<MetalKernel> kernels = {
      {"flash_rows", kAttentionInputs, {"out"}, rows_body("PlainRows")},
      {"flash_rows_lse", kAttentionInputs, {"out", "lse"}, rows_body("PlainRows", true)},
      {"flash_rows_q", kQuantizedInputs, {"out"}, rows_body("QuantizedRows")},
      // float32 attention over 16-bit inputs: the same bodies, a float32
      // output (its type follows the output array's).
      {"flash_rows_f32", kAttentionInputs, {"out"}, rows_body("PlainRows")},
      {"flash_decode", kAttentionInputs, {"o_part", "ml_part"}, decode_body("PlainRows")},
      {"flash_decode_q", kQuantizedInputs, {"o_part", "ml_part"}, decode_body("QuantizedRows")},
      {"flash_merge",
       {"o_part", "ml_part", "params", "sinks"},
       {"out"},
       R"(
  fa::flash_merge<T>(o_part, ml_part, params, sinks, out, threadgroup_position_in_grid.x,
                     thread_index_in_simdgroup);
)"},
      {"flash_mma", kAttentionInputs, {"out"}, mma_body("PlainRows")},
      {"flash_mma_lse", kAttentionInputs, {"out", "lse"}, mma_body("PlainRows", true)},
      {"flash_mma_q", kQuantizedInputs, {"out"}, mma_body("QuantizedRows")},
      {"flash_mma_f32", kAttentionInputs, {"out"}, mma_body("PlainRows")},
      {"flash_backward_rows",
       {"q", "k", "v", "mask", "mask_base", "params", "o", "d_out", "sinks", "lse_kept"},
       {"dq", "stats"},
       R"(
  threadgroup float q_tile[fa::backward_rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float do_tile[fa::backward_rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float ds_tile[fa::backward_rows_per_threadgroup(EPT) * 32];
  threadgroup uchar hidden_tile[fa::backward_rows_per_threadgroup(EPT) * 32];
  fa::flash_backward_rows<T, EPT>(q, k, v, mask, mask_base, params, o, d_out, sinks, lse_kept, dq, stats,
                                  threadgroup_position_in_grid, simdgroup_index_in_threadgroup,
                                  thread_index_in_simdgroup, q_tile, do_tile, ds_tile, hidden_tile);
)"},
      {"flash_backward_keys",
       {"q", "k", "v", "mask", "mask_base", "params", "d_out", "stats"},
       {"dk", "dv"},
       R"(
  threadgroup float k_tile[fa::backward_rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float v_tile[fa::backward_rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float p_tile[fa::backward_rows_per_threadgroup(EPT) * 32];
  threadgroup float ds_tile[fa::backward_rows_per_threadgroup(EPT) * 32];
  threadgroup uchar hidden_tile[fa::backward_rows_per_threadgroup(EPT) * 32];
  fa::flash_backward_keys<T, EPT>(q, k, v, mask, mask_base, params, d_out, stats, dk, dv,
                                  threadgroup_position_in_grid, simdgroup_index_in_threadgroup,
                                  thread_index_in_simdgroup, k_tile, v_tile, p_tile, ds_tile, hidden_tile);
)"},
  };
  return kernels;
}

const MetalKernel& find_kernel(const std::string& name) {
  for (const auto& k : metal_kernels()) {
    if (k.name == name) return k;
  }
  throw std::logic_error("flash_attention: no Metal kernel named " + name);
}

}  // namespace flashattn::metal
