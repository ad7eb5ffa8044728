// Thin wrappers over the SM90 PTX that every deep_indexer kernel uses: mbarriers, TMA, WGMMA
// fences and descriptors, register reconfiguration, named barriers, pipeline state; warp reductions.
#pragma once
#include <cstdint>
#include <cuda.h>

#include <deep_indexer/common/wgmma_fp8.cuh>

#define DI_DEVICE __device__ __forceinline__

namespace deep_indexer::ptx {

DI_DEVICE uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

DI_DEVICE uint32_t lane_idx() { return threadIdx.x & 31u; }

// One reduce-scatter step across lane pairs (lane ^ kLaneMask). `in` holds kN partial sums; the
// pair (i0, i1) differs in index bit kBit. The lane with `upper` set keeps i1 and sends i0, its
// partner keeps i0 and sends i1. out[k] (k = index with bit kBit removed) is the pair's total.
template <int kN, int kBit, int kLaneMask>
DI_DEVICE void reduce_scatter_step(const float (&in)[kN], float (&out)[kN / 2], bool upper) {
  static_assert(kN >= 2 && (1 << kBit) < kN, "bad reduce-scatter step");
#pragma unroll
  for (int k = 0; k < kN / 2; ++k) {
    constexpr int kLow = (1 << kBit) - 1;
    const int i0 = ((k & ~kLow) << 1) | (k & kLow);
    const int i1 = i0 | (1 << kBit);
    const float keep = upper ? in[i1] : in[i0];
    const float send = upper ? in[i0] : in[i1];
    out[k] = keep + __shfl_xor_sync(0xffffffffu, send, kLaneMask);
  }
}

// Warp-uniform warp index (keeps the compiler from treating role branches as divergent).
DI_DEVICE uint32_t warp_idx() { return __shfl_sync(0xffffffffu, threadIdx.x / 32u, 0); }

DI_DEVICE bool elect_one() {
  uint32_t pred = 0;
  asm volatile(
      "{\n.reg .b32 r;\n.reg .pred p;\n"
      "elect.sync r|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(pred));
  return pred != 0;
}

// A 32-bit store to this CTA's shared memory at shared-window address `addr` (smem_addr).
DI_DEVICE void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// a + b, kept where it is written (volatile: not sunk into the predicated blocks that use it).
DI_DEVICE uint32_t add_u32(uint32_t a, uint32_t b) {
  uint32_t r;
  asm volatile("add.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// The shared-window address of a word that only lane 0 updates, in the form atom_add_shared_lane0 takes:
// addr + 4 * %laneid (= addr in lane 0). NOTES: ptxas cannot prove it warp-uniform, so it does not wrap the
// atomic in a warp aggregation (vote, scan, shuffles: ~20 instructions per call); computed once and held, it
// is not rebuilt at every call.
DI_DEVICE uint32_t lane0_shared_addr(uint32_t addr) {
  uint32_t a;
  asm volatile("{\n.reg .u32 l;\nmov.u32 l, %%laneid;\nmad.lo.u32 %0, l, 4, %1;\n}" : "=r"(a) : "r"(addr));
  return a;
}

// atomicAdd on a 32-bit shared word, for lane 0 alone; `addr_lane` from lane0_shared_addr.
DI_DEVICE uint32_t atom_add_shared_lane0(uint32_t addr_lane, uint32_t v) {
  uint32_t old;
  asm volatile("atom.shared.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(addr_lane), "r"(v) : "memory");
  return old;
}

// ---------------------------------------------------------------- mbarrier
DI_DEVICE void mbar_init(uint64_t* bar, uint32_t arrive_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrive_count));
}

DI_DEVICE void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// 4-byte asynchronous copy global -> shared (LDGSTS), tracked by cp_async_mbar_arrive.
DI_DEVICE void cp_async_4(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared::cta.global [%0], [%1], 4;" ::"r"(smem_addr(smem_dst)), "l"(gmem_src) : "memory");
}
// One arrival on `bar` once this thread's earlier cp.async copies have landed (.noinc: the barrier's
// expected count must include it).
DI_DEVICE void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
DI_DEVICE void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

DI_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Raises the current phase's expected transaction bytes without arriving (the arrival comes later).
DI_DEVICE void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

DI_DEVICE bool mbar_try_wait(uint64_t* bar, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(phase)
      : "memory");
  return done != 0;
}

DI_DEVICE void mbar_wait(uint64_t* bar, uint32_t phase) {
  while (!mbar_try_wait(bar, phase)) {
  }
}

// Wait with cluster-scope acquire: for barriers that other CTAs of the cluster arrive on.
DI_DEVICE bool mbar_try_wait_cluster(uint64_t* bar, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(phase)
      : "memory");
  return done != 0;
}

DI_DEVICE void mbar_wait_cluster(uint64_t* bar, uint32_t phase) {
  while (!mbar_try_wait_cluster(bar, phase)) {
  }
}

// ---------------------------------------------------------------- clusters
DI_DEVICE uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster (release / acquire of shared memory and mbarrier state).
DI_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The shared::cluster address of shared-window address `addr` (smem_addr) in CTA `cta` of the cluster.
DI_DEVICE uint32_t map_cluster(uint32_t addr, uint32_t cta) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(cta));
  return r;
}
// Stores to a shared::cluster address (map_cluster) that complete_tx their bytes on the mbarrier at the
// shared::cluster address `bar` (in the same CTA as `addr`). NOTES: the data alone is covered: the
// waiter sees it once the phase completes, no other write of the sender.
DI_DEVICE void st_async_u32(uint32_t addr, uint32_t v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(addr), "r"(v), "r"(bar)
               : "memory");
}
DI_DEVICE void st_async_v2(uint32_t addr, uint2 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(addr),
               "r"(v.x), "r"(v.y), "r"(bar)
               : "memory");
}

