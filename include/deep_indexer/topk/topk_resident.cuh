// topk_resident: top-k indices of rows short enough for one cluster to hold in registers (docs/topk.md).
//
// A cluster of C CTAs (kThreads threads, kCtasPerSm CTAs per SM) per row: clusters and the two- and four-CTA forms
// are launched a cluster (CTA) per row, the one-CTA-per-SM form grid-stride over rows. CTA c holds the
// row's 16-byte vectors [c * P, (c + 1) * P) (P = vecs_per_cta()), thread t of it the vecs_per_thread()
// consecutive ones from c * P + t * vecs_per_thread(), as order-preserving keys
// (radix::float_key / bf16_key), so threads and CTAs hold the row in column order.
// 1. Selection: a radix select over every key (float32 11/11/10 bits, bfloat16 11/5). Each CTA counts
//    its keys into its own histogram. One CTA: a block-wide search of the k-th key's bin (bfloat16's 32
//    bins of pass 1: warp 0 alone). A cluster:
//    the lanes holding each group of 64 bins send its total to every CTA, one warp of every CTA finds
//    the chosen group in the sums and sends its bins of that group to every CTA, and every CTA finds the same bin
//    (st.async into the peers' shared memory, an mbarrier per exchange; no cluster barrier).
//    Stops once that bin is taken whole.
// 2. Emission: each thread's (above, equal) counts, a block scan and the counts of the cluster's lower
//    CTAs (from the bins they sent) give every selected key its position: the number of selected keys
//    before it in column order (ties to the smaller column). The result is the buffered kernel's
//    (topk.cuh), bit for bit.
#pragma once
#include <cooperative_groups.h>

#include <cstdint>
#include <type_traits>

#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/topk/radix_select.cuh>
#include <deep_indexer/topk/topk_layout.hpp>
#include <deep_indexer/topk/topk_row.cuh>
#include <deep_indexer/common/trace.cuh>
#include <deep_indexer/common/varlen.cuh>

