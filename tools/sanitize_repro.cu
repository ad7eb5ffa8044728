// Minimal kernels of the stage hand-off the training kernels use, for compute-sanitizer racecheck
// (tools/sanitize_check.sh, SUPPRESSIONS in tools/sanitize_cases.py):
//   nvcc -arch=sm_90a -lineinfo -o /tmp/sanitize_repro tools/sanitize_repro.cu
//   compute-sanitizer --tool racecheck /tmp/sanitize_repro [case]
// Two warps share one shared-memory stage through a pair of mbarriers (full: producer -> consumer,
// empty: consumer -> producer), kItems items over one stage, so every item reuses it:
//   warp_arrive   every consumer lane reads the stage, __syncwarp(), lane 0 arrives on `empty` (count 1);
//                 the producer waits on `empty`, then its lanes write the stage (generic stores). This is the
//                 training kernels' release of a stage (training_target reducer, training_indexer_dk math
//                 warps, training_per_head_dk math warps).
//   lane_arrive   the same with every consumer lane arriving (count 32): no __syncwarp hand-off.
//   warp_arrive_bulk / lane_arrive_bulk   the producer refills the stage with cp.async.bulk (async proxy)
//                 instead of generic stores (training_per_head_dk).
//   warp_arrive_cp / lane_arrive_cp   each producer lane refills its word with a 4-byte cp.async whose completion
//                 arrives on `full` (cp.async.mbarrier.arrive.noinc, count 32): the prefill kernel's k scales
//                 (mqa_logits, whose math warps release a KV stage the same way).
// Both forms are ordered by the PTX memory model: bar.warp.sync orders the lanes' reads before lane 0's
// mbarrier.arrive (release at CTA scope, cumulative), the producer's try_wait (acquire) completes only after it;
// so no write of the next item can race a read of the last.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>

constexpr int kItems = 8;

__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void init(uint64_t* b, uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(n));
}
__device__ __forceinline__ void arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(b)) : "memory");
}
__device__ __forceinline__ void arrive_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void wait(uint64_t* b, uint32_t phase) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(saddr(b)), "r"(phase) : "memory");
}

enum class Fill { kStores, kBulk, kCpAsync };

template <bool kLaneArrive, Fill kFill>
__global__ void handoff(const float* __restrict__ src, float* __restrict__ out) {
  __shared__ __align__(128) float stage[128];
  __shared__ uint64_t full, empty;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    init(&full, kFill == Fill::kBulk ? 1 : 32);
    init(&empty, kLaneArrive ? 32 : 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {  // producer
    for (int n = 0; n < kItems; ++n) {
      wait(&empty, ((n & 1) ^ 1));
      if constexpr (kFill == Fill::kBulk) {
        if (lane == 0) {
          arrive_tx(&full, sizeof(stage));
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                       ::"r"(saddr(stage)), "l"(src + 128 * n), "r"(static_cast<uint32_t>(sizeof(stage))),
                       "r"(saddr(&full)) : "memory");
        }
      } else if constexpr (kFill == Fill::kCpAsync) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          asm volatile("cp.async.ca.shared::cta.global [%0], [%1], 4;" ::"r"(saddr(stage + 32 * i + lane)),
                       "l"(src + 128 * n + 32 * i + lane) : "memory");
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(saddr(&full)) : "memory");
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) stage[32 * i + lane] = src[128 * n + 32 * i + lane];
        arrive(&full);
      }
    }
  } else {  // consumer
    float acc = 0.0f;
    for (int n = 0; n < kItems; ++n) {
      wait(&full, n & 1);
#pragma unroll
      for (int i = 0; i < 4; ++i) acc += stage[(32 * i + 5 * lane + n) % 128];
      if constexpr (kLaneArrive) {
        arrive(&empty);
      } else {
        __syncwarp();
        if (lane == 0) arrive(&empty);
      }
    }
    out[lane] = acc;
  }
}

int main(int argc, char** argv) {
  const char* which = argc > 1 ? argv[1] : "all";
  float *src, *out;
  cudaMalloc(&src, kItems * 128 * sizeof(float));
  cudaMalloc(&out, 32 * sizeof(float));
  cudaMemset(src, 0, kItems * 128 * sizeof(float));
  auto go = [&](const char* name, void (*k)(const float*, float*)) {
    if (strcmp(which, "all") != 0 && strcmp(which, name) != 0) return;
    printf("@@case %s\n", name);
    fflush(stdout);
    k<<<1, 64>>>(src, out);
    const cudaError_t e = cudaDeviceSynchronize();
    printf("@@done %s (%s)\n", name, cudaGetErrorString(e));
    fflush(stdout);
  };
  go("warp_arrive", handoff<false, Fill::kStores>);
  go("lane_arrive", handoff<true, Fill::kStores>);
  go("warp_arrive_bulk", handoff<false, Fill::kBulk>);
  go("lane_arrive_bulk", handoff<true, Fill::kBulk>);
  go("warp_arrive_cp", handoff<false, Fill::kCpAsync>);
  go("lane_arrive_cp", handoff<true, Fill::kCpAsync>);
  return 0;
}