// A cluster barrier in two halves: every thread of every CTA arrives, later waits (no memory ordering
// of its own: after fence_mbar_init it publishes mbarrier initialisations).
DI_DEVICE void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
DI_DEVICE void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// Arrive on the mbarrier at `bar`'s offset in the shared memory of CTA `cta` of the cluster (may be this CTA).
DI_DEVICE void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

// ---------------------------------------------------------------- programmatic dependent launch
// A kernel launched with programmatic stream serialization (jit::LaunchConfig::pdl) may start while
// the previous kernel of the stream finishes: it waits here, before its first global read or write,
// until that kernel has completed and its writes are visible (a no-op in a plain launch).
DI_DEVICE void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Lets the stream's next kernel (if launched with PDL) be scheduled once every CTA of this grid has
// issued it or exited: its CTAs take SMs as they free up and still wait in grid_dependency_wait for
// this grid's completion. One thread per CTA suffices (later issues have no effect).
DI_DEVICE void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// ---------------------------------------------------------------- TMA
DI_DEVICE void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// L2 eviction-priority hints (createpolicy.fractional results, valid on SM90).
constexpr uint64_t kCacheEvictFirst = 0x12F0000000000000ull;
constexpr uint64_t kCacheEvictNormal = 0x1000000000000000ull;
constexpr uint64_t kCacheEvictLast = 0x14F0000000000000ull;

DI_DEVICE void tma_load_1d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0,
                           uint64_t hint = kCacheEvictNormal) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3}], [%2], %4;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "l"(hint)
      : "memory");
}

DI_DEVICE void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0, int32_t c1,
                           uint64_t hint = kCacheEvictNormal) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "l"(hint)
      : "memory");
}

DI_DEVICE void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0, int32_t c1,
                           int32_t c2, uint64_t hint = kCacheEvictNormal) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "l"(hint)
      : "memory");
}

