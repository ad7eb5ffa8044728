// topk: exact, deterministic top-k indices of every row of a logits matrix (docs/topk.md).
//
// One cluster of C CTAs per row (C = 1 by default; 2 to 8 when forced, see heuristics_sm90.hpp),
// grid-stride over rows. CTA q of the cluster owns a contiguous run of the row's 16-byte vectors,
// warp w of the CTA a contiguous part of that run. Keys: radix::float_key / bf16_key. Radix select
// of the k-th largest key over TopkLayout's digit schedule: pass 0 reads the CTA's run from global
// memory once, builds the first histogram (plain shared atomics) and keeps the keys in a
// shared-memory cache (its first `cache_vecs` vectors; the rest is re-read from global memory,
// usually L2). Then each warp lists its keys whose first digit is >= the k-th key's (column order);
// later passes histogram the next digit over the lists only and stop once the k-th bin is taken
// whole; when a list overflows, the CTA re-scans its run instead (same result). With C > 1 every
// CTA sums the cluster's histograms through distributed shared memory and runs the same search, so
// all CTAs agree on the threshold. Selection: key > threshold, plus the first (k - count_greater)
// keys equal to the threshold in column order; every output position is a prefix count in column
// order (over CTAs, warps, lanes; no atomics), so the result is unique and run-to-run identical.
#pragma once
#include <cooperative_groups.h>

