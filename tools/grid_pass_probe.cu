// What a selection among all the decode CTAs would pay per step (design-notes, "What bounds KF-D1"):
// one CTA on every SM, timed per round from each CTA's %globaltimer (the round ends with the last CTA).
//   barrier        a grid-wide barrier: a release add to one counter, thread 0 of each CTA polling it (acquire)
//   pass, hot bins one radix pass over a 32K-key row: every key an atomic add into a global 2048-bin histogram
//                  (keys crowding ~128 bins, as logits' top 11 key bits do), a barrier, every CTA loading the
//                  histogram and finding the bin of rank 2048, the other histogram cleared, a barrier
//   pass, CTA hist the same with each CTA counting into shared memory first and adding its non-zero bins
//   pass, spread   the same with an atomic per key spread over all 2048 bins (no same-address contention)
// Build and run on an SM90 GPU:  nvcc -arch=sm_90a -O3 -o /tmp/grid_pass_probe tools/grid_pass_probe.cu && /tmp/grid_pass_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr int kBins = 2048;
constexpr int kRowKeys = 32768;
constexpr int kRank = 2048;  // the k of the pass's bin search
enum Mode { kBarrier = 0, kHotBins, kCtaHist, kSpread, kModes };
const char* const kModeNames[kModes] = {"barrier", "pass, hot bins", "pass, CTA hist", "pass, spread"};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// The counter only grows: barrier `round` (1, 2, ...) waits for round * gridDim.x arrivals.
__device__ __forceinline__ void grid_sync(unsigned* counter, unsigned round) {
  __syncthreads();
  if (threadIdx.x == 0) {
    red_release(counter, 1u);
    while (ld_acquire(counter) < round * gridDim.x) {
    }
  }
  __syncthreads();
}

// A key's bin: ~128 busy bins (kHotBins, kCtaHist) or all of them (kSpread).
__device__ __forceinline__ unsigned bin_of(int mode, int key, int round) {
  const unsigned x = blockIdx.x * 2654435761u + key * 40503u + round * 977u;
  return mode == kSpread ? x >> 21 : 1000u + (x >> 25);
}

__global__ void probe(unsigned* counter, unsigned* hist, unsigned long long* ends, int rounds, int mode) {
  __shared__ unsigned cta_hist[kBins];
  __shared__ unsigned warp_sums[32];
  __shared__ unsigned found;
  const int keys = (kRowKeys + gridDim.x - 1) / gridDim.x;
  if (threadIdx.x == 0) found = 0u;
  unsigned barrier_round = 0;
  const uint64_t t0 = global_ns();
  for (int i = 0; i < rounds; ++i) {
    if (mode != kBarrier) {
      unsigned* h = hist + (i & 1) * kBins;
      if (mode == kCtaHist) {
        for (int b = threadIdx.x; b < kBins; b += blockDim.x) cta_hist[b] = 0u;
        __syncthreads();
        for (int j = threadIdx.x; j < keys; j += blockDim.x) atomicAdd(cta_hist + bin_of(mode, j, i), 1u);
        __syncthreads();
        for (int b = threadIdx.x; b < kBins; b += blockDim.x)
          if (cta_hist[b] != 0u) atomicAdd(h + b, cta_hist[b]);
      } else {
        for (int j = threadIdx.x; j < keys; j += blockDim.x) atomicAdd(h + bin_of(mode, j, i), 1u);
      }
      grid_sync(counter, ++barrier_round);
      // every CTA: its threads' consecutive bins from L2, a block suffix scan, the bin of rank kRank
      const int per = kBins / blockDim.x;
      unsigned own = 0;
      for (int b = 0; b < per; ++b) own += __ldcg(h + threadIdx.x * per + b);
      unsigned incl = own;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned v = __shfl_down_sync(~0u, incl, o);
        if ((threadIdx.x & 31) + o < 32) incl += v;
      }
      if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = incl;
      __syncthreads();
      unsigned above = incl - own;
      for (int w = (threadIdx.x >> 5) + 1; w < static_cast<int>(blockDim.x >> 5); ++w) above += warp_sums[w];
      if (above < kRank && kRank <= above + own) found = threadIdx.x;
      __syncthreads();
      unsigned* h_next = hist + ((i + 1) & 1) * kBins;  // cleared for the next round, a slice per CTA
      for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < kBins; b += gridDim.x * blockDim.x) h_next[b] = 0u;
    }
    grid_sync(counter, ++barrier_round);
    if (threadIdx.x == 0) ends[blockIdx.x * rounds + i] = global_ns() - t0;
  }
  if (threadIdx.x == 0 && found == ~0u) ends[0] = 0;  // keeps the search
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  constexpr int kRounds = 64, kWarmRounds = 4;
  unsigned *counter, *hist;
  unsigned long long* ends;
  cudaMalloc(&counter, 4);
  cudaMalloc(&hist, 2 * kBins * 4);
  cudaMalloc(&ends, static_cast<size_t>(sms) * kRounds * 8);
  for (int threads : {128, 512}) {
    for (int mode = 0; mode < kModes; ++mode) {
      cudaMemset(counter, 0, 4);
      cudaMemset(hist, 0, 2 * kBins * 4);
      probe<<<sms, threads>>>(counter, hist, ends, kRounds, mode);
      if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
        std::printf("error: %s\n", cudaGetErrorString(e));
        return 1;
      }
      std::vector<unsigned long long> t(static_cast<size_t>(sms) * kRounds);
      cudaMemcpy(t.data(), ends, t.size() * 8, cudaMemcpyDeviceToHost);
      std::vector<double> steps;  // the last CTA's end of a round minus that of the round before
      unsigned long long prev = 0;
      for (int i = 0; i < kRounds; ++i) {
        unsigned long long last = 0;
        for (int b = 0; b < sms; ++b) last = std::max(last, t[static_cast<size_t>(b) * kRounds + i]);
        if (i >= kWarmRounds) steps.push_back((last - prev) / 1000.0);
        prev = last;
      }
      std::sort(steps.begin(), steps.end());
      std::printf("%d CTAs x %d threads, %-15s: %.2f us a round (p10 %.2f, p90 %.2f)\n", sms, threads,
                  kModeNames[mode], steps[steps.size() / 2], steps[steps.size() / 10], steps[steps.size() * 9 / 10]);
    }
  }
  return 0;
}