// A 2-D box into the same shared-memory offset of every CTA in `cta_mask` (bit i: cluster rank i); each
// destination's mbarrier at `bar`'s offset receives the box's bytes.
DI_DEVICE void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0, int32_t c1,
                                     uint16_t cta_mask, uint64_t hint = kCacheEvictNormal) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      ".L2::cache_hint [%0], [%1, {%3, %4}], [%2], %5, %6;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask), "l"(hint)
      : "memory");
}

// Plain bulk copy (no tensor map): `bytes` and both addresses must be multiples of 16.
DI_DEVICE void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

DI_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---------------------------------------------------------------- WGMMA
DI_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
DI_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
DI_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across wgmma fences and waits.
template <int kNum>
DI_DEVICE void fence_accum(float* acc) {
#pragma unroll
  for (int i = 0; i < kNum; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// The same for register A fragments: their producers stay before the fence, their reuse after the wait.
template <int kNum>
DI_DEVICE void fence_regs(uint32_t* r) {
#pragma unroll
  for (int i = 0; i < kNum; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Swizzle mode of a K-major tile whose rows are `kRowBytes` long (32, 64 or 128 bytes).
template <int kRowBytes>
struct SwizzleMode {
  static_assert(kRowBytes == 32 || kRowBytes == 64 || kRowBytes == 128, "rows must be 32, 64 or 128 bytes");
  // Descriptor layout-type field: 1 = 128B, 2 = 64B, 3 = 32B swizzle.
  static constexpr uint64_t kDescLayout = kRowBytes == 128 ? 1 : (kRowBytes == 64 ? 2 : 3);
  // Byte stride between consecutive 8-row core-matrix groups.
  static constexpr uint32_t kGroupStride = 8 * kRowBytes;
  // Required alignment of the tile base (one full swizzle atom).
  static constexpr uint32_t kAlign = 8 * kRowBytes < 1024 ? 8 * kRowBytes : 1024;
  // Where byte `off` of the unswizzled tile (row * kRowBytes + column) lies: the 16-byte chunk
  // index (bits 4..) is XORed with the row bits 7.. (TMA's 32B/64B/128B swizzle patterns).
  static constexpr uint32_t kChunkMask = (kRowBytes / 16 - 1) << 4;
  __host__ __device__ static constexpr uint32_t swizzle(uint32_t off) { return off ^ ((off >> 3) & kChunkMask); }
};

// ---------------------------------------------------------------- fp8 (e4m3) conversions
// Byte i of `bits` <-> element i (cvt packs its first f32 operand into the upper byte).
DI_DEVICE float2 f16x2_to_float2(uint32_t bits) {
  float lo, hi;
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.f32.f16 %0, a;\ncvt.f32.f16 %1, b;\n}"
      : "=f"(lo), "=f"(hi)
      : "r"(bits));
  return make_float2(lo, hi);
}
DI_DEVICE float4 e4m3x4_to_float4(uint32_t bits) {
  uint32_t lo, hi;
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(bits));
  const float2 a = f16x2_to_float2(lo), b = f16x2_to_float2(hi);
  return make_float4(a.x, a.y, b.x, b.y);
}
// Round to nearest, saturating to +-448.
DI_DEVICE uint32_t float4_to_e4m3x4(float4 v) {
  uint32_t bits;
  asm("{\n.reg .b16 a, b;\ncvt.rn.satfinite.e4m3x2.f32 a, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 b, %4, %3;\n"
      "mov.b32 %0, {a, b};\n}"
      : "=r"(bits)
      : "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w));
  return bits;
}

// Shared-memory matrix descriptor for a K-major swizzled tile with `kRowBytes`-byte rows, started
// at `ptr` (which may be offset by a multiple of 32 bytes inside a row to step along K).
template <int kRowBytes>
DI_DEVICE uint64_t make_kmajor_desc(const void* ptr) {
  using S = SwizzleMode<kRowBytes>;
  const uint64_t addr = smem_addr(ptr);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFFull) >> 4;                          // start address
  desc |= uint64_t(1) << 16;                                  // leading byte offset (unused when swizzled)
  desc |= uint64_t((S::kGroupStride & 0x3FFFFu) >> 4) << 32;  // stride byte offset
  desc |= S::kDescLayout << 62;
  return desc;
}

// Descriptor of an MN-major tile with 128-byte swizzle (bf16: 64 elements of M or N per 128-byte row):
// rows are consecutive K indices (8-row groups 1024 bytes apart), `mn_block_bytes` apart lie the
// blocks of the next 64 M/N elements. A K step of 16 starts 2048 bytes further.
DI_DEVICE uint64_t make_mn_major_desc_sw128(const void* ptr, uint32_t mn_block_bytes) {
  const uint64_t addr = smem_addr(ptr);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFFull) >> 4;                          // start address
  desc |= uint64_t((mn_block_bytes & 0x3FFFFu) >> 4) << 16;  // leading byte offset: next 64 M/N elements
  desc |= uint64_t(1024 >> 4) << 32;                          // stride byte offset: next 8 K rows
  desc |= uint64_t(1) << 62;                                  // 128B swizzle
  return desc;
}

