// The kernel bodies: the threadgroup arrays (sized from the template
// arguments) and the call. MLX writes the signature from the input and
// output names and the [[attribute]] names a body mentions.

#include "metal/kernels.h"

#include <stdexcept>

namespace flashattn::metal {

const std::vector<MetalKernel>& metal_kernels() {
  static const std::vector<MetalKernel> kernels = {
      {"flash_rows",
       {"q", "k", "v", "mask", "mask_base", "params"},
       {"out"},
       R"(
  threadgroup float q_tile[fa::rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float p_tile[fa::rows_per_threadgroup(EPT) * 32];
  fa::flash_rows<T, EPT>(q, k, v, mask, mask_base, params, out, threadgroup_position_in_grid,
                         simdgroup_index_in_threadgroup, thread_index_in_simdgroup, q_tile, p_tile);
)"},
      {"flash_decode",
       {"q", "k", "v", "mask", "mask_base", "params"},
       {"o_part", "ml_part"},
       R"(
  threadgroup float q_tile[fa::rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float p_tile[fa::rows_per_threadgroup(EPT) * 32];
  fa::flash_decode<T, EPT>(q, k, v, mask, mask_base, params, o_part, ml_part,
                           threadgroup_position_in_grid, simdgroup_index_in_threadgroup,
                           thread_index_in_simdgroup, q_tile, p_tile);
)"},
      {"flash_merge",
       {"o_part", "ml_part", "params"},
       {"out"},
       R"(
  fa::flash_merge<T>(o_part, ml_part, params, out, threadgroup_position_in_grid.x,
                     thread_index_in_simdgroup);
)"},
      {"flash_mma",
       {"q", "k", "v", "mask", "mask_base", "params"},
       {"out"},
       R"(
  threadgroup float o_tile[fa::mma_rows() * E];
  threadgroup float kv_tile[fa::mma_keys(E) * E];
  threadgroup float s_tile[fa::mma_rows() * 32];
  threadgroup float alpha_tile[fa::mma_rows()];
  threadgroup uchar hidden_tile[fa::mma_rows() * 32];
  threadgroup int flags[1];
  fa::flash_mma<T, E>(q, k, v, mask, mask_base, params, out, threadgroup_position_in_grid,
                      simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
                      thread_index_in_threadgroup, o_tile, kv_tile, s_tile, alpha_tile,
                      hidden_tile, flags);
)"},
      {"flash_backward_rows",
       {"q", "k", "v", "mask", "mask_base", "params", "o", "d_out"},
       {"dq", "stats"},
       R"(
  threadgroup float q_tile[fa::backward_rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float do_tile[fa::backward_rows_per_threadgroup(EPT) * 32 * EPT];
  threadgroup float ds_tile[fa::backward_rows_per_threadgroup(EPT) * 32];
  threadgroup uchar hidden_tile[fa::backward_rows_per_threadgroup(EPT) * 32];
  fa::flash_backward_rows<T, EPT>(q, k, v, mask, mask_base, params, o, d_out, dq, stats,
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
