// decode.cu's fused decode (float32; the patch's default path in generation)
// over split counts, standalone (no MLX): GPU time a launch, 20 launches
// recorded in one CUDA graph as MLX runs them, K / V hot in L2; then one
// launch with a timeline of every block (%globaltimer at the kernels'
// FA_MARK points: 0 start, 1 loop done, 2 warps combined, 3 partials
// written, 6-7 flags, 4 claimed, 9 weights, 5 merged). Correctness is the
// GPU suite's (scripts/cuda-check); this only times. The split counts of
// dispatch.cpp's rule for decode.cu came from it (README, "decode, this
// session"), in the form it had on the H200 then (inputs since taken from
// the harness's randn instead of its own generator). The per-phase figures
// inside one chunk there came from extra FA_MARK(10..12) points added to
// decode.cu by hand for that run.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -DFA_E=64 -o /tmp/df32 scripts/decode-f32-probe.cu
//   /tmp/df32          (and again with -DFA_E=128)

#include "probe/timeline.cuh"  // before the kernel: FA_MARK

#define FA_DTYPE 0
#define FA_PARTIAL 2
#ifndef FA_E
#define FA_E 64
#endif
#include "../packages/flashattn-core/csrc/cuda/kernels/decode.cu"

#define KERNEL FA_CAT5(fa_decode_fused_, FA_TNAME, _, FA_E, )

// One (shape, split count): the split rule's keys a split are rounded up to
// 128 as dispatch.cpp rounds them.
void run(const char* name, int H_q, int H_kv, int S, int splits_asked) {
  constexpr int E = FA_E;
  const size_t nk = size_t(H_kv) * S * E;
  int kps = (S + splits_asked - 1) / splits_asked;
  kps = (kps + 127) / 128 * 128;
  const int splits = (S + kps - 1) / kps;
  // The kernel's one output: the attention output, then its partials
  // (partials.h), their tickets last.
  const size_t part_bytes = (size_t(splits) * H_q * (E + 2) + 2 * H_kv * (splits + 1)) * 4 + 4096;
  const size_t part_at = fa::partials::fused_offset_floats(H_q * E * 4);
  std::vector<float> kv = probe::randn<float>(2 * nk, 2), q = probe::randn<float>(size_t(H_q) * E, 1);
  float *dq, *dkv, *dout, *dpart;
  CHECK(cudaMalloc(&dq, q.size() * 4));
  CHECK(cudaMalloc(&dkv, kv.size() * 4));
  CHECK(cudaMalloc(&dout, part_at * 4 + part_bytes));
  dpart = dout + part_at;
  CHECK(cudaMemcpy(dq, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dkv, kv.data(), kv.size() * 4, cudaMemcpyHostToDevice));
  const float scale_log2 = FA_LOG2E / std::sqrt(float(E));
  auto launch = [&](cudaStream_t s, int i) {
    KERNEL<<<dim3(splits, H_kv, 1), 128, 0, s>>>(dq, dkv, dkv + nk, nullptr, nullptr, dout, H_q, H_kv, 1, S, 0, 0, 0, kps,
                                                scale_log2, H_q * E, E, E, H_kv * S * E, S * E, E, H_kv * S * E,
                                                S * E, E, 0x100 + i, 0);
  };

  const float us = probe::graph_us(launch, 20, dpart, part_bytes);
  const int blocks = splits * H_kv;
  probe::print_timeline(blocks, [&] {
    CHECK(cudaMemset(dpart, 0, part_bytes));
    launch(0, 0x777);
  });
  std::printf("f32 %s E=%d S=%6d splits %3d (%4d keys) blocks %4d: %7.2f us a launch\n", name, E, S, splits, kps,
              blocks, us);

  CHECK(cudaFree(dq));
  CHECK(cudaFree(dkv));
  CHECK(cudaFree(dout));
}

int main() {
  probe::print_gpu();
#if FA_E == 64
  for (int S : {2048, 8192, 32768})
    for (int splits : {16, 32, 64, 128}) run("qwen05b", 14, 2, S, splits);
#else
  for (int S : {8192, 32768})
    for (int splits : {8, 16, 32, 64, 128}) run("hd128", 32, 8, S, splits);
#endif
  return 0;
}
