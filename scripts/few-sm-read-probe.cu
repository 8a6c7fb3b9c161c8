// How fast a few SMs can read a decode call's K and V from memory: the floor
// of a decode that keeps each KV head's key splits inside one thread-block
// cluster (merged through distributed shared memory, no global round trips)
// instead of spreading them over every SM. qwen05b S = 32768 (2 KV heads,
// 16.8 MB of bfloat16 K and V), 16 copies taken in turn (from memory), 20
// launches in one CUDA graph as MLX runs them (probe/timeline.cuh).
//
// - ring: one thread a block streams its share through shared memory by 1-d
//   bulk copies (TMA) into a ring of stages; the other warps wait for each
//   stage, read it whole and free it. Grids of 16-132 blocks, one an SM
//   (the ring's shared memory), with and without clusters of 8 / 16.
// - plain: the same shares read by 16-byte loads, U in flight a thread.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/fr scripts/few-sm-read-probe.cu
//   /tmp/fr [reps]

#include "probe/timeline.cuh"
#include "probe/read.cuh"

#include "../packages/flashattn-core/csrc/cuda/kernels/pingpong.cuh"
#include "../packages/flashattn-core/csrc/cuda/kernels/tma.cuh"

constexpr int kMaxStages = 16;

// Warp 0's lane 0 produces; warps 1.. consume. Stage c % stages of
// stage_bytes; full[s]: the copy's bytes; empty[s]: one arrival a consumer warp.
__global__ void ring_kernel(const char* __restrict__ src, size_t bytes, int stage_bytes, int stages,
                            uint32_t* sink) {
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  const int warps = blockDim.x / 32, w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t per = bytes / gridDim.x;
  const char* mine = src + blockIdx.x * per;
  const int chunks = int((per + stage_bytes - 1) / stage_bytes);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) fa::mbar_init(&full[s], 1), fa::mbar_init(&empty[s], warps - 1);
    fa::fence_mbar_init();
  }
  __syncthreads();
  if (w == 0) {
    if (lane == 0) {
      for (int c = 0; c < chunks; ++c) {
        const int s = c % stages;
        if (c >= stages) fa::mbar_wait(&empty[s], ((c / stages) - 1) & 1);
        const uint32_t n = uint32_t(min(size_t(stage_bytes), per - size_t(c) * stage_bytes));
        fa::mbar_arrive_expect_tx(&full[s], n);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                fa::smem_u32(smem + size_t(s) * stage_bytes)),
            "l"(mine + size_t(c) * stage_bytes), "r"(n), "r"(fa::smem_u32(&full[s]))
            : "memory");
      }
    }
    return;
  }
  uint32_t acc = 0;
  for (int c = 0; c < chunks; ++c) {
    const int s = c % stages;
    fa::mbar_wait(&full[s], (c / stages) & 1);
    const uint4* st = reinterpret_cast<const uint4*>(smem + size_t(s) * stage_bytes);
    for (int i = threadIdx.x - 32; i < stage_bytes / 16; i += blockDim.x - 32) {
      const uint4 x = st[i];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    __syncwarp();
    if (lane == 0) fa::mbar_arrive(&empty[s]);
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

// All threads copy (cp.async, 16 bytes each) stage c + STAGES - 1 of
// stage_bytes into a ring while stage c is read: STAGES - 1 stages in flight.
template <int STAGES>
__global__ void cp_async_kernel(const char* __restrict__ src, size_t bytes, int stage_bytes, uint32_t* sink) {
  extern __shared__ __align__(128) char smem[];
  const size_t per = bytes / gridDim.x;
  const char* mine = src + blockIdx.x * per;
  const int chunks = int(per / stage_bytes);
  auto issue = [&](int c) {
    if (c < chunks) {
      char* dst = smem + size_t(c % STAGES) * stage_bytes;
      for (int i = threadIdx.x * 16; i < stage_bytes; i += blockDim.x * 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(fa::smem_u32(dst + i)),
                     "l"(mine + size_t(c) * stage_bytes + i)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  for (int c = 0; c < STAGES - 1; ++c) issue(c);
  uint32_t acc = 0;
  for (int c = 0; c < chunks; ++c) {
    issue(c + STAGES - 1);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1) : "memory");
    __syncthreads();
    const uint4* st = reinterpret_cast<const uint4*>(smem + size_t(c % STAGES) * stage_bytes);
    for (int i = threadIdx.x; i < stage_bytes / 16; i += blockDim.x) {
      const uint4 x = st[i];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    __syncthreads();
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

int main(int argc, char** argv) {
  const probe::FloorStart start = probe::floor_start(argc, argv);
  const int reps = start.reps, sms = start.sms;
  uint32_t* const sink = start.sink;
  const size_t bytes = size_t(2) * 2 * 32768 * 64 * 2;  // K and V, 2 heads, S = 32768, E = 64, bfloat16
  const int copies = 16;
  char* kv;
  CHECK(cudaMalloc(&kv, bytes * copies));
  CHECK(cudaMemset(kv, 1, bytes * copies));
  auto kv_of = [&](int i) { return kv + size_t(i % copies) * bytes; };
  std::printf("K/V %.1f MB, %d copies, %d SMs\n", bytes / 1e6, copies, sms);
  for (int grid : {16, 32, 64, sms}) {
    for (int threads : {512, 1024}) {
      const float t = probe::graph_us(
          [&](cudaStream_t s, int i) {
            read_kernel<8><<<grid, threads, 0, s>>>(reinterpret_cast<const uint4*>(kv_of(i)), bytes / 16, sink);
          },
          reps);
      std::printf("  plain %4d blocks x %4d threads, 8 x 16 B in flight      %6.2f us  %6.0f GB/s  %5.1f GB/s an SM\n",
                  grid, threads, t, bytes / (t * 1e3), bytes / (t * 1e3) / grid);
    }
  }
  for (int grid : {16, 32, 64}) {
    auto more = [&](auto kernel, int u) {
      const float t = probe::graph_us(
          [&](cudaStream_t s, int i) {
            kernel<<<grid, 1024, 0, s>>>(reinterpret_cast<const uint4*>(kv_of(i)), bytes / 16, sink);
          },
          reps);
      std::printf("  plain %4d blocks x 1024 threads, %2d x 16 B in flight      %6.2f us  %6.0f GB/s  %5.1f GB/s an SM\n",
                  grid, u, t, bytes / (t * 1e3), bytes / (t * 1e3) / grid);
    };
    more(read_kernel<12>, 12);
    more(read_kernel<16>, 16);
  }
  auto cp_async = [&](auto kernel, int stages, int stage) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    for (int grid : {16, 32, 64, 128})
      for (int threads : {256, 512}) {
        const float t = probe::graph_us(
            [&](cudaStream_t s, int i) {
              kernel<<<grid, threads, size_t(stage) * stages, s>>>(kv_of(i), bytes, stage, sink);
            },
            reps);
        std::printf("  cp.async %4d blocks, %2d x %5d B, %3d threads           %6.2f us  %6.0f GB/s  %5.1f GB/s an SM\n",
                    grid, stages, stage, threads, t, bytes / (t * 1e3), bytes / (t * 1e3) / grid);
      }
  };
  cp_async(cp_async_kernel<4>, 4, 32768);
  cp_async(cp_async_kernel<6>, 6, 32768);
  cp_async(cp_async_kernel<8>, 8, 16384);
  cp_async(cp_async_kernel<12>, 12, 16384);
  CHECK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CHECK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  for (int grid : {16, 32, 64, 128}) {
    for (int cluster : {1, 8, 16}) {
      if (cluster > grid) continue;
      for (const std::pair<int, int> shape : {std::pair{16384, 12}, std::pair{32768, 6}, std::pair{8192, 16}}) {
        const int stage = shape.first, stages = shape.second;
        for (int threads : {288}) {
          cudaLaunchAttribute attr[1];
          attr[0].id = cudaLaunchAttributeClusterDimension;
          attr[0].val.clusterDim.x = cluster, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
          bool ok = true;
          const float t = probe::graph_us(
              [&](cudaStream_t s, int i) {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(grid), cfg.blockDim = dim3(threads);
                cfg.dynamicSmemBytes = size_t(stage) * stages, cfg.stream = s;
                cfg.attrs = attr, cfg.numAttrs = 1;
                if (cudaLaunchKernelEx(&cfg, ring_kernel, (const char*)kv_of(i), bytes, stage, stages, sink) !=
                    cudaSuccess)
                  ok = false;
              },
              reps);
          if (!ok) {
            std::printf("  ring %d / cluster %d: launch failed\n", grid, cluster);
            cudaGetLastError();
            continue;
          }
          std::printf("  ring  %4d blocks, cluster %2d, %2d x %5d B, %3d threads %6.2f us  %6.0f GB/s  %5.1f GB/s an SM\n",
                      grid, cluster, stages, stage, threads, t, bytes / (t * 1e3), bytes / (t * 1e3) / grid);
        }
      }
    }
  }
  return 0;
}
