// Schedule for the decode kernel (get_paged_mqa_logits_metadata).
//
// Contract (bit-exact with the CPU reference):
//   len_b  = max(0, context_lens[b])               (1-D, kNextN == 1)
//          = max(0, max_i context_lens[b, i])       (2-D [B, kNextN], contiguous rows)
//   segs_b = ceil(len_b / 256) (PagedMqaLogitsLayout::kSplitKV);  P[0] = 0, P[b+1] = P[b] + segs_b;  T = P[B]
//   for i in 0..num_sms: start_i = i * (T / num_sms) + min(i, T % num_sms)
//     schedule[i] = (B, 0)                if start_i == T
//                 = (b, start_i - P[b])   for the b with P[b] <= start_i < P[b+1]
//   Output: int32 [num_sms + 1][2].
//
// Launch: grid 1, block kNumThreads, no dynamic shared memory. Any batch size with kMultiChunk (chunks
// of kNumThreads * 4 sequences with a block-wide scan), else at most kNumThreads * 4. No host synchronization; graph-capturable.
// Assumes T < 2^31 (i.e. the total number of 256-token segments fits in int32).
// Triggers its dependents right after its own griddepcontrol.wait (a no-op unless the next kernel is
// launched with programmatic stream serialization; that kernel's griddepcontrol.wait still waits for
// this grid to complete and flush).
#pragma once
#include <cstdint>

#include <deep_indexer/logits/paged_mqa_logits_layout.hpp>
#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/common/trace.cuh>