namespace deep_indexer {

// kKeysPerThread: keys held per thread (whole 16-byte vectors); kCluster: launched with clusters of
// 2-8 CTAs per row (else one CTA per row, no cluster exchange); kThreads: 256, 512 or 1024 per CTA (fewer
// threads with more keys each: the same keys per SM in fewer per-warp steps); kCtasPerSm: 1, or 2 (two
// rows per SM at once, half the registers each). Without clusters bfloat16 keys are packed two per register
// and transformed, counted and compared two at a time (SIMD on the halves). Unsorted output.
template <int kElemBytes, int kKeysPerThread, bool kCluster, int kThreads, int kCtasPerSm>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) topk_resident_kernel(const TopkArgs a) {
  namespace cg = cooperative_groups;
  using namespace topk_detail;
  constexpr TopkResidentLayout L{kElemBytes, kKeysPerThread, kThreads, kCtasPerSm, kCluster};
  constexpr TopkLayout kDigits{kElemBytes, false};  // the digit schedule
  constexpr int kWarps = L.warps();
  constexpr int kBins = TopkResidentLayout::kHistBins;
  constexpr int kGroups = TopkResidentLayout::kGroups;
  constexpr int kHistStride = TopkResidentLayout::kHistStride;
  static_assert(kHistStride % 4 == 0, "histograms 16-byte aligned");
  constexpr int kVec = L.vec();
  constexpr int kVecs = L.vecs_per_thread();
  constexpr int kPasses = L.num_passes();
  static_assert(kElemBytes == 4 || kElemBytes == 2, "float32 or bfloat16 logits");
  static_assert(kVecs >= 1 && kVecs * kVec == kKeysPerThread && kKeysPerThread <= 32, "whole vectors; key bits in a word");
  static_assert(kThreads >= TopkResidentLayout::kMinThreads && kThreads <= TopkResidentLayout::kMaxThreads &&
                    kThreads % 32 == 0, "a thread count the layout supports");
  // the bins a thread sums in the searches (consecutive, loaded as 8- or 16-byte words)
  constexpr int kBinsPerThread = kBins / kThreads;
  static_assert(kBins % kThreads == 0 && kBinsPerThread % 2 == 0 && kBinsPerThread <= 8, "2, 4 or 8 bins per thread");
  static_assert(kThreads * kKeysPerThread < 65536, "a CTA's (above, equal) counts are packed in 16 bits each");
  static_assert(TopkResidentLayout::ctas_per_sm_supported(kCtasPerSm, kThreads, kCluster),
                "two (512 threads) or four (256) CTAs per SM: one CTA per row");
  static_assert(kKeysPerThread <= TopkResidentLayout::max_keys_per_thread(kThreads, kCluster, kElemBytes, kCtasPerSm),
                "the register budget");
  constexpr bool kPacked = L.packed();  // key i in the 16-bit half i % 2 of word i / 2
  static_assert(!kPacked || (kElemBytes == 2 && !kCluster), "packed: bfloat16, one CTA per row");
  static_assert(!kPacked || kKeysPerThread % 2 == 0, "whole words of packed keys");
  constexpr int kKeyWords = kPacked ? kKeysPerThread / 2 : kKeysPerThread;
  constexpr uint32_t kAllValid = low_bits(kKeysPerThread);
  constexpr uint32_t kFullKeyMask = kElemBytes == 4 ? 0xFFFFFFFFu : 0xFFFFu;

  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t* hist = reinterpret_cast<uint32_t*>(smem + L.hist_offset());  // [kPasses][kHistStride], zero between rows
  uint32_t* warp_sums = reinterpret_cast<uint32_t*>(smem + L.warp_sums_offset());
  uint32_t* scalars = reinterpret_cast<uint32_t*>(smem + L.scalars_offset());
  uint32_t* recv_groups = reinterpret_cast<uint32_t*>(smem + L.recv_groups_offset());  // [kPasses][kMaxCluster][kGroups]
  uint32_t* recv_bins = reinterpret_cast<uint32_t*>(smem + L.recv_bins_offset());  // [kPasses][kMaxCluster][kGroupBins]
  uint64_t* mbar = reinterpret_cast<uint64_t*>(smem + L.mbar_offset());  // [2][kPasses]
  constexpr int kMaxC = TopkResidentLayout::kMaxCluster;
  constexpr int kGroupBins = TopkResidentLayout::kGroupBins;

  cg::cluster_group cluster = cg::this_cluster();
  const int num_ctas = kCluster ? static_cast<int>(cluster.num_blocks()) : 1;
  const int rank = kCluster ? static_cast<int>(cluster.block_rank()) : 0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // DI_KERNEL_TRACE: thread 0's first row, from the CTA's entry; marks 7 past the PDL wait, 0 keys in, 1 / 2
  // radix pass 0 / 1 done, 4 selection threshold, 3 output positions known, 5 emitted, 6 row end
  Tracer tr;
  tr.start();
  // NOTES: the peers send into this CTA's mbarriers only after the cluster barrier's wait (first pass)
  if constexpr (kCluster) {
    if (tid == 0) {
      for (int i = 0; i < 2 * kPasses; ++i) ptx::mbar_init(mbar + i, 1);
      ptx::fence_mbar_init();
    }
    ptx::cluster_arrive_relaxed();
  }
  bool cluster_ready = !kCluster;
  uint32_t phases = 0;  // bit i: the parity mbar[i] waits for next
  // histogram `pass`'s bins to zero: whole vectors for every thread, no predicate (the sinks past the bins
  // are never read)
  // NOTES: a row's pass p + 1 histogram is cleared after pass p's counts (the barrier that completes them
  // orders the clears too, and the previous row's reads of it ended with a barrier); pass 0's at the row's
  // end: no register for the passes a row ran
  auto clear_hist = [&](int pass) {
    uint32_t* const h = hist + pass * kHistStride;
    if constexpr (kBins / kThreads >= 4) {
      static_assert(kBins % (4 * kThreads) == 0, "whole 16-byte steps");
#pragma unroll
      for (int j = 0; j < kBins / (4 * kThreads); ++j) reinterpret_cast<uint4*>(h)[tid + j * kThreads] = make_uint4(0u, 0u, 0u, 0u);
    } else {
      static_assert(kBins == 2 * kThreads, "one 8-byte step");
      reinterpret_cast<uint2*>(h)[tid] = make_uint2(0u, 0u);
    }
  };
  clear_hist(0);
  __syncthreads();
  // PDL: every global read and write after the previous kernel (the shared-memory set-up above overlaps
  // its tail)
  ptx::grid_dependency_wait();
  tr.mark<7>();

  // NOTES: a special register (re-read where used; no division, no register held over a row)
  const int num_clusters = kCluster ? static_cast<int>(__clusterGridDimInClusters().x) : static_cast<int>(gridDim.x);
  // NOTES: clusters, and two or four CTAs per SM: the host launches a cluster (CTA) per row (grid = rows x C),
  // so the loop body runs once, with no next-row prefetch and no clears for a next row
  constexpr bool kRowPerCta = TopkResidentLayout::row_per_cta(kCluster, kCtasPerSm);
  for (int r = static_cast<int>(blockIdx.x) / num_ctas; r < a.num_rows; r += num_clusters) {
    // ---- the thread's keys; bit i of `valid`: key i is a column of the row. Without ks every row
    // starts at column 0, so its vectors are loaded before its range arrives.
    const int v0 = rank * kThreads * kVecs + tid * kVecs;  // < 2^31: the API bounds the columns
    // NOTES: slot mode without varlen: the lines of the table entries of the CTA's columns (a superset: its
    // vectors' columns, whatever the row's range) are asked of L1 by the last warp before any register is
    // loaded, so that the emission's cursor reads wait on L1, not L2 or DRAM. Only with one CTA per SM: in the
    // issue-bound forms of two and four it slowed the relative rows more than it sped slot rows (design-notes).
    constexpr bool kTableL1 = kCtasPerSm == 1;
    if (kTableL1 && a.index_mode == static_cast<int>(TopkIndexMode::kSlot) && a.indices == nullptr &&
        warp == kWarps - 1) {
      const int c_lo = rank * kThreads * kKeysPerThread;
      prefetch_table_l1(a, table_row_of(a, r), max(c_lo - kVec, 0), min(c_lo + kThreads * kKeysPerThread, a.num_cols),
                        lane);
    }
    uint4 raw[kVecs];
    auto load_vecs = [&](const uint4* vp, int nv) {
#pragma unroll
      for (int u = 0; u < kVecs; ++u) raw[u] = v0 + u < nv ? __ldg(vp + v0 + u) : make_uint4(0u, 0u, 0u, 0u);
    };
    const bool early = a.ks == nullptr;
    if (early) {
      const RowSpan<kElemBytes> whole_row(a, r);  // columns [0, num_cols)
      load_vecs(whole_row.vec, whole_row.num_vecs);
    }
    int ks_r, ke_r;
    load_row_range(a, r, ks_r, ke_r);
    // early: the same lo (0), mis and vectors
    const RowSpan<kElemBytes> row(a, r, ks_r, ke_r, std::bool_constant<kCtasPerSm >= 2>{});
    const int n = row.n;
    if (!early) load_vecs(row.vec, row.num_vecs);
    const uint32_t valid = row.valid_bits(v0, kKeysPerThread);  // the thread's keys are consecutive columns
    // NOTES: a thread holding no column of the row (whole warps past the end of a row shorter than the CTA's
    // share) skips every per-key step: its keys are 0, counted nowhere (pass 0 neither adds nor takes them
    // out) and never selected. A row's end is mostly a uniform branch per warp. Not in the 1024-thread
    // cluster form: it sits at its 64-register cap, and the branches cost it a spill.
    constexpr bool kSkipPadding = !(kCluster && kThreads == TopkResidentLayout::kMaxThreads);
    const bool has_keys = !kSkipPadding || valid != 0u;
    uint32_t kw[kKeyWords] = {};
    if (has_keys) {
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        if constexpr (kPacked) {  // a raw word holds keys 2j and 2j + 1 in its halves, as kw[j] does
          const uint32_t w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
          for (int c = 0; c < 4; ++c) kw[u * 4 + c] = radix::bf16_key_pair(w[c]);
        } else {
#pragma unroll
          for (int c = 0; c < kVec; ++c) kw[u * kVec + c] = radix::to_key<kElemBytes>(radix::raw_at<kElemBytes>(raw[u], c));
        }
      }
      // NOTES: keys outside the row become 0 (NaN's key): radix pass 0 counts them in bin 0, which
      // holds NaN alone, and takes them out again; later passes never match them (a chosen bin 0 ends
      // the selection after pass 0) and the emission masks them by `valid`.
      if (valid != kAllValid) {  // the thread holding the row's start or end
#pragma unroll
        for (int i = 0; i < kKeyWords; ++i) {
          if constexpr (kPacked)
            kw[i] &= ((valid >> (2 * i)) & 1u ? 0xFFFFu : 0u) | ((valid >> (2 * i + 1)) & 1u ? 0xFFFF0000u : 0u);
          else
            kw[i] = (valid >> i) & 1u ? kw[i] : 0u;
        }
      }
    }
    // key i (every index is a compile-time constant after unrolling)
    auto key = [&](int i) -> uint32_t {
      if constexpr (kPacked) return (i & 1) ? kw[i / 2] >> 16 : kw[i / 2] & 0xFFFFu;
      else return kw[i];
    };
    tr.mark<0>(static_cast<int>(key(0)));
    // NOTES: rows in turn (one CTA per SM) without ks: the CTA's next row (columns from 0) is asked of L2 while
    // this one is selected, a line per thread, the one of its first vector (a thread's <= 8 vectors start in
    // every line the CTA reads).
    static_assert(kVecs <= 8, "a thread's vectors start in every line of the CTA's share");
    if (!kRowPerCta && early && r + num_clusters < a.num_rows) {
      const RowSpan<kElemBytes> next(a, r + num_clusters);
      if (v0 < next.num_vecs) ptx::prefetch_l2(next.vec + v0);
    }

    // ---- 1. selection: the k-th key's resolved bits (`prefix`: the digits of the passes run); `take_eq`
    // keys equal to it are taken; `whole`: every key matching the prefix is taken (also when n <= k: all are)
    uint32_t prefix = 0, take_eq = 0;
    // cluster, warp 0: this lane's share of the lower CTAs' keys above the k-th key's bin, and in it
    uint32_t low_above = 0, low_equal = 0;
    bool whole = true;
    if (n > a.k) {
      uint32_t k_rem = static_cast<uint32_t>(a.k);
      whole = false;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        // NOTES: bin 0 of pass 0 holds NaN keys alone, all 0 (radix::float_key / bf16_key): a prefix of 0
        // after it is resolved (its keys are all equal), and the later passes would count the keys outside
        // the row (0) in it. Uniform over the cluster: every CTA found the same bin.
        if (whole || (pass > 0 && prefix == 0u)) break;
        const int shift = kDigits.digit_shift(pass);
        const uint32_t digit_mask = (1u << kDigits.digit_bits(pass)) - 1u;
        // the bits the earlier passes resolved (read from pass 1 on)
        const uint32_t mask = pass == 0 ? 0u : kFullKeyMask & ~((1u << kDigits.digit_shift(pass - 1)) - 1u);
        uint32_t* h = hist + pass * kHistStride;
        if (pass == 0) {
          static_assert(kDigits.digit_shift(0) + kDigits.digit_bits(0) == 8 * kElemBytes, "digit 0: the top bits");
          if (has_keys) {
#pragma unroll
            for (int i = 0; i < kKeysPerThread; ++i) atomicAdd(h + (key(i) >> shift), 1u);
            if (valid != kAllValid) atomicSub(h, static_cast<uint32_t>(kKeysPerThread - __popc(valid)));
          }
        } else {
          // the few keys in the k-th key's bin so far; keys outside the row (0) never match: the bin of
          // pass 0 is not 0 here. The others count into the warp's word past the bins (no branch per key;
          // an increment's lanes of one address are one update).
          if (kElemBytes == 4 && kDigits.digit_bits(pass) == 11) {  // float32 pass 1
            // NOTES: the bits above this digit are resolved: key ^ prefix is below 2^(shift + 11) exactly
            // when the key is in the bin, and then its digit is (key ^ prefix) >> shift; the byte offset
            // of its bin is taken with the digit's lower bits cleared (no scaling per key)
            static_assert(kElemBytes != 4 || kDigits.digit_shift(1) >= 2, "a bin's byte offset from the key");
            const uint32_t sink_bytes = static_cast<uint32_t>(kBins + warp) * 4u;
            const uint32_t below = (1u << shift) - 1u;
            if (has_keys) {
#pragma unroll
              for (int i = 0; i < kKeysPerThread; ++i) {
                const uint32_t bytes = min(((key(i) ^ prefix) & ~below) >> (shift - 2), sink_bytes);
                atomicAdd(reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(h) + bytes), 1u);
              }
            }
          } else if constexpr (kPacked) {  // bfloat16 pass 1 (the last, one CTA per row): two keys per step
            // NOTES: the top 11 bits are resolved and the prefix's low 5 are 0: a key is in the bin exactly
            // when key ^ prefix < 32, and that is its digit. The others count into bins 32 + warp and up
            // (never read: pass 1's search reads bins 0-31), one min per pair of keys.
            static_assert(kDigits.digit_shift(1) == 0 && kDigits.digit_bits(1) == 5 && kPasses == 2,
                          "bfloat16: 11 + 5 bits");
            static_assert(32 + kWarps <= kBins, "the sinks lie in the histogram");
            const uint32_t pair_prefix = prefix * 0x10001u, pair_sink = (32u + warp) * 0x10001u;
            if (has_keys) {
#pragma unroll
              for (int j = 0; j < kKeyWords; ++j) {
                const uint32_t d = __vminu2(kw[j] ^ pair_prefix, pair_sink);
                atomicAdd(h + (d & 0xFFFFu), 1u);
                atomicAdd(h + (d >> 16), 1u);
              }
            }
          } else if constexpr (kElemBytes == 4 && !kCluster) {  // float32 pass 2 (the last), one CTA per row
            // NOTES: the top 22 bits are resolved and the prefix's low 10 are 0: a key is in the bin exactly when
            // key ^ prefix < 1024, and that is its digit; the others count into bins 1024 and up (one min per
            // key, with the warp's word past the bins; fewer live values than a select of two addresses), which
            // the search reads as 0
            static_assert(kDigits.digit_shift(2) == 0 && kDigits.digit_bits(2) == 10 && kPasses == 3,
                          "float32: 11 + 11 + 10 bits");
            const uint32_t sink_bin = static_cast<uint32_t>(kBins + warp);
            if (has_keys) {
#pragma unroll
              for (int i = 0; i < kKeysPerThread; ++i) atomicAdd(h + min(key(i) ^ prefix, sink_bin), 1u);
            }
          } else {
            uint32_t* const sink = h + kBins + warp;
            if (has_keys) {
#pragma unroll
              for (int i = 0; i < kKeysPerThread; ++i)
                atomicAdd((key(i) & mask) == prefix ? h + ((key(i) >> shift) & digit_mask) : sink, 1u);
            }
          }
        }
        if (pass + 1 < kPasses) clear_hist(pass + 1);
        __syncthreads();  // the histogram is complete
        radix::KthBin kb;
        if constexpr (kCluster) {
          uint32_t own[kBinsPerThread];  // this thread's bins [kBinsPerThread * tid, kBinsPerThread * (tid + 1))
          if constexpr (kBinsPerThread == 2) {
            const uint2 w = reinterpret_cast<const uint2*>(h)[tid];
            own[0] = w.x;
            own[1] = w.y;
          } else {
#pragma unroll
            for (int j = 0; j < kBinsPerThread / 4; ++j) {
              const uint4 w = reinterpret_cast<const uint4*>(h)[tid * (kBinsPerThread / 4) + j];
              own[4 * j] = w.x;
              own[4 * j + 1] = w.y;
              own[4 * j + 2] = w.z;
              own[4 * j + 3] = w.w;
            }
          }
          // NOTES: two levels, pushed: the kLanesPerGroup consecutive lanes that hold a group of 64 bins sum
          // it, and lane i of them sends the total to CTA i; warp 0 of each CTA finds the k_rem-th key's
          // group g, sends its own 64 bins of g to every CTA and finds the bin in their sums. Every CTA
          // computes the same (g, bin). Warp 0 also counts the lower CTAs' keys above the bin and in it:
          // their emission offsets, without another exchange.
          constexpr int kLanesPerGroup = kGroupBins / kBinsPerThread;
          static_assert(kGroups == 32 && kLanesPerGroup >= kMaxC && kLanesPerGroup <= 32, "a lane per peer CTA in a group");
          uint32_t gs = 0;
#pragma unroll
          for (int j = 0; j < kBinsPerThread; ++j) gs += own[j];
          if constexpr (kLanesPerGroup == 32) {
            gs = __reduce_add_sync(radix::kFullMask, gs);
          } else {
#pragma unroll
            for (int off = kLanesPerGroup / 2; off >= 1; off >>= 1) gs += __shfl_xor_sync(radix::kFullMask, gs, off);
          }
          if (!cluster_ready) {
            ptx::cluster_wait();
            cluster_ready = true;
          }
          uint64_t* bar_g = mbar + pass;
          uint64_t* bar_b = mbar + kPasses + pass;
          if (const int to = lane % kLanesPerGroup; to < num_ctas) {
            const uint32_t dst = ptx::smem_addr(recv_groups + (pass * kMaxC + rank) * kGroups + tid / kLanesPerGroup);
            ptx::st_async_u32(ptx::map_cluster(dst, to), gs, ptx::map_cluster(ptx::smem_addr(bar_g), to));
          }
          if (warp == 0) {
            if (lane == 0) ptx::mbar_arrive_expect_tx(bar_g, static_cast<uint32_t>(num_ctas * kGroups * 4));
            ptx::mbar_wait(bar_g, (phases >> pass) & 1u);
            const uint32_t* rg = recv_groups + pass * kMaxC * kGroups;
            uint32_t t = 0, t_low = 0;
            // NOTES: every slot is loaded (back to back, no branch per CTA); the ones of absent CTAs are dropped
            uint32_t v[kMaxC];
#pragma unroll
            for (int q = 0; q < kMaxC; ++q) v[q] = rg[q * kGroups + lane];
#pragma unroll
            for (int q = 0; q < kMaxC; ++q) {
              t += q < num_ctas ? v[q] : 0u;
              t_low += q < rank ? v[q] : 0u;
            }
            const uint32_t incl = ptx::warp_suffix_sum(t);  // keys in groups >= lane
            const uint32_t g_hit = __ballot_sync(radix::kFullMask, incl - t < k_rem && k_rem <= incl);
            const int g = __ffs(g_hit) - 1;
            const uint32_t g_above = __shfl_sync(radix::kFullMask, incl - t, g);
            const uint2 mine = reinterpret_cast<const uint2*>(h)[(kGroupBins / 2) * g + lane];
            const uint32_t dst = ptx::smem_addr(recv_bins + (pass * kMaxC + rank) * kGroupBins + 2 * lane);
#pragma unroll
            for (int q = 0; q < kMaxC; ++q)
              if (q < num_ctas)
                ptx::st_async_v2(ptx::map_cluster(dst, static_cast<uint32_t>(q)), mine,
                                 ptx::map_cluster(ptx::smem_addr(bar_b), static_cast<uint32_t>(q)));
            if (lane == 0) ptx::mbar_arrive_expect_tx(bar_b, static_cast<uint32_t>(num_ctas * kGroupBins * 4));
            ptx::mbar_wait(bar_b, (phases >> (kPasses + pass)) & 1u);
            const uint32_t* rb = recv_bins + pass * kMaxC * kGroupBins + 2 * lane;
            uint2 b = make_uint2(0u, 0u), b_low = make_uint2(0u, 0u);
            uint2 o[kMaxC];
#pragma unroll
            for (int q = 0; q < kMaxC; ++q) o[q] = *reinterpret_cast<const uint2*>(rb + q * kGroupBins);
#pragma unroll
            for (int q = 0; q < kMaxC; ++q) {
              const bool in = q < num_ctas, low = q < rank;
              b.x += in ? o[q].x : 0u;
              b.y += in ? o[q].y : 0u;
              b_low.x += low ? o[q].x : 0u;
              b_low.y += low ? o[q].y : 0u;
            }
            const uint32_t pair = b.x + b.y;
            const uint32_t incl2 = ptx::warp_suffix_sum(pair) + g_above;  // keys in bins >= 64 g + 2 lane
            const uint32_t above2 = incl2 - pair;
            const bool upper = k_rem <= above2 + b.y;  // at the hit lane: bin 2 lane + 1 holds the k_rem-th key
            const int f = __ffs(__ballot_sync(radix::kFullMask, above2 < k_rem && k_rem <= incl2)) - 1;
            if (lane == f) {
              scalars[0] = kGroupBins * g + 2 * lane + (upper ? 1 : 0);
              scalars[1] = upper ? above2 : above2 + b.y;
              scalars[2] = upper ? b.y : b.x;
            }
            // the lower CTAs' keys in groups above g, in g above the chosen bin, and in that bin
            // (summed over the lanes after the selection)
            const bool upper_f = __shfl_sync(radix::kFullMask, upper, f);
            low_above += (lane > g ? t_low : 0u) +
                         (lane > f ? b_low.x + b_low.y : lane == f && !upper_f ? b_low.y : 0u);
            low_equal = lane == f ? (upper_f ? b_low.y : b_low.x) : 0u;
          }
          phases ^= (1u << pass) | (1u << (kPasses + pass));
          __syncthreads();
          kb = {scalars[0], scalars[1], scalars[2]};
        } else if (kPacked && pass == 1) {  // 32 bins: warp 0 alone
          kb = radix::find_kth_bin_warp0<false>([&](int b) { return h[b]; }, k_rem, scalars);
        } else {
          // float32 pass 2 (one CTA): its 10-bit digit's bins alone (keys outside the bin may lie in the others).
          // NOTES: a search over 1024 bins (a find_kth_bin of its own) spills the 24-key 512-thread form
          const bool ten_bits = kElemBytes == 4 && pass == 2;
          auto bin_count = [&](int b) { return ten_bits && b >= (1 << kDigits.digit_bits(2)) ? 0u : h[b]; };
          kb = radix::find_kth_bin<kThreads, kBins, false>(bin_count, k_rem, warp_sums, scalars);
        }
        prefix |= kb.bin << shift;
        k_rem -= kb.above;
        whole = k_rem == kb.count;
        if (pass == 0) tr.mark<1>();
        if (pass == 1) tr.mark<2>();
      }
      take_eq = k_rem;
    }
    const uint32_t total = static_cast<uint32_t>(min(a.k, n));
    if (kCluster && warp == 0 && n > a.k) {  // read by every thread after the emission's barrier
      const uint32_t lower_above = __reduce_add_sync(radix::kFullMask, low_above);
      const uint32_t lower_equal = __reduce_add_sync(radix::kFullMask, low_equal);
      if (lane == 0) {
        scalars[TopkResidentLayout::kScalarLowerAbove] = whole ? lower_above + lower_equal : lower_above;
        scalars[TopkResidentLayout::kScalarLowerEqual] = whole ? 0u : lower_equal;
      }
    }
    tr.mark<4>();

    // ---- 2. emission: bit i of gt / eq: key i is above the k-th key (taken) / equal to it. The
    // bin's keys lie in [prefix, hi]; with `whole` they are all taken. Without it, either every pass ran
    // (the last digit ends at bit 0: hi = prefix) or pass 0 chose bin 0, whose keys are all 0 (NaN).
    static_assert(kDigits.digit_shift(kPasses - 1) == 0, "the last digit: the key's lowest bits");
    const uint32_t hi = prefix != 0u ? prefix : (1u << kDigits.digit_shift(0)) - 1u;
    uint32_t gt = 0, eq = 0;
    if (has_keys) {
      if constexpr (kPacked) {  // two keys per compare (the halves of kw[j]: keys 2j and 2j + 1)
        // bit i: key i >= bound (at_least) or <= bound (one VIMNMX.U16x2 per pair, its predicates)
        auto compare_bits = [&](uint32_t bound, auto at_least) {
          const uint32_t pair_bound = bound * 0x10001u;
          uint32_t bits = 0;
#pragma unroll
          for (int j = 0; j < kKeyWords; ++j) {
            bool hi, lo;
            if constexpr (decltype(at_least)::value) __vibmax_u16x2(kw[j], pair_bound, &hi, &lo);
            else __vibmin_u16x2(kw[j], pair_bound, &hi, &lo);
            bits |= (lo ? 1u : 0u) << (2 * j) | (hi ? 1u : 0u) << (2 * j + 1);
          }
          return bits;
        };
        const uint32_t ge = compare_bits(prefix, std::true_type{}) & valid;
        if (whole) {
          gt = ge;
        } else {
          const uint32_t le = compare_bits(hi, std::false_type{});
          gt = ge & ~le;
          eq = ge & le;
        }
      } else if (whole) {  // one compare per key (most rows)
#pragma unroll
        for (int i = 0; i < kKeysPerThread; ++i) gt |= static_cast<uint32_t>(key(i) >= prefix) << i;
        gt &= valid;
      } else {
        uint32_t ge = 0;
#pragma unroll
        for (int i = 0; i < kKeysPerThread; ++i) {
          ge |= static_cast<uint32_t>(key(i) >= prefix) << i;
          gt |= static_cast<uint32_t>(key(i) > hi) << i;
        }
        ge &= valid;
        gt &= valid;
        eq = ge & ~gt;
      }
    }
    const bool slot_mode = a.index_mode == static_cast<int>(TopkIndexMode::kSlot);
    if (slot_mode && a.indices != nullptr && warp == 0) {  // a varlen row's block-table row, read after the barrier
      const int first = varlen::run_first_row(a.indices, r, lane);
      if (lane == 0) scalars[TopkResidentLayout::kScalarTableRow] = static_cast<uint32_t>(first);
    }
    const uint32_t mine = __popc(gt) | (__popc(eq) << 16);
    const uint32_t incl = ptx::warp_prefix_sum(mine);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    uint32_t all;
    const uint32_t before = incl - mine + radix::sum_of_warps_below<kWarps>(warp_sums, all);
    uint32_t g = before & 0xFFFFu, e = before >> 16;  // selected-above / equal keys before this thread's
    if constexpr (kCluster) {
      if (n > a.k) {
        g += scalars[TopkResidentLayout::kScalarLowerAbove];
        e += scalars[TopkResidentLayout::kScalarLowerEqual];
      } else {  // every valid key is taken: the lower CTAs' valid keys
        const int below = rank * kThreads * kKeysPerThread - row.mis;
        g += static_cast<uint32_t>(min(max(below, 0), n));
      }
    }
    tr.mark<3>();
    const int64_t seq = !slot_mode ? 0
                        : a.indices != nullptr ? static_cast<int64_t>(scalars[TopkResidentLayout::kScalarTableRow])
                                               : table_row_of(a, r);
    const uint32_t offset = a.row_offset == nullptr ? 0u : static_cast<uint32_t>(__ldg(a.row_offset + r));
    const int col0 = v0 * kVec - row.mis;  // the column of key 0 (relative to lo)
    int* out_row = a.out + static_cast<int64_t>(r) * a.out_stride;
    // NOTES: taken are the keys above the k-th key and, of those equal to it, the first take_eq in
    // column order (e before this thread's): selected key j of this thread (in column order) is
    // output entry base + j.
    uint32_t eq_taken = eq;
    const uint32_t room = e < take_eq ? take_eq - e : 0u;
    while (static_cast<uint32_t>(__popc(eq_taken)) > room) eq_taken &= ~(0x80000000u >> __clz(eq_taken));  // rare
    uint32_t sel = gt | eq_taken;
    const int base = static_cast<int>(g + min(e, take_eq));
    // NOTES: where a thread stores 4 or more entries on average (and no values), the entries are staged in pass
    // 1's histogram (read again only after the next row's pass 0 clears it; slot entries mapped through the block
    // table first) and stored in coalesced runs: a thread's own run of stores touches a sector per entry. Entry
    // p sits at p ^ (p / 32 % 32): a thread's run is consecutive, and without the swizzle lanes whose runs start
    // a multiple of 32 words apart hit one bank.
    constexpr bool kCanStage = !kCluster && 4 * kThreads <= TopkLayout::kMaxK;
    static_assert(TopkLayout::kMaxK <= kBins, "a row's entries fit a histogram");
    const bool plain = !slot_mode && a.out_values == nullptr;  // the column plus a constant
    const bool staged = kCanStage && plain && total >= 4u * kThreads;
    const bool staged_slots = kCanStage && slot_mode && a.out_values == nullptr && total >= 4u * kThreads;
    auto staged_entry = [&](uint32_t p) -> uint32_t& { return hist[kHistStride + (p ^ ((p >> 5) & 31u))]; };
    auto store_staged = [&]() {  // every thread's entries staged: the row's k entries, -1 past `total`
      __syncthreads();
      // NOTES: not unrolled: the unrolled steps' addresses were hoisted out of the row loop and spilled
#pragma unroll 1
      for (uint32_t p = tid; p < static_cast<uint32_t>(a.k); p += kThreads)
        out_row[p] = p < total ? static_cast<int>(staged_entry(p)) : -1;
    };
    if (plain) {
      const bool absolute = a.index_mode == static_cast<int>(TopkIndexMode::kAbsolute);
      const uint32_t add = (absolute ? static_cast<uint32_t>(row.lo) : 0u) + offset;
      const uint32_t c0 = static_cast<uint32_t>(col0) + add;
      if (staged) {
        for (uint32_t p = static_cast<uint32_t>(base); sel != 0u; ++p) {
          staged_entry(p) = c0 + static_cast<uint32_t>(__ffs(sel) - 1);
          sel &= sel - 1u;
        }
        store_staged();
      } else {
        int* dst = out_row + base;  // advanced per store (no index arithmetic per store)
        while (sel != 0u) {
          *dst++ = static_cast<int>(c0 + static_cast<uint32_t>(__ffs(sel) - 1));
          sel &= sel - 1u;
        }
      }
    } else if (staged_slots) {
      SlotCursor cursor(a, seq);
      for (uint32_t p = static_cast<uint32_t>(base); sel != 0u; ++p) {
        staged_entry(p) = static_cast<uint32_t>(cursor.map(a, col0 + __ffs(sel) - 1, offset));
        sel &= sel - 1u;
      }
      store_staged();
    } else {
      SlotCursor cursor(a, seq);  // slot mode
      for (int j = 0; sel != 0u; ++j) {
        const int c = col0 + __ffs(sel) - 1;
        store_entry<kElemBytes>(a, out_row, r, row.lo, base + j, c,
                                slot_mode ? cursor.map(a, c, offset) : entry_index(a, row.lo, seq, offset, c));
        sel &= sel - 1u;
      }
    }
    if (rank == 0 && !staged && !staged_slots) pad_row<kElemBytes, kThreads>(a, r, static_cast<int>(total));
    tr.mark<5>();
    if constexpr (!kRowPerCta) {
      // NOTES: every read of this row's histograms is done (only this CTA reads them): the selection
      // ended with a barrier.
      clear_hist(0);
      __syncthreads();  // the clears, warp sums and scalars before the next row
    }
    tr.mark<6>();
    if constexpr (kRowPerCta) break;
  }
  // NOTES: no CTA reads another's shared memory, and every st.async into a CTA is waited for by it
  if (!cluster_ready) ptx::cluster_wait();
  if (tid == 0) tr.print("topk", rank, 0);
}

}  // namespace deep_indexer
