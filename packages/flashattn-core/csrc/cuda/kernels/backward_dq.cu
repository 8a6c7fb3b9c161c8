// fa_backward_dq_<dtype>: dQ from its float32 sums (the statistics pass
// zeroes them, the 16-bit keys pass adds into them in place), cast to the
// inputs' dtype, rounding to nearest even as MLX's astype does. `after` is
// an output of the keys pass, never read: MLX orders the launches of its
// CUDA graph by the arrays each one writes as outputs, and the keys pass
// writes the sums as an input, so this launch waits for it through `after`.

#include <cstdint>

#include "unit.cuh"

#if FA_DTYPE == 0
#error "backward_dq.cu: a 16-bit dtype"
#endif

extern "C" __global__ void FA_CAT3(fa_backward_dq_, FA_TNAME, )(const float* __restrict__ sums, const void* after,
                                                                FA_T* __restrict__ dq, int rows, int E) {
  const int64_t n = static_cast<int64_t>(rows) * E, stride = static_cast<int64_t>(gridDim.x) * blockDim.x * 4;
  const bool vec = ((reinterpret_cast<uintptr_t>(sums) & 15) | (reinterpret_cast<uintptr_t>(dq) & 7)) == 0;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n; i += stride) {
    if (vec && i + 3 < n) {
      const float4 x = *reinterpret_cast<const float4*>(sums + i);
      union {
        FA_T t[4];
        uint2 u;
      } y;
      y.t[0] = fa::from_f<FA_T>(x.x);
      y.t[1] = fa::from_f<FA_T>(x.y);
      y.t[2] = fa::from_f<FA_T>(x.z);
      y.t[3] = fa::from_f<FA_T>(x.w);
      *reinterpret_cast<uint2*>(dq + i) = y.u;
    } else {
      for (int64_t j = i; j < i + 4 && j < n; ++j) dq[j] = fa::from_f<FA_T>(sums[j]);
    }
  }
}
