// fa_backward_dq_<dtype>: the 16-bit backward's gradients from their float32
// sums (backward_tiles16.cuh's GradSums: dQ's, then under GQA dK's and
// dV's; the statistics pass zeroes them, the keys pass adds into them in
// place), cast to the inputs' dtype, rounding to nearest even as MLX's astype
// does. Without GQA (rows_kv = 0) the keys pass wrote dK and dV itself and
// dk, dv are placeholders. `after` is an output of the keys pass, never
// read: MLX orders the launches of its CUDA graph by the arrays each one
// writes as outputs, and the keys pass writes the sums as an input, so this
// launch waits for it through `after`.

#include <cstdint>

#include "unit.cuh"

#if FA_DTYPE == 0
#error "backward_dq.cu: a 16-bit dtype"
#endif

namespace {

// n floats of src into dst, the threads of the grid each 4 at a time.
__device__ __forceinline__ void cast_rows(const float* __restrict__ src, FA_T* __restrict__ dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * 4;
  const bool vec = ((reinterpret_cast<uintptr_t>(src) & 15) | (reinterpret_cast<uintptr_t>(dst) & 7)) == 0;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n; i += stride) {
    if (vec && i + 3 < n) {
      const float4 x = *reinterpret_cast<const float4*>(src + i);
      union {
        FA_T t[4];
        uint2 u;
      } y;
      y.t[0] = fa::from_f<FA_T>(x.x);
      y.t[1] = fa::from_f<FA_T>(x.y);
      y.t[2] = fa::from_f<FA_T>(x.z);
      y.t[3] = fa::from_f<FA_T>(x.w);
      *reinterpret_cast<uint2*>(dst + i) = y.u;
    } else {
      for (int64_t j = i; j < i + 4 && j < n; ++j) dst[j] = fa::from_f<FA_T>(src[j]);
    }
  }
}

}  // namespace

extern "C" __global__ void FA_CAT3(fa_backward_dq_, FA_TNAME, )(const float* __restrict__ sums, const void* after,
                                                                FA_T* __restrict__ dq, FA_T* __restrict__ dk,
                                                                FA_T* __restrict__ dv, int rows_q, int rows_kv,
                                                                int E) {
  const int64_t n_q = static_cast<int64_t>(rows_q) * E, n_kv = static_cast<int64_t>(rows_kv) * E;
  cast_rows(sums, dq, n_q);
  if (n_kv > 0) {
    cast_rows(sums + n_q, dk, n_kv);
    cast_rows(sums + n_q + n_kv, dv, n_kv);
  }
}
