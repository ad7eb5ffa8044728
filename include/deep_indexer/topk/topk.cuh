// topk: exact, deterministic top-k indices of every row of a logits matrix (docs/topk.md).
//
// One cluster of C CTAs per row (C = 1 for many rows; up to 8 when few rows must fill the GPU),
// grid-stride over rows (unsorted wide CTAs and clusters: a cluster per row, TopkLayout::row_per_cta);
// CTAs of 512 threads (two per SM), or 1024 when each gets an SM of its own.
// Keys: radix::float_key / bf16_key (order-preserving, NaN lowest).
// 1. Threshold: a row of more than kSampleMinKeys keys takes a strided sample of 16-byte vectors
//    and a two-digit radix select of the sample's j-th largest key (TopkLayout::sample_rank):
//    kmin, usually a little below the row's k-th key; one pass over the keys' top 16 bits minus a
//    floor first, set by the CTA's previous kmin. Shorter rows keep every key (kmin = 0). Every CTA
//    of the cluster computes the same kmin from the same sample.
// 2. Filter: one read of the row (each CTA its contiguous share); the keys >= kmin go to CTA 0's
//    buffer as (key, column) pairs (warp-aggregated slots; counted even when the buffer is full), one
//    word per pair where it fits (kPacked: bfloat16, TopkLayout::kPackedMaxCols, one CTA per row).
// 3. CTA 0: if fewer than k keys or more than the buffer survived, a radix select over the whole
//    row (re-reads) finds a threshold whose survivors fit, and the filter runs again (rare: skewed
//    or low-contrast rows). A radix select over the buffer then gives the k-th key (prefix/mask),
//    the count above it and how many keys equal to it to take (bfloat16 with a threshold: one pass over
//    key - kmin first, the digits only when the k-th key lies 2047 or more keys above kmin).
// 4. CTA 0 emits in column order: windows of kWindow columns, a bit per selected column in two
//    planes (above the threshold / equal to it), a block scan of their popcounts; every output
//    position is a prefix count (ties to the smaller column), so the result does not depend on
//    the order in which keys reached the buffer. When more keys equal the threshold than the
//    buffer holds, the equal plane is rebuilt from the row, window by window.
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include <deep_indexer/topk/radix_select.cuh>
#include <deep_indexer/topk/topk_layout.hpp>
#include <deep_indexer/topk/topk_row.cuh>
#include <deep_indexer/common/trace.cuh>
#include <deep_indexer/common/varlen.cuh>

// -DDI_TOPK_DEBUG (through DI_JIT_EXTRA_FLAGS; a test switch): device checks of the selection invariants (the JIT
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
namespace topk_detail {

using radix::raw_at;

// Its value as a float (bfloat16 widened exactly).
template <int kElemBytes>
__device__ __forceinline__ float value_at(const uint4& v, int c) {
  return __uint_as_float(raw_at<kElemBytes>(v, c) << (kElemBytes == 4 ? 0 : 16));
}

// Element c (0 <= c < 2 * kVec) of two 16-byte vectors, its raw bits (c is not a compile-time constant).
template <int kElemBytes>
__device__ __forceinline__ uint32_t raw_of_pair(const uint4& a, const uint4& b, int c) {
  constexpr int kPerWord = 4 / kElemBytes;
  // a select tree on values (an indexed array would go to local memory)
  const uint32_t w = static_cast<uint32_t>(c) / kPerWord;
  const uint32_t lo = (w & 2) ? ((w & 1) ? a.w : a.z) : ((w & 1) ? a.y : a.x);
  const uint32_t hi = (w & 2) ? ((w & 1) ? b.w : b.z) : ((w & 1) ? b.y : b.x);
  const uint32_t word = (w & 4) ? hi : lo;
  if constexpr (kElemBytes == 4) return word;
  else return (c & 1) ? (word >> 16) : (word & 0xFFFFu);
}

// NOTES: "key >= kmin" as a float comparison (kmin > 0): the smallest value whose key is >= kmin.
// Keys in (0, key(-inf)] hold no value but -inf, so they compare as -inf (every non-NaN value);
// NaN (key 0) never passes; kmin above key(+inf) gives a NaN bound that nothing passes.
template <int kElemBytes>
__device__ __forceinline__ float key_floor_value(uint32_t kmin) {
  if constexpr (kElemBytes == 4) {
    if (kmin <= 0x00800000u) return __uint_as_float(0xFF800000u);
    return __uint_as_float((kmin & 0x80000000u) ? (kmin & 0x7FFFFFFFu) : 0u - kmin);
  } else {
    if (kmin <= 0x0080u) return __uint_as_float(0xFF800000u);
    const uint32_t bits = (kmin & 0x8000u) ? (kmin & 0x7FFFu) : ((0u - kmin) & 0xFFFFu);
    return __uint_as_float(bits << 16);
  }
}


// Bit u * kVec + c set where element c of vector buf[u] is >= bound (ordered: NaN fails); bound is a value
// of the logits' dtype widened to float (key_floor_value).
// NOTES: bfloat16 compares two elements at a time; the masks' halves are gathered as bit 2 i (element 2 i,
// low half) and bit 17 + 2 i (element 2 i + 1, high half) of one word, shifted by 8 u, then folded: 2
// instructions per 2 elements.
template <int kElemBytes>
__device__ __forceinline__ uint32_t ge_bits(const uint4 (&buf)[2], float bound) {
  uint32_t x = 0;
  if constexpr (kElemBytes == 4) {
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int c = 0; c < 4; ++c) x |= static_cast<uint32_t>(value_at<kElemBytes>(buf[u], c) >= bound) << (4 * u + c);
    return x;
  } else {
    const unsigned short b = static_cast<unsigned short>(__float_as_uint(bound) >> 16);  // a bfloat16 value
    const __nv_bfloat162 bb = __halves2bfloat162(__ushort_as_bfloat16(b), __ushort_as_bfloat16(b));
    auto ge = [&](uint32_t w) { return __hge2_mask(*reinterpret_cast<const __nv_bfloat162*>(&w), bb); };
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const uint32_t wd[4] = {buf[u].x, buf[u].y, buf[u].z, buf[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) x |= ge(wd[i]) & (((1u << (2 * i)) | (1u << (17 + 2 * i))) << (8 * u));
    }
    return (x | (x >> 16)) & 0xFFFFu;
  }
}

