// How fast one block gets a fused decode's partials from L2 (no MLX): the
// question behind the merge's time (decode_combine.cuh). A writer launch of
// `splits` blocks leaves each split's o partials of a group's R rows as the
// decode does (float32, [split][row][E], the group's rows contiguous); the
// next launch, one block of 256 threads, reads `bytes` of them back by one
// of three ways and times itself with %globaltimer from its start to the
// moment every thread may use the data:
//   ldcg    float4 loads, `batch` a thread issued together (the merge's way)
//   cp.async 16-byte cp.async.cg copies into shared memory, all issued at once
//   bulk    one cp.async.bulk copy a split (its rows, contiguous), all issued
//           by one thread at once
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/mr scripts/merge-read-probe.cu
//   /tmp/mr [reps]

#include <cstdint>

#include "probe/timeline.cuh"  // CHECK, global_ns
#define FA_DTYPE 2  // the kernels' headers below need a dtype; unused
#include "../packages/flashattn-core/csrc/cuda/kernels/pingpong.cuh"
#include "../packages/flashattn-core/csrc/cuda/kernels/tma.cuh"
#include "probe/read.cuh"  // bulk_copy

namespace {

// Block s writes split s's rows_total x E floats (the partials of every
// group), as the decode's blocks do at their end.
__global__ void write_partials(float* o_part, int rows_total, int E, float x) {
  float* mine = o_part + size_t(blockIdx.x) * rows_total * E;
  for (int i = threadIdx.x; i < rows_total * E; i += blockDim.x) mine[i] = x + i;
}

// Group 0's R rows of every split, splits x R x E floats at stride
// rows_total x E a split. method: 0 ldcg (batch loads a thread at once), 1
// cp.async, 2 bulk. ns[0]: the time, sink: a checksum.
template <int kBatch>
__global__ void read_partials(const float* o_part, int splits, int rows_total, int R, int E, int method,
                              unsigned long long* ns, float* sink) {
  extern __shared__ __align__(128) float smem[];
  __shared__ uint64_t bar;
  const int row_floats = R * E;
  __syncthreads();
  const unsigned long long t0 = probe::global_ns();
  float acc = 0.0f;
  if (method == 0) {
    // Item i (4 floats of the group's rows), splits in parts as the merge.
    const int items = row_floats / 4, threads = blockDim.x;
    const int parts = items > threads ? 1 : threads / items;
    const int i = threadIdx.x % items, part = threadIdx.x / items;
    if (part < parts) {
      for (int s0 = part; s0 < splits; s0 += kBatch * parts) {
        float4 o[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int s = s0 + j * parts;
          o[j] = s < splits ? __ldcg(reinterpret_cast<const float4*>(o_part + size_t(s) * rows_total * E) + i)
                            : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) acc += o[j].x + o[j].y + o[j].z + o[j].w;
      }
    }
    __syncthreads();
  } else if (method == 1) {
    const int n16 = splits * row_floats / 4, per_split = row_floats / 4;
    for (int c = threadIdx.x; c < n16; c += blockDim.x) {
      const int s = c / per_split, w = c % per_split;
      const float* src = o_part + size_t(s) * rows_total * E + 4 * w;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(fa::smem_u32(smem + 4 * c)), "l"(src) : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
  } else {
    if (threadIdx.x == 0) {
      fa::mbar_init(&bar, 1);
      fa::fence_mbar_init();
      fa::mbar_arrive_expect_tx(&bar, uint32_t(splits * row_floats * 4));
      for (int s = 0; s < splits; ++s)
        probe::bulk_copy(smem + s * row_floats, o_part + size_t(s) * rows_total * E, uint32_t(row_floats * 4), &bar);
    }
    __syncthreads();
    fa::mbar_wait(&bar, 0);
  }
  const unsigned long long t1 = probe::global_ns();
  if (method != 0)
    for (int c = threadIdx.x; c < splits * row_floats; c += blockDim.x) acc += smem[c];
  if (threadIdx.x == 0) ns[0] = t1 - t0;
  if (acc == 1234.5f) sink[0] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  cudaDeviceProp p;
  CHECK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
  const int E = 64, rows_total = 14;  // qwen05b: 14 query rows, 7 a KV head
  float *o_part, *sink;
  unsigned long long* ns;
  CHECK(cudaMalloc(&o_part, size_t(128) * rows_total * E * 4));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMalloc(&ns, 8));
  CHECK(cudaFuncSetAttribute(read_partials<16>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CHECK(cudaFuncSetAttribute(read_partials<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  const char* names[] = {"ldcg, 16 a thread", "cp.async.cg 16 B", "cp.async.bulk a split", "ldcg, 8 a thread"};
  for (int R : {7, 2}) {  // a group's rows; 2: about a share's bytes
    for (int splits : {64, 32}) {
      const size_t bytes = size_t(splits) * R * E * 4;
      for (int m = 0; m < 4; ++m) {
        std::vector<double> t;
        for (int r = 0; r < reps; ++r) {
          write_partials<<<splits, 256>>>(o_part, rows_total, E, float(r));
          if (m == 3)
            read_partials<8><<<1, 256, m == 0 || m == 3 ? 0 : bytes>>>(o_part, splits, rows_total, R, E, 0, ns, sink);
          else
            read_partials<16><<<1, 256, m == 0 ? 0 : bytes>>>(o_part, splits, rows_total, R, E, m, ns, sink);
          CHECK(cudaDeviceSynchronize());
          unsigned long long h;
          CHECK(cudaMemcpy(&h, ns, 8, cudaMemcpyDeviceToHost));
          t.push_back(double(h));
        }
        std::sort(t.begin(), t.end());
        std::printf("R %d, %2d splits, %6zu B  %-22s median %6.0f ns  min %6.0f  (%5.1f GB/s)\n", R, splits, bytes,
                    names[m], t[t.size() / 2], t[0], bytes / t[t.size() / 2]);
      }
    }
  }
  return 0;
}