namespace deep_indexer {

namespace paged_mqa_metadata_detail {

template <int kNextN>
__device__ __forceinline__ uint32_t segments_of(const int* __restrict__ context_lens, int b) {
  int len = __ldg(context_lens + static_cast<int64_t>(b) * kNextN);
#pragma unroll
  for (int i = 1; i < kNextN; ++i) len = max(len, __ldg(context_lens + static_cast<int64_t>(b) * kNextN + i));
  return static_cast<uint32_t>(PagedMqaLogitsLayout::num_segments(max(len, 0)));
}

// start_i of the contract.
__device__ __forceinline__ uint32_t split_start(uint32_t i, uint32_t q, uint32_t r) { return i * q + min(i, r); }

// Smallest i with start_i >= x (x <= T).
__device__ __forceinline__ uint32_t first_split_at_or_after(uint32_t x, uint32_t q, uint32_t r) {
  const uint32_t head = r * (q + 1);  // start_r
  if (x <= head) return (x + q) / (q + 1);
  return r + (x - head + q - 1) / q;  // q > 0 here: head < x <= T = num_sms * q + r
}

}  // namespace paged_mqa_metadata_detail

// kMultiChunk = false: batch_size <= kNumThreads * 4 (one chunk; the host picks this compact
// variant for small batches: less code on the critical path, whose instruction fetches dominate).
template <int kNextN /* row width of context_lens: 1 for [B] */, int kNumThreads /* e.g. 1024 */, bool kMultiChunk>
__global__ void __launch_bounds__(kNumThreads, 1)
    paged_mqa_metadata_kernel(const int* __restrict__ context_lens, int batch_size, int num_sms,
                              int* __restrict__ schedule /* [num_sms + 1][2] */) {
  using namespace paged_mqa_metadata_detail;
  static_assert(kNumThreads % 32 == 0 && kNumThreads >= 64 && kNumThreads <= 1024, "bad block size");
  static_assert(kNextN >= 1, "bad row width");
  constexpr int kItems = 4;  // consecutive sequences per thread
  constexpr int kChunk = kNumThreads * kItems;
  constexpr int kNumWarps = kNumThreads / 32;
  if (!kMultiChunk && batch_size > kChunk) __trap();  // host contract

  __shared__ uint32_t s_warp[kNumWarps];
  __shared__ uint32_t s_total;
  __shared__ uint32_t s_prefix[kChunk];  // P[base + j] of the current chunk

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;

  Tracer tr;
  tr.start();
  ptx::grid_dependency_wait();
  // NOTES: the logits kernel may launch at once and start up beside this one; it reads the schedule only after
  // its own griddepcontrol.wait, which waits for this grid to complete and flush.
  ptx::launch_dependents();

  // Exclusive block scan of one value per thread; returns the prefix, *total = block sum.
  // Ends with the shared scratch free for reuse (trailing barrier).
  auto block_exclusive_scan = [&](uint32_t x, uint32_t* total) -> uint32_t {
    uint32_t incl = x;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const uint32_t w = lane < kNumWarps ? s_warp[lane] : 0u;
      uint32_t wi = w;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, wi, d);
        if (lane >= d) wi += y;
      }
      if (lane < kNumWarps) s_warp[lane] = wi - w;
      if (lane == 31) s_total = wi;
    }
    __syncthreads();
    const uint32_t res = s_warp[warp] + incl - x;
    *total = s_total;
    __syncthreads();
    return res;
  };

  // ---- pass 1: segment counts of the first chunk stay in registers; T over all sequences
  uint32_t segs[kItems];
  uint32_t local = 0;
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int b = tid * kItems + k;
    segs[k] = b < batch_size ? segments_of<kNextN>(context_lens, b) : 0u;
    local += segs[k];
  }
  tr.mark<0>(static_cast<int>(local));
  uint32_t chunk_total = 0;
  const uint32_t excl0 = block_exclusive_scan(local, &chunk_total);
  tr.mark<1>();
  uint32_t total = chunk_total;
  if (kMultiChunk && batch_size > kChunk) {  // block-uniform
    uint32_t rest = 0;
    for (int b = kChunk + tid; b < batch_size; b += kNumThreads) rest += segments_of<kNextN>(context_lens, b);
    uint32_t rest_total = 0;
    (void)block_exclusive_scan(rest, &rest_total);
    total += rest_total;
  }

  const uint32_t n = static_cast<uint32_t>(num_sms);
  const uint32_t q = total / n;
  const uint32_t r = total % n;
  tr.mark<2>(static_cast<int>(q + r));

  // ---- pass 2: the prefix sums go to shared memory and every split finds its sequence by binary
  // search (one thread per split: no serial walk over the many splits of a long sequence). The
  // answer is the last j with P[j] <= start, which has segments since P[j + 1] > start.
  // This thread's prefix sums P[base + tid * kItems + k], starting from p, then a barrier.
  auto store_prefix = [&](uint32_t p) {
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      s_prefix[tid * kItems + k] = p;
      p += segs[k];
    }
    __syncthreads();
    tr.mark<3>();
  };
  if constexpr (!kMultiChunk) {
    // One chunk: a split starts either inside it or at T (an empty tail: (B, 0)).
    store_prefix(excl0);
    for (uint32_t i = static_cast<uint32_t>(tid); i <= n; i += kNumThreads) {
      const uint32_t start = split_start(i, q, r);
      int b = batch_size, off = 0;
      if (start < total) {
        int lo = 0, hi = batch_size;  // P[lo] <= start < P[hi]
        while (hi - lo > 1) {
          const int mid = (lo + hi) >> 1;
          if (s_prefix[mid] <= start) lo = mid; else hi = mid;
        }
        b = lo;
        off = static_cast<int>(start - s_prefix[lo]);
      }
      schedule[2 * i] = b;
      schedule[2 * i + 1] = off;
    }
    tr.mark<4>();
  } else {
    // Per chunk: the splits starting inside it.
    uint32_t carry = 0;
    for (int base = 0; base < batch_size; base += kChunk) {  // block-uniform trip count
      uint32_t excl;
      if (base == 0) {
        excl = excl0;
      } else {
        local = 0;
#pragma unroll
        for (int k = 0; k < kItems; ++k) {
          const int b = base + tid * kItems + k;
          segs[k] = b < batch_size ? segments_of<kNextN>(context_lens, b) : 0u;
          local += segs[k];
        }
        excl = block_exclusive_scan(local, &chunk_total);
      }
      store_prefix(carry + excl);
      const int m = min(kChunk, batch_size - base);
      const uint32_t i_end = first_split_at_or_after(carry + chunk_total, q, r);
      for (uint32_t i = first_split_at_or_after(carry, q, r) + static_cast<uint32_t>(tid); i < i_end; i += kNumThreads) {
        const uint32_t start = split_start(i, q, r);
        int lo = 0, hi = m;  // P[lo] <= start < P[hi] (P[m] = end of the chunk)
        while (hi - lo > 1) {
          const int mid = (lo + hi) >> 1;
          if (s_prefix[mid] <= start) lo = mid; else hi = mid;
        }
        schedule[2 * i] = base + lo;
        schedule[2 * i + 1] = static_cast<int>(start - s_prefix[lo]);
      }
      tr.mark<4>();
      __syncthreads();  // s_prefix is rewritten by the next chunk
      carry += chunk_total;
    }
    tr.mark<5>();

    // ---- splits that start at T (empty tails): (B, 0)
    for (uint32_t i = first_split_at_or_after(total, q, r) + static_cast<uint32_t>(tid); i <= n; i += kNumThreads) {
      schedule[2 * i] = batch_size;
      schedule[2 * i + 1] = 0;
    }
  }

  tr.mark<6>();
  if (tid == 0) tr.print("meta", 0, batch_size);
}

}  // namespace deep_indexer
