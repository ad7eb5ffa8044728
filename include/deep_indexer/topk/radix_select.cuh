// Radix-select primitives shared by the top-k kernels: order-preserving keys and the block-wide search
// of the bin that holds the k-th largest key (the warp scans they use are in common/ptx.cuh).
#pragma once
#include <cstdint>

#include <deep_indexer/common/ptx.cuh>

namespace deep_indexer::radix {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

// NOTES: order-preserving unsigned keys. A larger key is a larger value: 0x80000000 + bits for a
// positive float, 0x80000000 - |bits| for a negative one (so -0.0 and +0.0 share 0x80000000); every
// NaN gets key 0, below -inf (whose key is 0x00800000 / 0x0080). Three integer instructions and a
// NaN test per key.
__device__ __forceinline__ uint32_t float_key(uint32_t b) {
  const uint32_t s = static_cast<uint32_t>(static_cast<int32_t>(b) >> 31);  // all ones when negative
  const uint32_t k = (b ^ (s | 0x80000000u)) - s;  // negative: ~b + 1 = 0x80000000 - |bits|
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? 0u : k;
}
__device__ __forceinline__ uint32_t bf16_key(uint32_t b) {  // b: the 16 bits of a bfloat16
  return float_key(b << 16) >> 16;  // the bfloat16 widened to float32 exactly: the same order
}

// Two bfloat16 keys at once: each 16-bit half of the result is bf16_key of the same half of `w`. prmt's
// sign mode spreads each half's top bit over the half (0xFFFF per negative half, and per half whose
// magnitude is above 0x7F80: NaN); a negative half becomes (bits ^ 0xFFFF) + 1 = 0x8000 - |bits|, a
// positive one bits ^ 0x8000. No carry crosses the halves: every half of a sum stays <= 0x8000.
__device__ __forceinline__ uint32_t bf16_key_pair(uint32_t w) {
  uint32_t neg, nan;
  asm("prmt.b32 %0, %1, 0, 0xBB99;" : "=r"(neg) : "r"(w));
  asm("prmt.b32 %0, %1, 0, 0xBB99;" : "=r"(nan) : "r"((w & 0x7FFF7FFFu) + 0x007F007Fu));
  return ((w ^ (neg | 0x80008000u)) + (neg & 0x00010001u)) & ~nan;
}

// Unpacks one 16-byte vector into kVec = 16 / kElemBytes lanes of 32 or 16 bits.
template <int kElemBytes>
__device__ __forceinline__ void unpack(const uint4& v, uint32_t (&e)[16 / kElemBytes]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kElemBytes == 4) {
      e[i] = w[i];
    } else {
      e[2 * i] = w[i] & 0xFFFFu;
      e[2 * i + 1] = w[i] >> 16;
    }
  }
}
template <int kElemBytes>
__device__ __forceinline__ uint4 pack(const uint32_t (&e)[16 / kElemBytes]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = kElemBytes == 4 ? e[i] : (e[2 * i] | (e[2 * i + 1] << 16));
  return make_uint4(w[0], w[1], w[2], w[3]);
}
template <int kElemBytes>
__device__ __forceinline__ uint32_t to_key(uint32_t raw) {
  return kElemBytes == 4 ? float_key(raw) : bf16_key(raw);
}

// The raw bits of element c (a compile-time constant after unrolling) of a 16-byte vector.
template <int kElemBytes>
__device__ __forceinline__ uint32_t raw_at(const uint4& v, int c) {
  const uint32_t w = c < 4 / kElemBytes * 1   ? v.x
                     : c < 4 / kElemBytes * 2 ? v.y
                     : c < 4 / kElemBytes * 3 ? v.z
                                              : v.w;
  if constexpr (kElemBytes == 4) return w;
  else return (c & 1) ? (w >> 16) : (w & 0xFFFFu);
}

// Sum of `v` over the warps below this one (w < warp), once every warp's lane 0 (or any one lane) has
// written its total to warp_sums[w] and the block has synchronised; `total` gets every warp's sum. One
// load and a shuffle scan, no loop.
template <int kWarps>
__device__ __forceinline__ uint32_t sum_of_warps_below(const uint32_t* warp_sums, uint32_t& total) {
  static_assert(kWarps <= 32, "one warp sum per lane");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t s = lane < kWarps ? warp_sums[lane] : 0u;
  const uint32_t incl = ptx::warp_prefix_sum(s);  // lanes <= l
  total = __shfl_sync(kFullMask, incl, 31);
  return __shfl_sync(kFullMask, incl - s, warp);
}