// The buffered kernel's constants and phases (one instantiation per kernel variant, every phase
// inlined into topk_kernel below, which walks the rows and keeps the shared helpers).
// NOTES: the helpers the phases share (radix_pass, the filter, clear_words, store) stay lambdas of the
// kernel, passed by reference: turned into functions, they are inlined at another point of the
// optimizer's pipeline and the generated code changes.
template <int kElemBytes, bool kSorted, bool kCluster, int kThreads, bool kPacked>
struct TopkKernel {
  static constexpr TopkLayout L{kElemBytes, kSorted};
  static_assert(!kPacked || (kElemBytes == 2 && !kCluster), "packed survivors: bfloat16, one CTA per row");
  static_assert(kThreads == TopkLayout::kNumThreads || kThreads == TopkLayout::kWideThreads, "block size");
  static constexpr int kWarps = kThreads / 32;
  static_assert(kWarps <= TopkLayout::kMaxWarps, "warp sums fit the scratch");
  // the threshold sample is drawn by the first kNumThreads threads (the same sample for any block size)
  static constexpr int kSampleThreads = TopkLayout::kNumThreads;
  static constexpr int kWordsPerThread = TopkLayout::kWindowWords / kThreads;
  static_assert(TopkLayout::kWindowWords % kThreads == 0, "whole plane words per thread");
  static constexpr int kVec = L.vec();
  static constexpr int kPasses = L.num_passes();
  static constexpr int kCap = TopkLayout::kCandCap;
  static constexpr int kBins = TopkLayout::kHistBins;
  // 16-byte vectors per thread per filter step; their pass bits fit one 32-bit word
  static constexpr int kUnroll = TopkLayout::kFilterVecs;
  static constexpr int kSampleVecs = L.max_sample_vecs();
  static_assert(kUnroll * kVec <= 32, "pass bits of one step in a word");
  static_assert(kElemBytes == 4 || kElemBytes == 2, "float32 or bfloat16 logits");
  static_assert(L.digit_shift(kPasses - 1) == 0 && L.digit_bits(0) <= 11, "digit schedule");
  static_assert(L.digit_shift(0) + L.digit_bits(0) == 8 * kElemBytes, "digit 0 is the key's top bits");
  static constexpr uint32_t kFullKeyMask = kElemBytes == 4 ? 0xFFFFFFFFu : 0xFFFFu;

  // Survivor i of the buffer: its key (raw bits until the selection converts them in place) and its column
  // (from the row's lo). kPacked: one word (TopkLayout::kPackedMaxCols), else cand_key[i] and cand_col[i].
  __device__ __forceinline__ static uint32_t key_at(const uint32_t* cand_key, uint32_t i) {
    return kPacked ? cand_key[i] >> 16 : cand_key[i];
  }
  __device__ __forceinline__ static void set_key(uint32_t* cand_key, uint32_t i, uint32_t key) {
    if constexpr (kPacked) cand_key[i] = (key << 16) | (cand_key[i] & 0xFFFFu);
    else cand_key[i] = key;
  }
  __device__ __forceinline__ static uint32_t col_at(const uint32_t* cand_key, const uint32_t* cand_col, uint32_t i,
                                                    int mis) {
    return kPacked ? (cand_key[i] & 0xFFFFu) - static_cast<uint32_t>(mis) : cand_col[i];
  }

  // One-pass searches above a known floor: value v >= floor is counted in bin v - floor (one value per bin;
  // values kLastBin or more above the floor share the last bin), as radix_pass(0, ...)'s digit.
  static constexpr uint32_t kLastBin = kBins - 1;
  __device__ __forceinline__ static uint32_t offset_digit(uint32_t v, uint32_t floor) {
    return min(v - floor, kLastBin) << L.digit_shift(0);
  }

  // A radix select's state: the resolved bits `mask` of the k-th key (`prefix`), the keys above it
  // so far and the rank still wanted among the keys that match the prefix.
  struct RadixState {
    uint32_t prefix = 0, mask = 0, greater = 0, k_rem = 0;
  };

  // The selection's threshold: prefix over the resolved bits `mask`, the keys above it (`greater`),
  // how many keys equal to it to take (`take_eq`); `whole`: every equal key is taken; `eq_from_row`:
  // the equal keys are not in the buffer (more than it holds); ns: the keys in the buffer.
  struct Selection {
    uint32_t ns, prefix, mask, greater, take_eq;
    bool whole, eq_from_row;
  };

