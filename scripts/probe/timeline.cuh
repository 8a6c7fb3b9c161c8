// The decode probes' timing (scripts/decode-floor.cu, decode-f32-probe.cu):
// launches timed as MLX runs them (recorded in one CUDA graph), and a
// timeline of every block from %globaltimer at the kernels' FA_MARK points
// (common.cuh). Include it before the kernels: it defines FA_MARK.

#pragma once

#include <cstdint>

#include "harness.cuh"

namespace probe {

// Up to 16 marks a block, recorded by its thread 0 while g_marks is set.
struct Marks {
  unsigned long long ns[16];
};
__device__ Marks* g_marks;
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace probe

#define FA_MARK(i)                                                                              \
  do {                                                                                          \
    if (threadIdx.x == 0 && probe::g_marks != nullptr)                                          \
      probe::g_marks[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x].ns[i] =    \
          probe::global_ns();                                                                   \
  } while (0)

namespace probe {

// Microseconds per launch: `batch` launches (launch(stream, i)) captured in
// one graph, the graph launched `reps` times, each timed; the median. clear:
// zeroed before each replay, outside the timed part (the fused decode's
// flags hold each launch's tag, which a replay repeats).
template <typename Launch>
float graph_us(Launch launch, int reps, void* clear = nullptr, size_t clear_bytes = 0, int batch = 20) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < batch; ++i) launch(s, i);
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> per;
  for (int r = 0; r < reps + 2; ++r) {
    if (clear != nullptr) CHECK(cudaMemsetAsync(clear, 0, clear_bytes, s));
    CHECK(cudaEventRecord(a, s));
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) per.push_back(ms * 1000 / batch);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaStreamDestroy(s));
  return median(per);
}

// One launch (launch_once()) of `blocks` blocks with the marks on; prints
// each mark's median and maximum over the blocks that recorded it, in ns
// from the first block's start.
template <typename Launch>
void print_timeline(int blocks, Launch launch_once) {
  Marks* dm;
  CHECK(cudaMalloc(&dm, blocks * sizeof(Marks)));
  CHECK(cudaMemset(dm, 0, blocks * sizeof(Marks)));
  CHECK(cudaMemcpyToSymbol(g_marks, &dm, sizeof(dm)));
  launch_once();
  CHECK(cudaDeviceSynchronize());
  Marks* none = nullptr;
  CHECK(cudaMemcpyToSymbol(g_marks, &none, sizeof(none)));
  std::vector<Marks> mk(blocks);
  CHECK(cudaMemcpy(mk.data(), dm, blocks * sizeof(Marks), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(dm));
  unsigned long long t0 = ~0ull;
  for (const Marks& m : mk) t0 = std::min(t0, m.ns[0]);
  std::printf("    timeline (ns from the first start; median / max over blocks):");
  for (int i = 0; i < 16; ++i) {
    std::vector<float> x;
    for (const Marks& m : mk)
      if (m.ns[i] != 0) x.push_back(float(m.ns[i] - t0));
    if (x.empty()) continue;
    std::printf("  %d: %.0f / %.0f (%zu)", i, median(x), *std::max_element(x.begin(), x.end()), x.size());
  }
  std::printf("\n");
}

}  // namespace probe