struct KthBin {
  uint32_t bin;    // the bin holding the k-th largest key
  uint32_t above;  // keys in higher bins
  uint32_t count;  // keys in that bin
};

// Block-wide: the bin b of [0, kBins) with above(b) < k <= above(b) + count(b), where above(b)
// = sum of count over bins > b and count(b) is `bin_count(b)` (e.g. a shared-memory histogram,
// or the sum of a cluster's histograms; read twice for the bins of the thread holding the k-th key's bin,
// the same both times). Requires 1 <= k <= the sum of all counts. `warp_sums`
// holds kNumThreads / 32 words; `result` 3 words. Starts (unless kSyncFirst is false: the caller
// synchronised since the counts were written) and ends with __syncthreads(); every thread returns
// the same answer.
// NOTES: each warp finds from the warps' totals which warp holds the k-th key's bin; only that warp
// scans its lanes' counts.
template <int kNumThreads, int kBins, bool kSyncFirst = true, typename BinCount>
__device__ __forceinline__ KthBin find_kth_bin(BinCount bin_count, uint32_t k, uint32_t* warp_sums,
                                               uint32_t* result) {
  static_assert(kBins % kNumThreads == 0, "whole bins per thread");
  constexpr int kPer = kBins / kNumThreads;
  constexpr int kWarps = kNumThreads / 32;
  static_assert(kWarps <= 32, "one warp total per lane");
  if constexpr (kSyncFirst) __syncthreads();
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  uint32_t own = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) own += bin_count(t * kPer + i);
  const uint32_t warp_total = __reduce_add_sync(kFullMask, own);
  if (lane == 0) warp_sums[warp] = warp_total;
  __syncthreads();
  // lane l: the keys in warps >= l (lanes >= kWarps hold none, so log2(kWarps) steps cover them)
  uint32_t from_warp = lane < kWarps ? warp_sums[lane] : 0u;
  const uint32_t warp_total_l = from_warp;
#pragma unroll
  for (int off = 1; off < kWarps; off <<= 1) from_warp = ptx::add_shifted<true>(from_warp, off);
  // those sums fall with the lane: the warp holding the k-th key is the last lane whose sum reaches k
  const int holder = 31 - __clz(__ballot_sync(kFullMask, from_warp >= k));
  if (warp == holder) {
    uint32_t above = __shfl_sync(kFullMask, from_warp - warp_total_l, holder);  // keys in warps above
    const uint32_t incl = ptx::warp_suffix_sum(own);
    above += incl - own;
    if (above < k && k <= above + own) {  // one thread: the k-th key's bin is one of its own
      // NOTES: bins in rising order: `below` falls to the keys above bin i, and the first bin it leaves under
      // k holds the k-th key (scanned downward instead, the 24-key float32 two-CTA form spills a register)
      uint32_t below = above + own;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const uint32_t c = bin_count(t * kPer + i);  // read again: no registers held over the scans
        below -= c;
        if (k > below) {
          result[0] = t * kPer + i;
          result[1] = below;
          result[2] = c;
          break;
        }
      }
    }
  }
  __syncthreads();
  return {result[0], result[1], result[2]};
}

// find_kth_bin over 32 bins (a 5-bit digit), searched by warp 0 alone: one load and one warp scan instead
// of a block-wide search. The same barriers (kSyncFirst as there) and answer; `result` holds 3 words.
template <bool kSyncFirst = true, typename BinCount>
__device__ __forceinline__ KthBin find_kth_bin_warp0(BinCount bin_count, uint32_t k, uint32_t* result) {
  if constexpr (kSyncFirst) __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const uint32_t c = bin_count(lane);
    const uint32_t incl = ptx::warp_suffix_sum(c);  // keys in bins >= lane
    if (incl - c < k && k <= incl) {  // one lane: bins are counted in order
      result[0] = static_cast<uint32_t>(lane);
      result[1] = incl - c;
      result[2] = c;
    }
  }
  __syncthreads();
  return {result[0], result[1], result[2]};
}

}  // namespace deep_indexer::radix