// ---------------------------------------------------------------- math
DI_DEVICE float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// PRMT: byte n of the result = byte (sel nibble n & 7) of {hi:lo}; a nibble with bit 3 set gives that byte's
// sign bit replicated (0x00 or 0xff).
DI_DEVICE uint32_t prmt(uint32_t lo, uint32_t hi, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sel));
  return r;
}

// Two floats as bf16x2 (round to nearest even), `lo` in the low half.
DI_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// ---------------------------------------------------------------- warpgroup registers
template <uint32_t kRegs>
DI_DEVICE void reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
DI_DEVICE void reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ---------------------------------------------------------------- named barriers
// NOTES: id 0 is __syncthreads(); kernels number their own barriers from 1.
DI_DEVICE void named_barrier_sync(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}
// Arrive without waiting (the barrier completes when `num_threads` threads synced or arrived).
DI_DEVICE void named_barrier_arrive(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// ---------------------------------------------------------------- pipeline state
// Stage index + parity of a ring of kNumStages buffers guarded by full/empty mbarriers.
template <uint32_t kNumStages>
struct PipelineState {
  uint32_t index = 0;
  uint32_t phase = 0;
  DI_DEVICE void advance() {
    if (++index == kNumStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

// ---------------------------------------------------------------- warp scans
// v plus the v of the lane `off` above (down) or below (up) this one where that lane exists: the
// shuffle's own in-range predicate guards the add (no lane compare, no select).
template <bool kDown>
DI_DEVICE uint32_t add_shifted(uint32_t v, int off) {
  uint32_t r;
  if constexpr (kDown)
    asm("{\n.reg .b32 o;\n.reg .pred p;\nshfl.sync.down.b32 o|p, %1, %2, 0x1f, 0xffffffff;\n"
        "mov.b32 %0, %1;\n@p add.u32 %0, %1, o;\n}" : "=r"(r) : "r"(v), "r"(off));
  else
    asm("{\n.reg .b32 o;\n.reg .pred p;\nshfl.sync.up.b32 o|p, %1, %2, 0x0, 0xffffffff;\n"
        "mov.b32 %0, %1;\n@p add.u32 %0, %1, o;\n}" : "=r"(r) : "r"(v), "r"(off));
  return r;
}

// Inclusive warp scan of `v` from the top lane down: returns the sum over lanes >= this lane.
DI_DEVICE uint32_t warp_suffix_sum(uint32_t v) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) v = add_shifted<true>(v, off);
  return v;
}

// Inclusive warp scan from lane 0 up.
DI_DEVICE uint32_t warp_prefix_sum(uint32_t v) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) v = add_shifted<false>(v, off);
  return v;
}

// ---------------------------------------------------------------- global memory
// The 128-byte line of `p` asked of L2 (no data returned, no register).
DI_DEVICE void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
// The 128-byte line of `p` asked of the SM's L1 (no data returned, no register).
DI_DEVICE void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

DI_DEVICE void st_global_v4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace deep_indexer::ptx