  // ---- 1. threshold (n > kSampleMinKeys): a strided sample of the row and a radix select of its
  // j-th largest key (TopkLayout::sample_rank), from `near` in one pass or over one or two digits: kmin.
  // Every CTA of the cluster computes the same kmin (the same sample, the same rows before).
  template <class RadixPass>
  __device__ __forceinline__ static uint32_t sample_threshold(const RowSpan<kElemBytes>& row, const int& n,
                                                              const int& num_vecs, const uint4* row_vec,
                                                              const int& tid, const int& k, const uint32_t& near,
                                                              RadixPass& radix_pass, Tracer& tr) {
    constexpr TopkLayout L{kElemBytes, kSorted};  // NOTES: a local (sample_vecs_per_thread runs at run time)
    // sample vector t of thread tid < kSampleThreads: (tid + t * kSampleThreads) * stride, stride =
    // num_vecs / m_v >= 1; the other threads hold none
    const int sample_vecs = L.sample_vecs_per_thread(n);
    const int s_v = kThreads == kSampleThreads || tid < kSampleThreads ? sample_vecs : 0;
    const int m_v = sample_vecs * kSampleThreads;  // <= num_vecs: n > kSampleMinKeys
    const int stride = num_vecs / m_v;
    uint4 sample[kSampleVecs];
    uint32_t sample_valid = 0;  // bit t * kVec + c
#pragma unroll
    for (int t = 0; t < kSampleVecs; ++t) {
      const int v = (tid + t * kSampleThreads) * stride;
      sample[t] = t < s_v ? __ldg(row_vec + v) : make_uint4(0u, 0u, 0u, 0u);
      sample_valid |= (t < s_v ? row.valid_bits(v) : 0u) << (t * kVec);
    }
    tr.mark<0>(static_cast<int>(sample[0].x));
    const uint32_t j = TopkLayout::sample_rank(k, n, static_cast<uint32_t>(m_v * kVec), kVec);
    // NOTES: with a key `near` the expected answer (the CTA's previous kmin; 0: none), one pass over the keys'
    // top 16 bits minus a floor (bins of one value each, floor = near's top bits - kSampleFloorBelow; keys at or
    // below the floor share bin 0, keys 2047 or more above it the last bin) gives the j-th key's top 16 bits
    // (bfloat16: the key itself) unless they lie in bin 0 or the last bin, where the digits follow.
    if (near > 0u) {
      constexpr int kTop = 8 * kElemBytes - 16;  // the key's top 16 bits: key >> kTop
      constexpr uint32_t kBelow = TopkLayout::kSampleFloorBelow;
      const uint32_t floor_top = max(near >> kTop, kBelow) - kBelow;
      RadixState so;
      so.k_rem = j;
      const radix::KthBin kb = radix_pass(0, so, [&](auto&& add) {
#pragma unroll
        for (int t = 0; t < kSampleVecs; ++t) {
          if (t >= s_v) break;
          if constexpr (kElemBytes == 2) {
            // NOTES: two keys per word: each half is raised to the floor, so the subtraction borrows
            // across no half, and each half's bin is min(key - floor, kLastBin), as offset_digit's
            const uint32_t floor2 = floor_top * 0x10001u, last2 = kLastBin * 0x10001u;
            const uint32_t wd[4] = {sample[t].x, sample[t].y, sample[t].z, sample[t].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const uint32_t d = __vminu2(__vmaxu2(radix::bf16_key_pair(wd[i]), floor2) - floor2, last2);
              add((d & 0xFFFFu) << L.digit_shift(0), (sample_valid >> (t * kVec + 2 * i)) & 1u);
              add((d >> 16) << L.digit_shift(0), (sample_valid >> (t * kVec + 2 * i + 1)) & 1u);
            }
          } else {
#pragma unroll
            for (int c = 0; c < kVec; ++c) {
              const uint32_t top = radix::to_key<kElemBytes>(raw_at<kElemBytes>(sample[t], c)) >> kTop;
              add(offset_digit(max(top, floor_top), floor_top), (sample_valid >> (t * kVec + c)) & 1u);
            }
          }
        }
      });
      if (kb.bin > 0u && kb.bin < kLastBin) {
        tr.mark<1>();
        return (floor_top + kb.bin) << kTop;
      }
    }
    RadixState st;
    st.k_rem = j;
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
      const radix::KthBin kb = radix_pass(pass, st, [&](auto&& add) {
#pragma unroll
        for (int t = 0; t < kSampleVecs; ++t) {
          if (t >= s_v) break;
#pragma unroll
          for (int c = 0; c < kVec; ++c)
            add(radix::to_key<kElemBytes>(raw_at<kElemBytes>(sample[t], c)), (sample_valid >> (t * kVec + c)) & 1u);
        }
      });
      // The first digit's bin edge alone keeps about n * (above + count) / m keys: stop when
      // that is at most half the buffer (decode-sized rows), else refine by a second digit.
      if (pass == 0 && TopkLayout::coarse_sample_enough(kb.above + kb.count, n, static_cast<uint32_t>(m_v * kVec)))
        break;
    }
    tr.mark<1>();
    return st.prefix;
  }

  // ---- 3. CTA 0: the selection's threshold over the ns survivors in the buffer. If fewer than k or
  // more than the buffer survived, a radix select over the whole row first finds a threshold whose
  // survivors fit, and the filter runs again.
  template <class RadixPass, class Prefetch, class Filter>
  __device__ __forceinline__ static Selection select_threshold(
      const RowSpan<kElemBytes>& row, const int& n, const int& num_vecs, const uint4* row_vec, const int& k,
      const uint32_t& kmin, uint32_t* count, uint32_t* cand_key, uint32_t* cand_col, const int& tid, const int& lane,
      const int& warp, RadixPass& radix_pass, Prefetch& prefetch, Filter& filter, int& first_ns, Tracer& tr) {
    uint32_t ns = *count;
    uint32_t prefix = 0, mask = 0, greater = 0, take_eq = ns;
    bool whole = true, eq_from_row = false;
    if (first_ns < 0) first_ns = static_cast<int>(ns);
    const uint64_t fallback_t0 = tr.now();
    uint32_t floor_key = kmin;  // every buffered key is >= it (the filter's bound; 0: no bound known)
    if (ns < static_cast<uint32_t>(min(k, n)) || ns > static_cast<uint32_t>(kCap)) {
      floor_key = 0;
      // Radix select over the whole row until the keys from the k-th key's bin up fit the buffer.
      RadixState st;
      st.k_rem = static_cast<uint32_t>(k);
      uint32_t count_ge = 0;
#pragma unroll 1
      for (int pass = 0; pass < kPasses; ++pass) {
        const radix::KthBin kb = radix_pass(pass, st, [&](auto&& add) {
          for (int vb = warp * 32; vb < num_vecs; vb += kThreads) {
            const int v = vb + lane;
            const uint4 raw = v < num_vecs ? __ldg(row_vec + v) : make_uint4(0u, 0u, 0u, 0u);
            const uint32_t valid = v < num_vecs ? row.valid_bits(v) : 0u;
#pragma unroll
            for (int c = 0; c < kVec; ++c) add(radix::to_key<kElemBytes>(raw_at<kElemBytes>(raw, c)), (valid >> c) & 1u);
          }
        });
        count_ge = st.greater + kb.count;
        if (count_ge <= static_cast<uint32_t>(kCap)) break;
      }
      // NOTES: count_ge > kCap only after the last digit: more keys equal the threshold key than
      // the buffer holds. The buffer then takes the keys above it; the equal ones come from the row.
      eq_from_row = count_ge > static_cast<uint32_t>(kCap);
      if (tid == 0) *count = 0;
      __syncthreads();
      prefetch(0, num_vecs);
      filter(0, num_vecs, eq_from_row ? st.prefix + 1u : st.prefix, count, cand_key, cand_col);
      __syncthreads();
      ns = *count;
      DI_TOPK_ASSERT(ns == (eq_from_row ? st.greater : count_ge));
      if (eq_from_row) {
        DI_TOPK_ASSERT(st.mask == kFullKeyMask);
        prefix = st.prefix;
        mask = st.mask;
        greater = st.greater;
        take_eq = st.k_rem;
        whole = false;
      } else {
        take_eq = ns;
      }
      tr.add_since<7>(fallback_t0);
    }
    if (!eq_from_row && ns > static_cast<uint32_t>(k)) {
      // Radix select of the k-th key over the buffer (its first pass turns the raw bits into keys,
      // in place); stops once the k-th key's bin is taken whole.
      RadixState st;
      st.k_rem = static_cast<uint32_t>(k);
      whole = false;
      bool converted = false, resolved = false;
      if constexpr (kElemBytes == 2) {
        // NOTES: bfloat16 with a known floor: one pass over key - floor_key (bins of one key each; keys
        // 2047 or more above the floor share the last bin) gives the k-th key itself unless it lies in
        // that last bin, where the two digits follow.
        if (floor_key > 0u) {
          RadixState so;
          so.k_rem = static_cast<uint32_t>(k);
          const radix::KthBin kb = radix_pass(0, so, [&](auto&& add) {
#pragma unroll 2
            for (uint32_t i = tid; i < ns; i += kThreads) {
              const uint32_t key = radix::to_key<kElemBytes>(key_at(cand_key, i));
              set_key(cand_key, i, key);
              DI_TOPK_ASSERT(key >= floor_key);
              add(offset_digit(key, floor_key), true);
            }
          });
          converted = true;
          if (kb.bin < kLastBin) {
            resolved = true;
            st.prefix = floor_key + kb.bin;
            st.mask = kFullKeyMask;
            st.greater = kb.above;
            st.k_rem = static_cast<uint32_t>(k) - kb.above;
            whole = st.k_rem == kb.count;
          }
        }
      }
#pragma unroll 1
      for (int pass = 0; pass < kPasses && !whole && !resolved; ++pass) {
        const radix::KthBin kb = radix_pass(pass, st, [&](auto&& add) {
#pragma unroll 2
          for (uint32_t i = tid; i < ns; i += kThreads) {
            uint32_t key = key_at(cand_key, i);
            if (pass == 0 && !converted) {
              key = radix::to_key<kElemBytes>(key);
              set_key(cand_key, i, key);
            }
            add(key, true);
          }
        });
        whole = st.k_rem == kb.count;
      }
      prefix = st.prefix;
      mask = st.mask;
      greater = st.greater;
      take_eq = st.k_rem;
    } else {
      for (uint32_t i = tid; i < ns; i += kThreads) set_key(cand_key, i, radix::to_key<kElemBytes>(key_at(cand_key, i)));
      __syncthreads();
    }
    tr.mark<4>();
    return Selection{ns, prefix, mask, greater, take_eq, whole, eq_from_row};
  }

  // ---- 4. CTA 0: emission in column order, window by window. An entry's output position is the count
  // of selected columns before it: the prefix counts of the plane words before its word (a block scan,
  // kept in `word_prefix`, in the histogram that is not clean) plus its word's lower bits. The planes
  // are clean when a row starts (cleared after the previous row's emission). Returns the count of
  // keys above the threshold (all of them when `whole`).
  // NOTES: unsorted output is staged by position in `hist` (zero and idle here: the last radix
  // pass counted into the other half; kMaxK words fit), then stored in coalesced runs and the
  // histogram cleared again (every radix pass starts from a zero `hist`).
  template <class ClearWords>
  __device__ __forceinline__ static uint32_t emit_windows(
      const Selection& sel, const uint32_t& total, const int& n, const int& mis, const uint4* row_vec,
      const uint32_t* cand_key, const uint32_t* cand_col, uint32_t* plane_gt, uint32_t* plane_eq,
      uint32_t* warp_sums, uint32_t* hist, uint32_t* hist_next, unsigned long long* sort_buf, const int& tid,
      const int& lane, const int& warp, ClearWords& clear_words) {
    const uint32_t ns = sel.ns, prefix = sel.prefix, mask = sel.mask, take_eq = sel.take_eq;
    const bool whole = sel.whole, eq_from_row = sel.eq_from_row;
    static_assert(TopkLayout::kMaxK <= kBins, "the staged output fits the histogram");
    uint32_t* stage = hist;
    auto emit = [&](uint32_t pos, int j, uint32_t key) {
      DI_TOPK_ASSERT(pos < total);
      if (pos >= total) return;  // unreachable; never writes out of bounds
      if constexpr (kSorted)
        sort_buf[pos] = (static_cast<unsigned long long>(key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
      else
        stage[pos] = static_cast<uint32_t>(j);
    };
    uint32_t* word_prefix = hist_next;  // [kWindowWords]: (above, equal) counts before the word, 16 bits each
    static_assert(TopkLayout::kWindowWords <= kBins, "word prefixes fit the histogram");
    uint32_t gt_base = 0, eq_base = 0;
#pragma unroll 1
    for (int w0 = 0; w0 < n && gt_base + min(eq_base, take_eq) < total; w0 += TopkLayout::kWindow) {
      const uint32_t wn = static_cast<uint32_t>(min(TopkLayout::kWindow, n - w0));
      if (w0 > 0) {
        clear_words(plane_gt, 2 * TopkLayout::kWindowWords);
        __syncthreads();
      }
      for (uint32_t i = tid; i < ns; i += kThreads) {
        const uint32_t j = col_at(cand_key, cand_col, i, mis) - static_cast<uint32_t>(w0);
        if (j < wn) {
          const uint32_t mk = key_at(cand_key, i) & mask;
          if (mk > prefix || (mk == prefix && whole)) atomicOr(plane_gt + (j >> 5), 1u << (j & 31));
          else if (mk == prefix) atomicOr(plane_eq + (j >> 5), 1u << (j & 31));
        }
      }
      if (eq_from_row) {
        const int vw0 = (w0 + mis) / kVec, vw1 = (w0 + static_cast<int>(wn) - 1 + mis) / kVec + 1;
        for (int v = vw0 + tid; v < vw1; v += kThreads) {
          const uint4 raw = __ldg(row_vec + v);
#pragma unroll
          for (int c = 0; c < kVec; ++c) {
            const uint32_t j = static_cast<uint32_t>(v * kVec + c - mis - w0);
            if (j < wn && radix::to_key<kElemBytes>(raw_at<kElemBytes>(raw, c)) == prefix)
              atomicOr(plane_eq + (j >> 5), 1u << (j & 31));
          }
        }
      }
      __syncthreads();
      // Block scan of the words' (above, equal) counts, packed in 16-bit halves (< 65536 columns).
      uint32_t gw[kWordsPerThread], ew[kWordsPerThread], cnt[kWordsPerThread];
      uint32_t mine = 0;
#pragma unroll
      for (int q = 0; q < kWordsPerThread; ++q) {
        gw[q] = plane_gt[tid * kWordsPerThread + q];
        ew[q] = plane_eq[tid * kWordsPerThread + q];
        cnt[q] = __popc(gw[q]) | (__popc(ew[q]) << 16);
        mine += cnt[q];
      }
      const uint32_t incl = ptx::warp_prefix_sum(mine);
      if (lane == 31) warp_sums[warp] = incl;
      __syncthreads();
      uint32_t all;
      uint32_t before = incl - mine + radix::sum_of_warps_below<kWarps>(warp_sums, all);
#pragma unroll
      for (int q = 0; q < kWordsPerThread; ++q) {
        word_prefix[tid * kWordsPerThread + q] = before;
        if (eq_from_row) {
          // the equal keys are not in the buffer: walk this word's bits in column order
          uint32_t g_before = gt_base + (before & 0xFFFFu), e_before = eq_base + (before >> 16);
          uint32_t bits = gw[q] | ew[q];
          while (bits != 0u) {
            const int b = __ffs(bits) - 1;
            bits &= bits - 1u;
            const bool is_gt = (gw[q] >> b) & 1u;
            if (!is_gt && e_before < take_eq)
              emit(g_before + e_before, w0 + (tid * kWordsPerThread + q) * 32 + b, prefix);
            g_before += is_gt;
            e_before += !is_gt;
          }
        }
        before += cnt[q];
      }
      __syncthreads();
      for (uint32_t i = tid; i < ns; i += kThreads) {
        const uint32_t j = col_at(cand_key, cand_col, i, mis) - static_cast<uint32_t>(w0);
        if (j < wn) {
          const uint32_t key = key_at(cand_key, i), mk = key & mask;
          const bool is_gt = mk > prefix || (mk == prefix && whole);
          if (is_gt || mk == prefix) {
            const uint32_t word = j >> 5, lower = (1u << (j & 31)) - 1u, wp = word_prefix[word];
            const uint32_t g_before = gt_base + (wp & 0xFFFFu) + __popc(plane_gt[word] & lower);
            const uint32_t e_before = eq_base + (wp >> 16) + __popc(plane_eq[word] & lower);
            if (is_gt || e_before < take_eq) emit(g_before + min(e_before, take_eq), static_cast<int>(j) + w0, key);
          }
        }
      }
      gt_base += all & 0xFFFFu;
      eq_base += all >> 16;
      __syncthreads();  // planes, word prefixes and warp sums are reused
    }
    return gt_base;
  }

  // ---- 5. sorted output: bitonic sort (descending) of the composite keys of the `total` entries
  // (key, then smaller column first), then the stores.
  template <class Store>
  __device__ __forceinline__ static void sort_and_store(unsigned long long* sort_buf, const uint32_t& total,
                                                        const int& tid, Store& store) {
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
};

}  // namespace topk_detail

// kCluster: launched with clusters of 2-8 CTAs per row (else one CTA per row, no DSMEM code);
// unsorted output only. kThreads: TopkLayout::kNumThreads (two CTAs per SM) or kWideThreads (one CTA
// per SM, for launches of at most one CTA per SM: each row's loops take half the steps). kPacked: one word
// per survivor (TopkKernel::key_at / col_at).
template <int kElemBytes, bool kSorted, bool kCluster, int kThreads, bool kPacked>
__global__ void __launch_bounds__(kThreads, TopkLayout::ctas_per_sm(kThreads)) topk_kernel(const TopkArgs a) {
  static_assert(!(kSorted && kCluster), "sorted output runs one CTA per row");
  namespace cg = cooperative_groups;
  using namespace topk_detail;
  using K = TopkKernel<kElemBytes, kSorted, kCluster, kThreads, kPacked>;
  constexpr TopkLayout L = K::L;
  constexpr int kWarps = K::kWarps;
  constexpr int kVec = K::kVec;
  constexpr int kCap = K::kCap;
  constexpr int kBins = K::kBins;
  constexpr int kUnroll = K::kUnroll;
  using RadixState = typename K::RadixState;

  extern __shared__ __align__(16) uint8_t smem[];
  // NOTES: `hist` is all zero whenever a radix pass starts: each pass clears `hist_next` (last read
  // by the previous pass's bin search, which ends with a barrier) while it counts into `hist`,
  // and the two swap; the search's opening barrier orders the clearing before the next pass.
  uint32_t* hist = reinterpret_cast<uint32_t*>(smem + L.hist_offset());
  uint32_t* hist_next = hist + kBins;
  auto next_hist_pass = [&]() {
    uint32_t* t = hist;
    hist = hist_next;
    hist_next = t;
  };
  uint32_t* warp_sums = reinterpret_cast<uint32_t*>(smem + L.scratch_offset());  // [kWarps]
  // [0, 3): find_kth_bin; [kScalarCount or kScalarCountOdd, by row parity]: survivors of the row (CTA 0's are the cluster's);
  // [kScalarTableRow]: a varlen row's block-table row (slot mode; written by warp 0 before the emission, read by
  // the stores); [kScalarSink]: the radix passes' sink for keys that do not count (never read)
  uint32_t* scalars = warp_sums + 2 * kWarps;
  constexpr uint32_t kCountStride = TopkLayout::kScalarCountOdd - TopkLayout::kScalarCount;  // words
  uint32_t* cand_key = reinterpret_cast<uint32_t*>(smem + L.cand_key_offset());
  uint32_t* cand_col = reinterpret_cast<uint32_t*>(smem + L.cand_col_offset());
  // shared-window addresses
  const uint32_t cand_key_s = ptx::smem_addr(cand_key), cand_col_s = ptx::smem_addr(cand_col);
  const uint32_t count0_s = ptx::smem_addr(scalars + TopkLayout::kScalarCount);
  uint32_t* plane_gt = reinterpret_cast<uint32_t*>(smem + L.plane_offset());
  uint32_t* plane_eq = plane_gt + TopkLayout::kWindowWords;
  unsigned long long* sort_buf = reinterpret_cast<unsigned long long*>(smem + L.sort_offset());
  // Zeroes `words` 32-bit words of shared memory (16-byte aligned, a multiple of 4), 16 bytes per store.
  auto clear_words = [&](uint32_t* p, int words) {
    for (int i = threadIdx.x; i < words / 4; i += kThreads) reinterpret_cast<uint4*>(p)[i] = make_uint4(0u, 0u, 0u, 0u);
  };
  static_assert(kBins % 4 == 0 && TopkLayout::kWindowWords % 4 == 0, "whole 16-byte clears");
  // One radix pass (digit `pass`): `count(add)` calls add(key, valid) for its keys; those valid and
  // matching the prefix are counted by their digit. Returns the k_rem-th key's bin; refines `st`.
  auto radix_pass = [&](int pass, RadixState& st, auto&& count) -> radix::KthBin {
    const int shift = L.digit_shift(pass);
    const uint32_t digit_mask = (1u << L.digit_bits(pass)) - 1u;
    clear_words(hist_next, kBins);
    // NOTES: keys that do not count add to a sink word instead (no branch around the atomic; the
    // hardware combines a warp's lanes on one address)
    uint32_t* sink = scalars + TopkLayout::kScalarSink;
    count([&](uint32_t key, bool valid) {
      atomicAdd(valid && (key & st.mask) == st.prefix ? hist + ((key >> shift) & digit_mask) : sink, 1u);
    });
    const uint32_t* h = hist;  // 16-byte aligned: a thread's kBins / kThreads bins in one vector load
    radix::KthBin kb;
    if (L.digit_bits(pass) == 5) {  // bfloat16's second digit: 32 bins, warp 0 alone
      kb = radix::find_kth_bin_warp0([&](int b) { return h[b]; }, st.k_rem, scalars);
    } else {
      kb = radix::find_kth_bin<kThreads, kBins>([&](int b) { return h[b]; }, st.k_rem, warp_sums, scalars);
    }
    next_hist_pass();
    st.prefix |= kb.bin << shift;
    st.mask |= digit_mask << shift;
    st.greater += kb.above;
    st.k_rem -= kb.above;
    return kb;
  };

  cg::cluster_group cluster = cg::this_cluster();
  const int num_ctas = kCluster ? static_cast<int>(cluster.num_blocks()) : 1;  // C
  // the CTA's rank in its cluster (a special register, read where used)
  auto rank = [&]() { return kCluster ? static_cast<int>(cluster.block_rank()) : 0; };
  // Block barrier, or cluster barrier (release/acquire of shared memory) when C > 1.
  auto row_sync = [&]() {
    if constexpr (kCluster) cluster.sync();
    else __syncthreads();
  };

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  ptx::grid_dependency_wait();  // PDL: every global read and write after the previous kernel
  const int& k = a.k;  // read from the parameter bank where used (no register for the whole kernel)
  const int num_clusters = static_cast<int>(gridDim.x) / num_ctas;
  if (tid == 0) scalars[TopkLayout::kScalarCount] = 0u, scalars[TopkLayout::kScalarCountOdd] = 0u;
  clear_words(hist, 2 * kBins);
  clear_words(plane_gt, 2 * TopkLayout::kWindowWords);
  row_sync();
  // DI_KERNEL_TRACE: thread 0's first row; marks 0 sample in, 1 threshold, 2 own filter done,
  // 3 survivors complete, 4 selection threshold, 5 emitted, 6 row end; 7 cycles in fallbacks
  Tracer tr;
  tr.start();
  int first_ns = -1;

  // The (ks, ke) entries of a row; each row's are loaded one row ahead.
  auto load_range = [&](int64_t r, int& ks_v, int& ke_v) {
    if (r < a.num_rows) load_row_range(a, r, ks_v, ke_v);
  };
  int ks_next = 0, ke_next = 0;
  uint32_t near_kmin = 0;  // the last sampled row's kmin (where the next sample's search starts)
  // NOTES: the rows' survivor counters alternate, so that a row resets the previous row's counter after its
  // own mid-row barrier (every read of it done; the next write after this row's end barrier)
  uint32_t odd_row = 0;
  load_range(static_cast<int>(blockIdx.x) / num_ctas, ks_next, ke_next);
  // NOTES: unsorted wide CTAs and clusters: the host launches a cluster (CTA) per row (grid = rows x C), so the
  // loop body runs once, with nothing loaded or cleared for a next row (sorted output keeps the loop: its
  // one-row body measured slower)
  constexpr bool kRowPerCta = TopkLayout::row_per_cta(kSorted, kCluster, kThreads);
  for (int r = static_cast<int>(blockIdx.x) / num_ctas; r < a.num_rows; r += num_clusters) {  // no overflow: rows < 2^31 - 2^20
#ifdef DI_TRACE_ROW  // with DI_KERNEL_TRACE: the marks of the CTA's row DI_TRACE_ROW (0: its first), from its start
    if (r == static_cast<int>(blockIdx.x) / num_ctas + DI_TRACE_ROW * num_clusters) tr = Tracer{}, tr.start();
#endif
    // ---- the row's valid columns [lo, lo + n) (rows < 2^31: checked by the API)
    const int ks_r = ks_next, ke_r = ke_next;
    if constexpr (!kRowPerCta) load_range(static_cast<int64_t>(r) + num_clusters, ks_next, ke_next);
    const RowSpan<kElemBytes> row(a, r, ks_r, ke_r);
    const int lo = row.lo, n = row.n, mis = row.mis, num_vecs = row.num_vecs;
    const uint4* row_vec = row.vec;
    const bool slot_mode = a.index_mode == static_cast<int>(TopkIndexMode::kSlot);
    // NOTES: slot mode without varlen: the row's table lines asked of the emitting CTA's L1 by its last warp
    if (slot_mode && a.indices == nullptr && rank() == 0 && warp == kWarps - 1)
      prefetch_table_l1(a, table_row_of(a, r), 0, n, lane);
    const int per_cta = (num_vecs + num_ctas - 1) / num_ctas;
    const int v_begin = min(rank() * per_cta, num_vecs), v_end = min(v_begin + per_cta, num_vecs);
    uint32_t* count = scalars + TopkLayout::kScalarCount + kCountStride * odd_row;
    const uint32_t count_lane_s = ptx::lane0_shared_addr(count0_s + 4u * kCountStride * odd_row);  // the row's counter

    // The filter over vectors [vb0, vb1): `prefetch` issues its first step's loads (before the
    // threshold is known), `filter` appends the raw bits and columns of the keys >= kmin (kmin = 0:
    // every key) to `dst_*`. Two register buffers alternate: one step's loads are in flight while
    // the other step is filtered.
    constexpr int kStep = kThreads * kUnroll;
    constexpr uint32_t kVecMask = (1u << kVec) - 1u;
    static_assert(kUnroll == 2, "raw_of_pair and ge_bits read a step of two vectors");
    uint4 buf_a[kUnroll], buf_b[kUnroll];
    // NOTES: inside the filter's loop vb1 >= 1 (a step began below it), so a lane past vb1 loads vector vb1 - 1
    // of the row instead (no predicate, no fill; its pass bits are zero); `prefetch` may see an empty range.
    auto load_step = [&](uint4 (&buf)[kUnroll], int base, int vb1) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) buf[u] = __ldg(row_vec + min(base + u * 32 + lane, vb1 - 1));
    };
    auto prefetch = [&](int vb0, int vb1) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = vb0 + warp * 32 * kUnroll + u * 32 + lane;
        buf_a[u] = v < vb1 ? __ldg(row_vec + v) : make_uint4(0u, 0u, 0u, 0u);
      }
    };
    auto filter_step = [&](const uint4 (&buf)[kUnroll], int base, int vb1, bool all, float bound,
                           uint32_t* dst_count, uint32_t* dst_key, uint32_t* dst_col) {
      // warp-uniform: every vector of the step is in [vb0, vb1) and a whole interior vector of the row
      const bool interior = base > 0 && base + 32 * kUnroll <= vb1 && base + 32 * kUnroll < num_vecs;
      uint32_t bits = (1u << (kUnroll * kVec)) - 1u;
      if (!interior) {
        bits = 0;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = base + u * 32 + lane;
          const uint32_t pass = v >= vb1 ? 0u : v > 0 && v < num_vecs - 1 ? kVecMask : row.valid_bits(v);
          bits |= pass << (u * kVec);
        }
      }
      if (!all) bits &= ge_bits<kElemBytes>(buf, bound);
      if (!__any_sync(radix::kFullMask, bits != 0u)) return;
      const uint32_t my = __popc(bits);
      // NOTES: lane 0 reserves the warp's slots with the suffix sum it holds (the warp's total); a
      // lane's first slot is the end of the reservation less its suffix sum (lanes in order).
      const uint32_t suffix = ptx::warp_suffix_sum(my);  // survivors of the lanes >= this one
      uint32_t end = 0;
      if (lane == 0) {
        if constexpr (kCluster) end = atomicAdd(dst_count, suffix) + suffix;
        else end = ptx::atom_add_shared_lane0(count_lane_s, suffix) + suffix;
        DI_TOPK_ASSERT(kCluster || dst_count == count);  // one CTA: the filter's counter is `count`
      }
      end = __shfl_sync(radix::kFullMask, end, 0);
      uint32_t slot = end - suffix;
      const int col0 = (base + lane) * kVec - mis;  // the column of element 0 of the lane's first vector
      // NOTES: with a slot for every survivor of the step, a lane tests every element position in turn
      // (predicated stores to 32-bit shared addresses, no divergent loop); else (and for the remote
      // buffer of a cluster) it walks its survivors.
      if (!kCluster && end <= static_cast<uint32_t>(kCap)) {
        DI_TOPK_ASSERT(dst_key == cand_key && dst_col == cand_col);  // the CTA's own buffer
        uint32_t ka = cand_key_s + 4u * slot;
        const uint32_t kc = cand_col_s - cand_key_s;
        // packed: pos_pair holds the positions of elements 0 and 1 of the lane's first vector in its halves, pos_w
        // those of the word's two elements (pos_pair plus the word's offset, added once per word ahead of the
        // predicated stores; no carry: positions < 65536); a survivor's word is a byte permute of the logits word
        // holding it with pos_w (its bits high, its position low)
        const uint32_t pos_pair = static_cast<uint32_t>((base + lane) * kVec) * 0x10001u + 0x10000u;
        uint32_t pos_w = 0;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
          for (int c = 0; c < kVec; ++c) {
            if constexpr (kPacked) {
              if (c % 2 == 0) pos_w = ptx::add_u32(pos_pair, static_cast<uint32_t>(u * 32 * kVec + c) * 0x10001u);
            }
            if (bits & (1u << (u * kVec + c))) {
              if constexpr (kPacked) {
                const uint32_t w = c / 2 == 0 ? buf[u].x : c / 2 == 1 ? buf[u].y : c / 2 == 2 ? buf[u].z : buf[u].w;
                ptx::st_shared_u32(ka, __byte_perm(w, pos_w, (c & 1) ? 0x3276u : 0x1054u));
              } else {
                ptx::st_shared_u32(ka, raw_at<kElemBytes>(buf[u], c));
                ptx::st_shared_u32(ka + kc, static_cast<uint32_t>(col0 + u * 32 * kVec + c));
              }
              ka += 4u;
            }
          }
        }
      } else {
        while (bits != 0u) {
          const int b = __ffs(bits) - 1;
          bits &= bits - 1u;
          if (slot < static_cast<uint32_t>(kCap)) {
            const uint32_t col = static_cast<uint32_t>(col0 + (b / kVec) * 32 * kVec + b % kVec);
            if constexpr (kPacked) {
              dst_key[slot] = (raw_of_pair<kElemBytes>(buf[0], buf[1], b) << 16) | (col + static_cast<uint32_t>(mis));
            } else {
              dst_key[slot] = raw_of_pair<kElemBytes>(buf[0], buf[1], b);
              dst_col[slot] = col;
            }
          }
          ++slot;
        }
      }
    };
    auto filter = [&](int vb0, int vb1, uint32_t kmin, uint32_t* dst_count, uint32_t* dst_key, uint32_t* dst_col) {
      const bool all = kmin == 0u;
      const float bound = key_floor_value<kElemBytes>(kmin);
      // Warp-uniform trip counts; buf_a holds the first step (prefetch).
#pragma unroll 1
      for (int base = vb0 + warp * 32 * kUnroll; base < vb1; base += 2 * kStep) {
        load_step(buf_b, base + kStep, vb1);
        filter_step(buf_a, base, vb1, all, bound, dst_count, dst_key, dst_col);
        if (base + kStep >= vb1) break;
        load_step(buf_a, base + 2 * kStep, vb1);
        filter_step(buf_b, base + kStep, vb1, all, bound, dst_count, dst_key, dst_col);
      }
    };

    // ---- 1. threshold (every CTA of the cluster computes the same kmin; kmin = 0: every key)
    prefetch(v_begin, v_end);
    uint32_t kmin = 0;
    if (n > TopkLayout::kSampleMinKeys) {
      kmin = K::sample_threshold(row, n, num_vecs, row_vec, tid, k, near_kmin, radix_pass, tr);
      near_kmin = kmin;
    }

    // ---- 2. filter this CTA's share into the buffer and counter of CTA 0 of the cluster
    if constexpr (kCluster)
      filter(v_begin, v_end, kmin, cluster.map_shared_rank(count, 0), cluster.map_shared_rank(cand_key, 0),
             cluster.map_shared_rank(cand_col, 0));
    else
      filter(v_begin, v_end, kmin, count, cand_key, cand_col);
    tr.mark<2>();
    row_sync();  // every survivor of the cluster is in CTA 0
    tr.mark<3>();
    if (tid == 0) scalars[TopkLayout::kScalarCount + kCountStride * (odd_row ^ 1u)] = 0u;

    if (rank() == 0) {
      // ---- 3. the selection's threshold
      const typename K::Selection sel = K::select_threshold(row, n, num_vecs, row_vec, k, kmin, count, cand_key,
                                                            cand_col, tid, lane, warp, radix_pass, prefetch, filter,
                                                            first_ns, tr);
      const uint32_t greater = sel.greater, take_eq = sel.take_eq;
      [[maybe_unused]] const bool whole = sel.whole;
      const uint32_t total = greater + take_eq;
      DI_TOPK_ASSERT(total == static_cast<uint32_t>(min(k, n)));

      // NOTES: a varlen row's block-table row is looked up by warp 0 here, under the emission, and read
      // into `seq` after the window loop's barriers (the loop runs at least once when total > 0).
      if (slot_mode && a.indices != nullptr && warp == 0) {
        const int first = varlen::run_first_row(a.indices, r, lane);
        if (lane == 0) scalars[TopkLayout::kScalarTableRow] = static_cast<uint32_t>(first);
      }
      int64_t seq = 0;  // slot mode: the row's block-table row, set once before the stores
      const uint32_t offset = a.row_offset == nullptr ? 0u : static_cast<uint32_t>(__ldg(a.row_offset + r));
      int* out_row = a.out + static_cast<int64_t>(r) * a.out_stride;
      // Writes column j (relative to lo) as output entry `pos` in the requested index convention.
      auto store = [&](int pos, int j) {
        store_entry<kElemBytes>(a, out_row, r, lo, pos, j, entry_index(a, lo, seq, offset, j));
      };

      // ---- 4. emission in column order (staged in `hist` for unsorted output)
      uint32_t* stage = hist;
      [[maybe_unused]] const uint32_t gt_base =
          K::emit_windows(sel, total, n, mis, row_vec, cand_key, cand_col, plane_gt, plane_eq, warp_sums, hist,
                          hist_next, sort_buf, tid, lane, warp, clear_words);
      if (slot_mode)
        seq = a.indices != nullptr ? static_cast<int64_t>(scalars[TopkLayout::kScalarTableRow]) : table_row_of(a, r);
      if constexpr (!kSorted) {
        // every position is staged: each emit is followed by the window loop's closing barrier
        for (int p = tid; p < static_cast<int>(total); p += kThreads) {
          store(p, static_cast<int>(stage[p]));
          if constexpr (!kRowPerCta) stage[p] = 0u;
        }
      }
      if constexpr (!kRowPerCta) clear_words(plane_gt, 2 * TopkLayout::kWindowWords);  // for the next row
      DI_TOPK_ASSERT(gt_base == (whole ? total : greater));
      tr.mark<5>();

      if constexpr (kSorted) {
        K::sort_and_store(sort_buf, total, tid, store);  // ---- 5. sorted output
      }

      // ---- padding
      pad_row<kElemBytes, kThreads>(a, r, static_cast<int>(total));
    }
    odd_row ^= 1u;
    // CTA 0's buffer and the next row's counter are reused by the next row (a cluster syncs before its CTAs exit)
    if constexpr (!kRowPerCta || kCluster) row_sync();
    tr.mark<6>();
    if constexpr (kRowPerCta) break;
  }
  if (tid == 0) tr.print("topk", rank(), first_ns);
}

}  // namespace deep_indexer
