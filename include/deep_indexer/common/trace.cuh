// Kernel timelines for tools/kernel_trace.py (a maintained tool switch). Compiled in only with DI_JIT_EXTRA_FLAGS=-DDI_KERNEL_TRACE;
// otherwise every member is an empty inline function.
#pragma once
#include <cstdint>
#ifdef DI_KERNEL_TRACE
#include <cstdio>
#endif

#include <deep_indexer/common/ptx.cuh>

namespace deep_indexer {

// Each role of a CTA prints its entry/exit %globaltimer and up to 8 %clock64 marks relative to its
// entry (first call of each mark counts); tools/kernel_trace.py reads the lines.
struct Tracer {
#ifdef DI_KERNEL_TRACE
  uint64_t gt0 = 0, c0 = 0, c[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  static __device__ __forceinline__ uint64_t clock() {
    uint64_t v;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(v)::"memory");
    return v;
  }
  __device__ __forceinline__ void start() {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt0)::"memory");
    c0 = clock();
  }
  // `dep`: a loaded value whose arrival the mark must wait for (stored to shared memory first).
  template <int I>
  __device__ __forceinline__ void mark(int dep = 0) {
    __shared__ int sink;
    asm volatile("st.volatile.shared.u32 [%0], %1;" ::"r"(ptx::smem_addr(&sink)), "r"(dep) : "memory");
    if (c[I] == 0) c[I] = clock() - c0;
  }
  // Accumulating marks (total cycles of a repeated wait, say): now() - since is added to mark I.
  __device__ __forceinline__ uint64_t now() const { return clock(); }
  template <int I>
  __device__ __forceinline__ void add_since(uint64_t since) {
    c[I] += clock() - since;
  }
  __device__ __forceinline__ void print(const char* role, int idx, int count) const {
    uint64_t gt1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt1)::"memory");
    printf("DI_TRACE %s cta=%d idx=%d n=%d gt0=%llu gt1=%llu c=%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu end=%llu\n", role,
           static_cast<int>(blockIdx.x), idx, count, static_cast<unsigned long long>(gt0),
           static_cast<unsigned long long>(gt1), static_cast<unsigned long long>(c[0]),
           static_cast<unsigned long long>(c[1]), static_cast<unsigned long long>(c[2]),
           static_cast<unsigned long long>(c[3]), static_cast<unsigned long long>(c[4]),
           static_cast<unsigned long long>(c[5]), static_cast<unsigned long long>(c[6]),
           static_cast<unsigned long long>(c[7]),
           static_cast<unsigned long long>(clock() - c0));
  }
#else
  __device__ __forceinline__ uint64_t now() const { return 0; }
  template <int I>
  __device__ __forceinline__ void add_since(uint64_t) {}
  __device__ __forceinline__ void start() {}
  template <int I>
  __device__ __forceinline__ void mark(int = 0) {}
  __device__ __forceinline__ void print(const char*, int, int) const {}
#endif
};

}  // namespace deep_indexer