#include <cstdint>
#include <type_traits>

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
__global__ void __launch_bounds__(TopkLayout::kNumThreads, TopkLayout::ctas_per_sm_max(kSorted)) topk_kernel(const TopkArgs a) {
  namespace cg = cooperative_groups;
  constexpr TopkLayout L{kElemBytes, kSorted};
  constexpr int kThreads = TopkLayout::kNumThreads;
  constexpr int kWarps = TopkLayout::kNumWarps;
  constexpr int kVec = L.vec();
  constexpr int kPasses = L.num_passes();
  // 16-byte loads in flight per thread in the histogram passes (fewer where 64 registers must do)
  constexpr int kUnroll = kSorted || kElemBytes == 4 ? 4 : 2;
  static_assert(kElemBytes == 4 || kElemBytes == 2, "float32 or bfloat16 logits");
  static_assert(L.digit_shift(kPasses - 1) == 0 && L.digit_bits(0) <= 11, "digit schedule");
  constexpr uint32_t kNegInfBits = kElemBytes == 4 ? 0xFF800000u : 0xFF80u;

  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t* hist = reinterpret_cast<uint32_t*>(smem + L.hist_offset());
  uint32_t* warp_sums = reinterpret_cast<uint32_t*>(smem + L.scratch_offset());  // [kWarps]
  uint32_t* warp_sums2 = warp_sums + kWarps;                                     // [kWarps]
  // [0, 3): find_kth_bin; [4, 6): this CTA's gt/eq counts; [6]: a candidate list overflowed
  uint32_t* scalars = warp_sums2 + kWarps;
  uint32_t* cta_counts = scalars + 4;
  uint32_t* overflow = scalars + 6;
  unsigned long long* sort_buf = reinterpret_cast<unsigned long long*>(smem + L.sort_offset());
  const int cand_cap = a.cand_per_warp;
  uint4* cache = reinterpret_cast<uint4*>(smem + L.cache_offset(cand_cap));
  using KeyWord = std::conditional_t<kElemBytes == 4, uint32_t, uint16_t>;
  const KeyWord* cache_words = reinterpret_cast<const KeyWord*>(cache);

  cg::cluster_group cluster = cg::this_cluster();
  const int num_ctas = static_cast<int>(cluster.num_blocks());  // C
  const int rank = static_cast<int>(cluster.block_rank());
  // Block barrier, or cluster barrier (release/acquire of shared memory) when C > 1.
  auto row_sync = [&]() {
    if (num_ctas > 1) cluster.sync();
    else __syncthreads();
  };
  // The sort buffer of the cluster lives in CTA 0.
  unsigned long long* sort_dst = kSorted ? cluster.map_shared_rank(sort_buf, 0) : sort_buf;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t lanes_below = (1u << lane) - 1u;
  // This warp's candidate list: element indices (column + mis), in column order.
  uint32_t* my_cand = reinterpret_cast<uint32_t*>(smem + L.cand_offset()) + warp * cand_cap;
  const int k = a.k;
  const int64_t num_clusters = gridDim.x / num_ctas;

  for (int64_t r = blockIdx.x / num_ctas; r < a.num_rows; r += num_clusters) {
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
    const KeyWord* row_words = reinterpret_cast<const KeyWord*>(row_vec);
    const int num_vecs = n == 0 ? 0 : (mis + n + kVec - 1) / kVec;
    // This CTA's run of vectors [v_begin, v_end); warp w owns the contiguous part [wv0, wv1).
    const int per_cta = (num_vecs + num_ctas - 1) / num_ctas;
    const int v_begin = min(rank * per_cta, num_vecs), v_end = min(v_begin + per_cta, num_vecs);
    const int per_warp = (v_end - v_begin + kWarps - 1) / kWarps;
    const int wv0 = min(v_begin + warp * per_warp, v_end), wv1 = min(wv0 + per_warp, v_end);

    // Keys of vector v: from the cache for v < v_cached, else from global memory.
    int v_cached = v_begin;
    auto load_keys = [&](int v, uint32_t (&key)[kVec]) {
      if (v < v_cached) {
        radix::unpack<kElemBytes>(cache[v - v_begin], key);
      } else {
        radix::unpack<kElemBytes>(__ldg(row_vec + v), key);
#pragma unroll
        for (int c = 0; c < kVec; ++c) key[c] = radix::to_key<kElemBytes>(key[c]);
      }
    };
    // The key of element e = v * kVec + c (a candidate list entry).
    auto key_at = [&](uint32_t e) -> uint32_t {
      const int v = static_cast<int>(e / kVec);
      if (v < v_cached) return cache_words[e - static_cast<uint32_t>(v_begin) * kVec];
      return radix::to_key<kElemBytes>(__ldg(row_words + e));
    };

    // ---- radix select: the threshold `prefix` over the resolved bits `mask`, the number of keys
    // above it (`greater`) and how many keys equal to it to take (`take_eq`). Same in every CTA.
    uint32_t prefix = 0, mask = 0, greater = 0, take_eq = static_cast<uint32_t>(n);
    // NOTES: after pass 0, each warp lists (in column order) its keys whose first digit is >= the
    // k-th key's: at most k - 1 keys above that bin plus the bin itself. Later passes and the
    // selection read only these lists. `use_lists` is false when a list of this CTA overflowed
    // (low-contrast or clustered rows): then they re-scan the CTA's whole run (same results).
    bool use_lists = false;
    uint32_t cand_n = 0;  // entries of this warp's list (warp-uniform)
    if (n > k) {
      v_cached = v_begin + min(v_end - v_begin, a.cache_vecs);
      uint32_t k_rem = static_cast<uint32_t>(k);
      bool done = false;
#pragma unroll 1
      for (int pass = 0; pass < kPasses && !done; ++pass) {
        const int shift = L.digit_shift(pass);
        const uint32_t digit_mask = (1u << L.digit_bits(pass)) - 1u;
        row_sync();  // the cluster has finished reading this CTA's previous histogram
        for (int b = tid; b < TopkLayout::kHistBins; b += kThreads) hist[b] = 0;
        if (tid == 0) *overflow = 0;
        __syncthreads();
        if (use_lists) {
          for (uint32_t i = lane; i < cand_n; i += 32) {
            const uint32_t key = key_at(my_cand[i]);
            if ((key & mask) == prefix) atomicAdd(hist + ((key >> shift) & digit_mask), 1u);
          }
        } else {
          // Warp-uniform trip counts; kUnroll independent 16-byte loads in flight per thread
          // before any of them is used.
          for (int vb = v_begin + warp * 32 * kUnroll; vb < v_end; vb += kThreads * kUnroll) {
            uint4 raw[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int v = vb + u * 32 + lane;
              raw[u] = make_uint4(0u, 0u, 0u, 0u);
              if (v < v_end) raw[u] = pass > 0 && v < v_cached ? cache[v - v_begin] : __ldg(row_vec + v);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int v = vb + u * 32 + lane;
              uint32_t key[kVec];
              radix::unpack<kElemBytes>(raw[u], key);
              if (pass == 0 || v >= v_cached) {
#pragma unroll
                for (int c = 0; c < kVec; ++c) key[c] = radix::to_key<kElemBytes>(key[c]);
                if (pass == 0 && v < v_cached) cache[v - v_begin] = radix::pack<kElemBytes>(key);
              }
#pragma unroll
              for (int c = 0; c < kVec; ++c) {
                const int j = v * kVec + c - mis;
                const bool active = v < v_end && j >= 0 && j < n && (key[c] & mask) == prefix;
#ifdef DI_TOPK_MATCH_HIST
                radix::warp_hist_add(hist, (key[c] >> shift) & digit_mask, active);
#else
                if (active) atomicAdd(hist + ((key[c] >> shift) & digit_mask), 1u);
#endif
              }
            }
          }
        }
        radix::KthBin kb;
        if (num_ctas > 1) {
          cluster.sync();  // every CTA's histogram is complete
          kb = radix::find_kth_bin<kThreads, TopkLayout::kHistBins>(
              [&](int b) {
                uint32_t sum = 0;
                for (int q = 0; q < num_ctas; ++q) sum += cluster.map_shared_rank(hist, q)[b];
                return sum;
              },
              k_rem, warp_sums, scalars);
        } else {
          kb = radix::find_kth_bin<kThreads, TopkLayout::kHistBins>([&](int b) { return hist[b]; }, k_rem, warp_sums,
                                                                    scalars);
        }
        prefix |= kb.bin << shift;
        mask |= digit_mask << shift;
        greater += kb.above;
        k_rem -= kb.above;
        take_eq = k_rem;
        done = k_rem == kb.count;  // the whole bin is taken: lower digits cannot matter

        if (pass == 0 && cand_cap > 0) {
          // The lists: keys (valid) with (key & mask) >= prefix, in column order.
          for (int vb = wv0; vb < wv1; vb += 32) {
            const int v = vb + lane;
            uint32_t key[kVec] = {};
            if (v < wv1) load_keys(v, key);
            uint32_t sel = 0;
#pragma unroll
            for (int c = 0; c < kVec; ++c) {
              const int j = v * kVec + c - mis;
              sel |= static_cast<uint32_t>(v < wv1 && j >= 0 && j < n && (key[c] & mask) >= prefix) << c;
            }
            const uint32_t my = __popc(sel);
            const uint32_t incl = radix::warp_prefix_sum(my);
            uint32_t pos = cand_n + incl - my;
            cand_n += __shfl_sync(radix::kFullMask, incl, 31);
#pragma unroll
            for (int c = 0; c < kVec; ++c) {
              if ((sel >> c) & 1u) {
                if (pos < static_cast<uint32_t>(cand_cap)) my_cand[pos] = static_cast<uint32_t>(v * kVec + c);
                ++pos;
              }
            }
          }
          if (lane == 0 && cand_n > static_cast<uint32_t>(cand_cap)) atomicOr(overflow, 1u);
          __syncthreads();
          use_lists = *overflow == 0u;
        }
      }
    }
    DI_TOPK_ASSERT(greater + take_eq == static_cast<uint32_t>(min(k, n)));
    const uint32_t total = min(greater + take_eq, static_cast<uint32_t>(k));  // = min(k, n)

    // ---- selection in column order: pass A counts (warps, then CTAs), pass B writes at
    // prefix-count positions. From the candidate lists, or by a scan of the warp's part.
    // Bit c of gt / eq: key c of vector v is above / equal to the threshold (and valid).
    auto classify = [&](int v, uint32_t (&key)[kVec], uint32_t& gt, uint32_t& eq) {
#pragma unroll
      for (int c = 0; c < kVec; ++c) key[c] = 0;
      if (v < wv1) load_keys(v, key);
      gt = eq = 0;
#pragma unroll
      for (int c = 0; c < kVec; ++c) {
        const int j = v * kVec + c - mis;
        const bool valid = v < wv1 && j >= 0 && j < n;
        const uint32_t mk = key[c] & mask;
        gt |= static_cast<uint32_t>(valid && mk > prefix) << c;
        eq |= static_cast<uint32_t>(valid && mk == prefix) << c;
      }
    };
    uint32_t w_gt = 0, w_eq = 0;
    if (use_lists) {
      for (uint32_t i = lane; i < cand_n; i += 32) {
        const uint32_t mk = key_at(my_cand[i]) & mask;
        w_gt += mk > prefix;
        w_eq += mk == prefix;
      }
    } else {
      for (int vb = wv0; vb < wv1; vb += 32) {
        uint32_t key[kVec], gt, eq;
        classify(vb + lane, key, gt, eq);
        w_gt += __popc(gt);
        w_eq += __popc(eq);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      w_gt += __shfl_xor_sync(radix::kFullMask, w_gt, off);
      w_eq += __shfl_xor_sync(radix::kFullMask, w_eq, off);
    }
    if (lane == 0) warp_sums[warp] = w_gt, warp_sums2[warp] = w_eq;
    __syncthreads();
    uint32_t gt_base = 0, eq_base = 0;  // keys before this warp's part (in this CTA, then the cluster)
    for (int w = 0; w < warp; ++w) gt_base += warp_sums[w], eq_base += warp_sums2[w];
    if (num_ctas > 1) {
      if (tid == kThreads - 1) cta_counts[0] = gt_base + w_gt, cta_counts[1] = eq_base + w_eq;
      cluster.sync();
      for (int q = 0; q < rank; ++q) {
        const uint32_t* other = cluster.map_shared_rank(cta_counts, q);
        gt_base += other[0];
        eq_base += other[1];
      }
    }
#ifdef DI_TOPK_DEBUG
    if (warp == kWarps - 1 && lane == 0 && rank == num_ctas - 1)
      DI_TOPK_ASSERT(gt_base + w_gt == greater && eq_base + w_eq >= take_eq);
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
        sort_dst[pos] = (static_cast<unsigned long long>(key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
      else
        store(static_cast<int>(pos), j);
    };

    if (use_lists) {
      for (uint32_t i0 = 0; i0 < cand_n; i0 += 32) {
        const uint32_t i = i0 + lane;
        const uint32_t e = i < cand_n ? my_cand[i] : 0u;
        const uint32_t key = i < cand_n ? key_at(e) : 0u;
        const uint32_t mk = key & mask;
        const bool is_gt = i < cand_n && mk > prefix, is_eq = i < cand_n && mk == prefix;
        const uint32_t bg = __ballot_sync(radix::kFullMask, is_gt), be = __ballot_sync(radix::kFullMask, is_eq);
        const uint32_t g_before = gt_base + __popc(bg & lanes_below);
        const uint32_t e_before = eq_base + __popc(be & lanes_below);
        if (is_gt || (is_eq && e_before < take_eq))
          emit(g_before + min(e_before, take_eq), static_cast<int>(e) - mis, key);
        gt_base += __popc(bg);
        eq_base += __popc(be);
      }
    } else {
      for (int vb = wv0; vb < wv1; vb += 32) {
        const int v = vb + lane;
        uint32_t key[kVec], gt, eq;
        classify(v, key, gt, eq);
        const uint32_t my_gt = __popc(gt), my_eq = __popc(eq);
        // counts fit 16 bits: a strip holds 32 * kVec <= 256 keys
        const uint32_t packed = radix::warp_prefix_sum(my_gt | (my_eq << 16));
        const uint32_t strip = __shfl_sync(radix::kFullMask, packed, 31);
        uint32_t g_before = gt_base + (packed & 0xFFFFu) - my_gt;
        uint32_t e_before = eq_base + (packed >> 16) - my_eq;
        if ((gt | eq) != 0) {
#pragma unroll
          for (int c = 0; c < kVec; ++c) {
            const bool is_gt = (gt >> c) & 1u, is_eq = (eq >> c) & 1u;
            if (is_gt || (is_eq && e_before < take_eq)) emit(g_before + min(e_before, take_eq), v * kVec + c - mis, key[c]);
            g_before += is_gt;
            e_before += is_eq;
          }
        }
        gt_base += strip & 0xFFFFu;
        eq_base += strip >> 16;
      }
    }

    if constexpr (kSorted) {
      row_sync();  // every CTA's entries are in CTA 0's sort buffer
      if (rank == 0) {
        // Bitonic sort (descending) of the composite keys: key, then smaller column first.
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
        for (int p = tid; p < static_cast<int>(total); p += kThreads)
          store(p, static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(sort_buf[p] & 0xFFFFFFFFull)));
      }
    }

    // ---- padding
    if (rank == 0) {
      for (int p = static_cast<int>(total) + tid; p < k; p += kThreads) {
        a.out[r * a.out_stride + p] = -1;
        if (a.out_values != nullptr) {
          if constexpr (kElemBytes == 4)
            static_cast<uint32_t*>(a.out_values)[r * a.values_stride + p] = kNegInfBits;
          else
            static_cast<uint16_t*>(a.out_values)[r * a.values_stride + p] = static_cast<uint16_t>(kNegInfBits);
        }
      }
    }
    row_sync();  // shared memory (read by the cluster) is reused by the next row
  }
}

}  // namespace deep_indexer
