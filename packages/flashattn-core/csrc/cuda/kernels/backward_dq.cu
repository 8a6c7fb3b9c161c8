// fa_backward_dq_<dtype>: the 16-bit backward's gradients from their float32
// sums (backward_tiles16.cuh's GradSums: dQ's, then under GQA dK's and
// dV's; the statistics pass zeroes them, the keys pass adds into them in
// place), cast to the inputs' dtype, rounding to nearest even as MLX's astype
// does, and stored laid out as their inputs are. Without GQA (rows_kv = 0)
// the keys pass wrote dK and dV itself and dk, dv are placeholders. `after` is an output of the keys pass, never
// read: MLX orders the launches of its CUDA graph by the arrays each one
// writes as outputs, and the keys pass writes the sums as an input, so this
// launch waits for it through `after`.

#include <cstdint>

#include "unit.cuh"

#if FA_DTYPE == 0
#error "backward_dq.cu: a 16-bit dtype"
#endif

namespace {

// A gradient's rows (B, H, N, E) as the layout puts them (common.cuh's Rows).
struct Dest {
  FA_T* x;
  fa::Rows rows;
  int H, N;
  __device__ __forceinline__ FA_T* row(int64_t r) const {
    const int64_t bh = r / N;
    return x + rows.at(bh / H, bh % H, r % N);
  }
};

// `rows` rows of E floats from src (row-contiguous) into dst, the threads of
// the grid each 4 at a time.
__device__ __forceinline__ void cast_rows(const float* __restrict__ src, const Dest& dst, int64_t rows, int E) {
  const int64_t n = rows * E, stride = static_cast<int64_t>(gridDim.x) * blockDim.x * 4;
  const bool vec = E % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(dst.x) & 7) == 0 &&
                   ((dst.rows.sb | dst.rows.sh | dst.rows.sr) & 3) == 0;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n; i += stride) {
    if (vec) {
      const float4 x = *reinterpret_cast<const float4*>(src + i);
      union {
        FA_T t[4];
        uint2 u;
      } y;
      y.t[0] = fa::from_f<FA_T>(x.x);
      y.t[1] = fa::from_f<FA_T>(x.y);
      y.t[2] = fa::from_f<FA_T>(x.z);
      y.t[3] = fa::from_f<FA_T>(x.w);
      *reinterpret_cast<uint2*>(dst.row(i / E) + i % E) = y.u;
    } else {
      for (int64_t j = i; j < i + 4 && j < n; ++j) dst.row(j / E)[j % E] = fa::from_f<FA_T>(src[j]);
    }
  }
}

}  // namespace

// Scalars: the rows of dQ (B H_q L) and of dK, dV (B H_kv S; 0 without
// GQA), E, H_q, L, H_kv, S, then dQ's, dK's and dV's rows as they lie.
extern "C" __global__ void FA_CAT3(fa_backward_dq_, FA_TNAME, )(const float* __restrict__ sums, const void* after,
                                                                FA_T* __restrict__ dq, FA_T* __restrict__ dk,
                                                                FA_T* __restrict__ dv, int rows_q, int rows_kv,
                                                                int E, int H_q, int L, int H_kv, int S, int dq_sb,
                                                                int dq_sh, int dq_sr, int dk_sb, int dk_sh, int dk_sr,
                                                                int dv_sb, int dv_sh, int dv_sr) {
  cast_rows(sums, {dq, {dq_sb, dq_sh, dq_sr}, H_q, L}, rows_q, E);
  if (rows_kv > 0) {
    const int64_t n_q = static_cast<int64_t>(rows_q) * E, n_kv = static_cast<int64_t>(rows_kv) * E;
    cast_rows(sums + n_q, {dk, {dk_sb, dk_sh, dk_sr}, H_kv, S}, rows_kv, E);
    cast_rows(sums + n_q + n_kv, {dv, {dv_sb, dv_sh, dv_sr}, H_kv, S}, rows_kv, E);
  }
}
