// topk: exact, deterministic top-k indices of every row of a logits matrix (docs/topk.md).
//
// One CTA per row (grid-stride). Keys: radix::float_key / bf16_key. Radix select of the k-th
// largest key over TopkLayout's digit schedule: pass 0 reads the row from global memory once,
// builds the first histogram and keeps the row's keys in a shared-memory cache (its first
// `cache_vecs` 16-byte vectors; the rest is re-read from global memory, usually L2, by later
// passes). Each later pass histograms the next digit of the keys whose resolved prefix matches;
// passes stop once the k-th bin is taken whole. Selection: key > threshold, plus the first
// (k - count_greater) keys equal to the threshold in column order; every output position is a
// prefix count in column order (no atomics), so the result is unique and run-to-run identical.
#pragma once
#include <cstdint>

#include "radix_select.cuh"
#include "topk_layout.hpp"

// -DDI_TOPK_DEBUG (through DI_JIT_EXTRA_FLAGS): device checks of the selection invariants (the JIT
// builds with -DNDEBUG, so these trap instead of using assert).
#ifdef DI_TOPK_DEBUG
#include <cstdio>
#define DI_TOPK_ASSERT(x)                                                              \
  do {                                                                                 \
    if (!(x)) {                                                                        \
      printf("deep_indexer topk: check failed: %s (line %d)\n", #x, __LINE__);        \
      __trap();                                                                        \
    }                                                                                  \
  } while (0)
#else
#define DI_TOPK_ASSERT(x) ((void)0)
#endif

namespace deep_indexer {


template <int kElemBytes, bool kSorted>
__global__ void __launch_bounds__(TopkLayout::kNumThreads, 2) topk_kernel(const TopkArgs a) {
  constexpr TopkLayout L{kElemBytes, kSorted};
  constexpr int kThreads = TopkLayout::kNumThreads;
  constexpr int kWarps = TopkLayout::kNumWarps;
  constexpr int kVec = L.vec();
  constexpr int kPasses = L.num_passes();
  static_assert(kElemBytes == 4 || kElemBytes == 2, "float32 or bfloat16 logits");
  static_assert(L.digit_shift(kPasses - 1) == 0 && L.digit_bits(0) <= 11, "digit schedule");
  constexpr int kUnroll = 4;  // 16-byte loads in flight per thread in the histogram passes
  constexpr uint32_t kNegInfBits = kElemBytes == 4 ? 0xFF800000u : 0xFF80u;

  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t* hist = reinterpret_cast<uint32_t*>(smem + L.hist_offset());
  uint32_t* warp_sums = reinterpret_cast<uint32_t*>(smem + L.scratch_offset());  // [kWarps]
  uint32_t* warp_sums2 = warp_sums + kWarps;                                     // [kWarps]
  uint32_t* scalars = warp_sums2 + kWarps;                                       // [16]
  unsigned long long* sort_buf = reinterpret_cast<unsigned long long*>(smem + L.sort_offset());
  uint4* cache = reinterpret_cast<uint4*>(smem + L.cache_offset());

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int k = a.k;

  for (int64_t r = blockIdx.x; r < a.num_rows; r += gridDim.x) {
    // ---- the row's valid columns [lo, lo + n)
    const int64_t g = r / a.range_next_n;
    const int64_t i_in = r - g * a.range_next_n;
    const int64_t lo64 = a.ks == nullptr ? 0 : max(static_cast<int64_t>(__ldg(a.ks + g)), int64_t(0));
    const int lo = static_cast<int>(min(lo64, static_cast<int64_t>(a.num_cols)));
    const int64_t hi64 = static_cast<int64_t>(__ldg(a.ke + g)) - a.range_next_n + i_in + 1;
    const int hi = static_cast<int>(min(max(hi64, static_cast<int64_t>(lo)), static_cast<int64_t>(a.num_cols)));
    const int n = hi - lo;
    const int64_t seq = r / a.table_next_n;
    const uint32_t offset = a.row_offset == nullptr ? 0u : static_cast<uint32_t>(__ldg(a.row_offset + r));

    // NOTES: element j of the row sits at lane (j + mis) % kVec of the 16-byte aligned vector
    // (j + mis) / kVec; aligned vectors never cross a page, so the few columns outside [lo, hi)
    // they hold are read (never used) safely.
    const uint8_t* row_bytes = static_cast<const uint8_t*>(a.logits) + (r * a.row_stride + lo) * kElemBytes;
    const int mis = static_cast<int>((reinterpret_cast<uintptr_t>(row_bytes) & 15u) / kElemBytes);
    const uint4* row_vec = reinterpret_cast<const uint4*>(row_bytes - mis * kElemBytes);
    const int num_vecs = n == 0 ? 0 : (mis + n + kVec - 1) / kVec;

    // Keys of vector v: from the cache for v < cached, else from global memory.
    auto load_keys = [&](int v, int cached, uint32_t (&key)[kVec]) {
      if (v < cached) {
        radix::unpack<kElemBytes>(cache[v], key);
      } else {
        radix::unpack<kElemBytes>(__ldg(row_vec + v), key);
#pragma unroll
        for (int c = 0; c < kVec; ++c) key[c] = radix::to_key<kElemBytes>(key[c]);
      }
    };

    // ---- radix select: the threshold `prefix` over the resolved bits `mask`, the number of keys
    // above it (`greater`) and how many keys equal to it to take (`take_eq`).
    uint32_t prefix = 0, mask = 0, greater = 0, take_eq = static_cast<uint32_t>(n);
    int cached = 0;
    if (n > k) {
      cached = min(num_vecs, a.cache_vecs);
      uint32_t k_rem = static_cast<uint32_t>(k);
#pragma unroll 1
      for (int pass = 0; pass < kPasses; ++pass) {
        const int shift = L.digit_shift(pass);
        const uint32_t digit_mask = (1u << L.digit_bits(pass)) - 1u;
        for (int b = tid; b < TopkLayout::kHistBins; b += kThreads) hist[b] = 0;
        __syncthreads();
        // Warp-uniform trip counts (warp_hist_add needs all lanes); kUnroll independent 16-byte
        // loads in flight per thread before any of them is used.
        for (int vb = warp * 32 * kUnroll; vb < num_vecs; vb += kThreads * kUnroll) {
          uint4 raw[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int v = vb + u * 32 + lane;
            raw[u] = make_uint4(0u, 0u, 0u, 0u);
            if (v < num_vecs) raw[u] = pass > 0 && v < cached ? cache[v] : __ldg(row_vec + v);
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int v = vb + u * 32 + lane;
            uint32_t key[kVec];
            radix::unpack<kElemBytes>(raw[u], key);
            if (pass == 0 || v >= cached) {
#pragma unroll
              for (int c = 0; c < kVec; ++c) key[c] = radix::to_key<kElemBytes>(key[c]);
              if (pass == 0 && v < cached) cache[v] = radix::pack<kElemBytes>(key);
            }
#pragma unroll
            for (int c = 0; c < kVec; ++c) {
              const int j = v * kVec + c - mis;
              const bool active = v < num_vecs && j >= 0 && j < n && (key[c] & mask) == prefix;
              radix::warp_hist_add(hist, (key[c] >> shift) & digit_mask, active);
            }
          }
        }
        const radix::KthBin kb = radix::find_kth_bin<kThreads, TopkLayout::kHistBins>(hist, k_rem, warp_sums, scalars);
        prefix |= kb.bin << shift;
        mask |= digit_mask << shift;
        greater += kb.above;
        k_rem -= kb.above;
        take_eq = k_rem;
        if (k_rem == kb.count) break;  // the whole bin is taken: lower digits cannot matter
      }
    }
    const uint32_t total = min(greater + take_eq, static_cast<uint32_t>(k));  // = min(k, n)
    DI_TOPK_ASSERT(greater + take_eq == static_cast<uint32_t>(min(k, n)));

    // ---- selection in column order. Each warp owns a contiguous run of vectors; pass A counts,
    // pass B writes at prefix-count positions.
    const int per_warp = (num_vecs + kWarps - 1) / kWarps;
    const int wv0 = min(warp * per_warp, num_vecs), wv1 = min(wv0 + per_warp, num_vecs);
    auto classify = [&](int v, uint32_t (&gt)[kVec], uint32_t (&eq)[kVec]) {
      uint32_t key[kVec] = {};
      if (v < wv1) load_keys(v, cached, key);
#pragma unroll
      for (int c = 0; c < kVec; ++c) {
        const int j = v * kVec + c - mis;
        const bool valid = v < wv1 && j >= 0 && j < n;
        const uint32_t mk = key[c] & mask;
        gt[c] = valid && mk > prefix;
        eq[c] = valid && mk == prefix;
      }
    };
    uint32_t w_gt = 0, w_eq = 0;
    for (int vb = wv0; vb < wv1; vb += 32) {
      uint32_t gt[kVec], eq[kVec];
      classify(vb + lane, gt, eq);
#pragma unroll
      for (int c = 0; c < kVec; ++c) w_gt += gt[c], w_eq += eq[c];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      w_gt += __shfl_xor_sync(radix::kFullMask, w_gt, off);
      w_eq += __shfl_xor_sync(radix::kFullMask, w_eq, off);
    }
    if (lane == 0) warp_sums[warp] = w_gt, warp_sums2[warp] = w_eq;
    __syncthreads();
    uint32_t gt_base = 0, eq_base = 0;  // keys before this warp's run
    for (int w = 0; w < warp; ++w) gt_base += warp_sums[w], eq_base += warp_sums2[w];
#ifdef DI_TOPK_DEBUG
    if (warp == kWarps - 1 && lane == 0)
      DI_TOPK_ASSERT(gt_base + warp_sums[warp] == greater && eq_base + warp_sums2[warp] >= take_eq);
#endif

    // Writes column j (relative to lo) as output entry `pos` in the requested index convention.
    auto store = [&](int pos, int j) {
      int idx = j;
      if (a.index_mode == static_cast<int>(TopkIndexMode::kAbsolute)) {
        idx = lo + j;
      } else if (a.index_mode == static_cast<int>(TopkIndexMode::kSlot)) {
        const int blk = j / a.block_size;
        idx = blk < a.table_cols
                  ? __ldg(a.block_table + seq * a.table_stride + blk) * a.block_size + (j - blk * a.block_size)
                  : -1;
      }
      if (idx != -1) idx = static_cast<int>(static_cast<uint32_t>(idx) + offset);
      a.out[r * a.out_stride + pos] = idx;
      if (a.out_values != nullptr) {
        const int64_t src = r * a.row_stride + lo + j;
        if constexpr (kElemBytes == 4)
          static_cast<uint32_t*>(a.out_values)[r * a.values_stride + pos] =
              __ldg(static_cast<const uint32_t*>(a.logits) + src);
        else
          static_cast<uint16_t*>(a.out_values)[r * a.values_stride + pos] =
              __ldg(static_cast<const uint16_t*>(a.logits) + src);
      }
    };
    auto emit = [&](uint32_t pos, int j, uint32_t key) {
      DI_TOPK_ASSERT(pos < static_cast<uint32_t>(k));
      if (pos >= static_cast<uint32_t>(k)) return;  // unreachable; never writes out of bounds
      if constexpr (kSorted)
        sort_buf[pos] = (static_cast<unsigned long long>(key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
      else
        store(static_cast<int>(pos), j);
    };

    for (int vb = wv0; vb < wv1; vb += 32) {
      const int v = vb + lane;
      uint32_t gt[kVec], eq[kVec];
      classify(v, gt, eq);
      uint32_t my_gt = 0, my_eq = 0;
#pragma unroll
      for (int c = 0; c < kVec; ++c) my_gt += gt[c], my_eq += eq[c];
      // counts fit 16 bits: a strip holds 32 * kVec <= 256 keys
      const uint32_t packed = radix::warp_prefix_sum(my_gt | (my_eq << 16));
      const uint32_t strip = __shfl_sync(radix::kFullMask, packed, 31);
      uint32_t g_before = gt_base + (packed & 0xFFFFu) - my_gt;
      uint32_t e_before = eq_base + (packed >> 16) - my_eq;
      if (my_gt + my_eq != 0) {
        uint32_t key[kVec];
        load_keys(v, cached, key);
#pragma unroll
        for (int c = 0; c < kVec; ++c) {
          if (gt[c] || (eq[c] && e_before < take_eq)) emit(g_before + min(e_before, take_eq), v * kVec + c - mis, key[c]);
          g_before += gt[c];
          e_before += eq[c];
        }
      }
      gt_base += strip & 0xFFFFu;
      eq_base += strip >> 16;
    }

    if constexpr (kSorted) {
      // Bitonic sort (descending) of the composite keys: key, then smaller column first.
      __syncthreads();
      int size = 1;
      while (size < static_cast<int>(total)) size <<= 1;
      for (int p = static_cast<int>(total) + tid; p < size; p += kThreads) sort_buf[p] = 0ull;  // below every entry
      __syncthreads();
      for (int span = 2; span <= size; span <<= 1) {
        for (int stride = span >> 1; stride > 0; stride >>= 1) {
          for (int t = tid; t < size / 2; t += kThreads) {
            const int lo_i = 2 * t - (t & (stride - 1));
            const int hi_i = lo_i + stride;
            const bool desc = (lo_i & span) == 0;
            const unsigned long long x = sort_buf[lo_i], y = sort_buf[hi_i];
            if ((x < y) == desc) sort_buf[lo_i] = y, sort_buf[hi_i] = x;
          }
          __syncthreads();
        }
      }
      for (int p = tid; p < static_cast<int>(total); p += kThreads) {
        store(p, static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(sort_buf[p] & 0xFFFFFFFFull)));
      }
    }

    // ---- padding
    for (int p = static_cast<int>(total) + tid; p < k; p += kThreads) {
      a.out[r * a.out_stride + p] = -1;
      if (a.out_values != nullptr) {
        if constexpr (kElemBytes == 4)
          static_cast<uint32_t*>(a.out_values)[r * a.values_stride + p] = kNegInfBits;
        else
          static_cast<uint16_t*>(a.out_values)[r * a.values_stride + p] = static_cast<uint16_t>(kNegInfBits);
      }
    }
    __syncthreads();  // smem (hist, cache, sort buffer, scalars) is reused by the next row
  }
}

}  // namespace deep_indexer
