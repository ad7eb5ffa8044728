// Shared-memory layout, sampling rule and arguments of the top-k kernel, shared by host and device.
#pragma once
#include <cstdint>

#include <deep_indexer/common/host_device.hpp>

namespace deep_indexer {

struct TopkLayout {
  static constexpr int kMaxK = 2048;        // largest supported k
  static constexpr int kHistBins = 2048;    // widest radix digit: 11 bits
  static constexpr int kNumThreads = 512;   // two CTAs per SM
  static constexpr int kWideThreads = 1024; // one CTA per SM (launches of at most one CTA per SM)
  static constexpr int kMaxWarps = kWideThreads / 32;
  // 64 registers per thread either way; smem_bytes() <= half an SM
  DI_HOST_DEVICE static constexpr int ctas_per_sm(int threads) { return threads == kWideThreads ? 1 : 2; }
  // A cluster (CTA) per row, the grid rows x C, the kernel's loop body run once: unsorted output on wide CTAs or
  // clusters (which the heuristic takes only when every row gets one at once). Else rows in turn.
  DI_HOST_DEVICE static constexpr bool row_per_cta(bool sorted, bool cluster, int threads) {
    return !sorted && (cluster || threads == kWideThreads);
  }
  static constexpr int kVecBytes = 16;      // one uint4 of logits per lane access
  static constexpr int kFilterVecs = 2;     // 16-byte vectors per thread per filter step (and one ahead)
  // Survivor buffer: (key, column) pairs of the keys at or above the row's threshold.
  static constexpr int kCandCap = 8192;
  // NOTES: bfloat16 rows of at most kPackedMaxCols columns keep a survivor in one word: its raw bits (its key
  // once converted) in the high half, its position from the row's first 16-byte vector (column + the start's
  // misalignment, at most 7) in the low half, which fits 16 bits. Where every row's column 0 is 16-byte
  // aligned, a position is below the row's end (column + start % 8 <= num_cols - 1, whatever the start),
  // so rows fit up to 65536 columns.
  static constexpr int kPackedPositions = 65536;  // positions a 16-bit half holds
  static constexpr int kPackedMaxCols = kPackedPositions - (kVecBytes / 2 - 1);
  DI_HOST_DEVICE static constexpr bool packed_fits(int elem_bytes, int64_t num_cols, bool rows_aligned) {
    return elem_bytes == 2 && num_cols <= (rows_aligned ? kPackedPositions : kPackedMaxCols);
  }
  // Rows longer than this take the threshold sample; shorter ones keep every key (they fit the
  // buffer). n > kNumThreads * 8 gives every sample slot a vector of its own.
  static constexpr int kSampleMinKeys = kNumThreads * 8;
  static_assert(kSampleMinKeys <= kCandCap, "unsampled rows fit the buffer");
  // Emission: the row's columns in windows of kWindow, one bit per column in two planes.
  static constexpr int kWindow = 32768;
  static constexpr int kWindowWords = kWindow / 32;
  static_assert(kWindow < 65536, "per-window counts are packed in 16 bits");
  static constexpr int kMaxClusterCtas = 8;

  int elem_bytes;  // 4: float32 (32-bit keys), 2: bfloat16 (16-bit keys)
  bool sorted;     // a [kMaxK] uint64 sort buffer

  DI_HOST_DEVICE constexpr int vec() const { return kVecBytes / elem_bytes; }
  // Digit schedule, most significant first: float32 11/11/10 bits, bfloat16 11/5 bits.
  DI_HOST_DEVICE constexpr int num_passes() const { return elem_bytes == 4 ? 3 : 2; }
  DI_HOST_DEVICE constexpr int digit_shift(int pass) const {
    return elem_bytes == 4 ? (pass == 0 ? 21 : pass == 1 ? 10 : 0) : (pass == 0 ? 5 : 0);
  }
  DI_HOST_DEVICE constexpr int digit_bits(int pass) const {
    return elem_bytes == 4 ? (pass == 2 ? 10 : 11) : (pass == 0 ? 11 : 5);
  }

  // Threshold sample of a row of n > kSampleMinKeys valid keys: vectors per thread, then the rank j
  // (1 = largest) of the sample key taken as the threshold. The row's k-th largest key lies above
  // the sample's j-th only if more than j sample keys are >= it: mu = k * m / n expected, j is mu
  // plus 6 standard deviations plus 8, so a row rarely keeps fewer than k keys; it keeps about
  // n * j / m (for n = 30K, k = 2048: ~3.3K), which must fit kCandCap. Both outcomes are checked.
  // At most 2 vectors per thread (4096 float32 keys), 1 for bfloat16 (4096 keys; registers).
  DI_HOST_DEVICE constexpr int max_sample_vecs() const { return elem_bytes == 4 ? 2 : 1; }
  DI_HOST_DEVICE constexpr int sample_vecs_per_thread(int64_t n) const {
    const int64_t s = n / (32 * static_cast<int64_t>(kNumThreads) * vec());
    return s < 1 ? 1 : s > max_sample_vecs() ? max_sample_vecs() : static_cast<int>(s);
  }
  // floor(sqrt(x)) for x < 2^24 (exact in float; the correction covers sqrtf rounding up).
  DI_HOST_DEVICE static uint32_t isqrt(uint32_t x) {
#ifdef __CUDA_ARCH__
    uint32_t r = static_cast<uint32_t>(sqrtf(static_cast<float>(x)));
#else
    uint32_t r = 0;
    for (uint32_t b = 1u << 11; b != 0; b >>= 1)
      if ((r + b) * (r + b) <= x) r += b;
#endif
    return r * r > x ? r - 1 : r;
  }
  // m_keys: keys in the sample (the rank is clamped below it, leaving room for the row's ends).
  DI_HOST_DEVICE static uint32_t sample_rank(int k, int n, uint32_t m_keys, int vec_keys) {
    const uint32_t mu = static_cast<uint32_t>(k) * m_keys / static_cast<uint32_t>(n);  // k * m_keys <= 2^11 * 2^12
    const uint32_t j = mu + 6 * isqrt(mu) + 9;
    const uint32_t cap = m_keys - 2 * static_cast<uint32_t>(vec_keys);
    return j < cap ? j : cap;
  }

  // Threshold sample: the one-pass search starts this many values of the keys' top 16 bits below the previous
  // row's kmin (2047 bins of one value: about 8 binades either side).
  static constexpr uint32_t kSampleFloorBelow = 1024;
  // The sample's first-digit bin edge alone is threshold enough when the keys it keeps, about
  // n * count_ge / m (count_ge: sample keys in or above the bin), are at most half the buffer.
  DI_HOST_DEVICE static constexpr bool coarse_sample_enough(uint32_t count_ge, int n, uint32_t m_keys) {
    return static_cast<uint64_t>(count_ge) * static_cast<uint32_t>(n) <= static_cast<uint64_t>(kCandCap / 2) * m_keys;
  }

  // Byte offsets inside dynamic shared memory (every region 16-byte aligned).
  // Two histograms: a radix pass counts into one while the other is cleared for the next pass.
  DI_HOST_DEVICE constexpr unsigned hist_offset() const { return 0; }
  DI_HOST_DEVICE constexpr unsigned scratch_offset() const { return hist_offset() + 2 * kHistBins * 4; }
  static constexpr unsigned kScratchBytes = 2 * kMaxWarps * 4 + 16 * 4;  // warp sums (2 x warps) + row scalars
  static constexpr int kScalarCount = 4;     // row scalar: the survivor counter of even rows
  static constexpr int kScalarCountOdd = 7;  // row scalar: the survivor counter of odd rows
  static constexpr int kScalarTableRow = 5;  // row scalar: a varlen row's block-table row (slot mode)
  static constexpr int kScalarSink = 6;      // row scalar: where radix passes count the keys they skip
  DI_HOST_DEVICE constexpr unsigned cand_key_offset() const { return scratch_offset() + kScratchBytes; }
  DI_HOST_DEVICE constexpr unsigned cand_col_offset() const { return cand_key_offset() + kCandCap * 4; }
  DI_HOST_DEVICE constexpr unsigned plane_offset() const { return cand_col_offset() + kCandCap * 4; }
  DI_HOST_DEVICE constexpr unsigned sort_offset() const { return plane_offset() + 2 * kWindowWords * 4; }
  DI_HOST_DEVICE constexpr unsigned sort_bytes() const { return sorted ? kMaxK * 8u : 0u; }
  DI_HOST_DEVICE constexpr unsigned smem_bytes() const { return sort_offset() + sort_bytes(); }
};

// The resident form (topk_resident.cuh): a cluster of C CTAs of `threads` threads per row (one CTA per
// SM), each thread holding keys_per_thread consecutive keys of the row in registers; no survivor buffer,
// no bitmap planes.
struct TopkResidentLayout {
  static constexpr int kMaxThreads = 1024;
  static constexpr int kMinThreads = 256;  // a group of 64 bins spans >= kMaxCluster lanes (one per peer CTA)
  static constexpr int kMaxWarps = kMaxThreads / 32;
  static constexpr int kHistBins = TopkLayout::kHistBins;
  static constexpr int kMaxCluster = TopkLayout::kMaxClusterCtas;  // portable cluster sizes
  static constexpr int kGroupBins = 64;      // a cluster's histograms are combined in groups of 64 bins
  static constexpr int kGroups = kHistBins / kGroupBins;  // one per lane of the warp that searches them
  // a radix pass's histogram: kHistBins bins, then a word per warp that counts the keys outside the k-th
  // key's bin (never read)
  static constexpr int kHistStride = kHistBins + kMaxWarps;
  // scalars: [0, 3) the k-th key's bin, [4] a varlen row's block-table row, [5] / [6] the lower CTAs' keys
  // above / equal to the k-th key
  static constexpr int kScalarTableRow = 4;
  static constexpr int kScalarLowerAbove = 5;
  static constexpr int kScalarLowerEqual = 6;
  // Register budget (65536 / (threads * ctas_per_sm) registers per thread): the keys a thread may hold, as
  // measured without spills at 64 registers (1024 threads or two 512-thread CTAs per SM): 16 words of packed
  // bfloat16 keys; float32 keys 24 at 512 threads, 20 at 1024 or 256 (four per SM); 8 keys with the cluster
  // exchange's state. Fewer threads per SM raise it in proportion. At most kMaxKeysPerThread (a bit per key
  // in a word; 31 unpacked).
  static constexpr int kMaxKeysPerThread = 32;
  // CTAs per SM: one (any form), or two (512 threads) or four (256) without clusters, one CTA per row
  DI_HOST_DEVICE static constexpr bool ctas_per_sm_supported(int ctas_per_sm, int threads, bool cluster) {
    return ctas_per_sm == 1 || ((ctas_per_sm == 2 || (ctas_per_sm == 4 && threads == 256)) && !cluster);
  }
  // A cluster (CTA) per row, the grid rows x C, the kernel's loop body run once: clusters and the two- and
  // four-CTA forms. Else (one CTA per SM) rows in turn, the next row asked of L2.
  DI_HOST_DEVICE static constexpr bool row_per_cta(bool cluster, int ctas_per_sm) {
    return cluster || ctas_per_sm >= 2;
  }
  DI_HOST_DEVICE static constexpr int max_keys_per_thread(int threads, bool cluster, int elem_bytes = 4,
                                                          int ctas_per_sm = 1) {
    const bool two_keys_a_word = TopkResidentLayout{elem_bytes, 0, threads, ctas_per_sm, cluster}.packed();
    const int at_64_registers = cluster ? 8 : two_keys_a_word ? 2 * 16 : threads == 512 ? 24 : 20;
    const int budget = at_64_registers * kMaxThreads / threads / ctas_per_sm;
    const int most = two_keys_a_word ? kMaxKeysPerThread : kMaxKeysPerThread - 1;
    return budget < most ? budget : most;
  }

  // The most keys per thread the heuristic gives a one-CTA-per-SM form without clusters unless forced: the
  // 16 registers of keys (at 1024 threads) it was measured with (heuristics_sm90.hpp).
  DI_HOST_DEVICE static constexpr int default_one_cta_keys(int threads) { return 16 * kMaxThreads / threads; }

  int elem_bytes;        // 4: float32, 2: bfloat16
  int keys_per_thread;   // whole 16-byte vectors per thread, <= max_keys_per_thread (a bit per key)
  int threads;           // 256, 512 or 1024
  int ctas_per_sm = 1;   // 1: one CTA per SM (launch_smem_bytes pads it); 2 (512 threads) or 4 (256): rows per SM at once
  bool cluster = false;  // a cluster of CTAs per row

  // bfloat16 keys two per 32-bit register, worked on two at a time (every form without clusters)
  DI_HOST_DEVICE constexpr bool packed() const { return elem_bytes == 2 && !cluster; }

  DI_HOST_DEVICE constexpr int vec() const { return TopkLayout::kVecBytes / elem_bytes; }
  DI_HOST_DEVICE constexpr int vecs_per_thread() const { return keys_per_thread / vec(); }
  DI_HOST_DEVICE constexpr int num_passes() const { return TopkLayout{elem_bytes, false}.num_passes(); }
  // 16-byte vectors a CTA holds; a row of `vecs` vectors needs ceil(vecs / that) CTAs.
  DI_HOST_DEVICE constexpr int warps() const { return threads / 32; }
  DI_HOST_DEVICE constexpr int64_t vecs_per_cta() const { return static_cast<int64_t>(threads) * vecs_per_thread(); }

  // Byte offsets inside dynamic shared memory: one histogram per radix pass, warp sums, row scalars;
  // cluster form, per pass: every CTA's group totals [kMaxCluster][kGroups] and its bins of the chosen
  // group [kMaxCluster][kGroupBins], sent by the CTAs (st.async); mbarriers: [pass] totals, [passes + pass] bins.
  DI_HOST_DEVICE constexpr unsigned hist_offset() const { return 0; }
  DI_HOST_DEVICE constexpr unsigned warp_sums_offset() const { return hist_offset() + num_passes() * kHistStride * 4; }
  DI_HOST_DEVICE constexpr unsigned scalars_offset() const { return warp_sums_offset() + kMaxWarps * 4; }
  DI_HOST_DEVICE constexpr unsigned recv_groups_offset() const { return scalars_offset() + 8 * 4; }
  DI_HOST_DEVICE constexpr unsigned recv_bins_offset() const {
    return recv_groups_offset() + num_passes() * kMaxCluster * kGroups * 4;
  }
  DI_HOST_DEVICE constexpr unsigned mbar_offset() const {
    return recv_bins_offset() + num_passes() * kMaxCluster * kGroupBins * 4;  // 8-byte aligned
  }
  DI_HOST_DEVICE constexpr unsigned smem_bytes() const { return mbar_offset() + 2 * num_passes() * 8; }
  // NOTES: launched with more than half an SM's shared memory (228 KiB on SM90, 1 KiB of it reserved per
  // CTA), so that the scheduler places one CTA per SM whatever the registers allow: a second CTA on an SM
  // would halve both rows' issue slots. The two-CTA form asks for its own bytes only: its launch bounds
  // (64 registers per thread at 512 threads) fit two CTAs in an SM's register file.
  static constexpr unsigned kOneCtaPerSmBytes = 116 * 1024;
  DI_HOST_DEVICE constexpr unsigned launch_smem_bytes() const {
    return ctas_per_sm >= 2 || smem_bytes() > kOneCtaPerSmBytes ? smem_bytes() : kOneCtaPerSmBytes;
  }
};

// Index conventions of the output (see docs/topk.md).
enum class TopkIndexMode : int { kRelative = 0, kAbsolute = 1, kSlot = 2 };

// Kernel arguments, passed by value (one definition for host and device).
struct TopkArgs {
  const void* logits;
  int64_t row_stride;  // elements
  int64_t num_rows;
  int num_cols;
  int range_next_n;    // rows per entry of ks/ke (ke[g] - range_next_n + i + 1 is row (g, i)'s end)
  int table_next_n;    // rows per block-table row / sequence
  const int* ks;       // may be null (0)
  const int* ke;
  int k;
  int index_mode;      // TopkIndexMode
  const int* block_table;
  const int* indices;     // may be null; varlen (next_n = 1): a row's block-table row is the first row
                          // of its run of equal request ids (varlen.cuh)
  int64_t table_stride;
  int table_cols;
  int block_size;
  const int* row_offset;  // may be null
  int* out;
  int64_t out_stride;
  void* out_values;       // may be null; logits dtype
  int64_t values_stride;
  int block_shift;         // slot mode: log2(block_size) when it is a power of two, else -1
};

}  // namespace deep_indexer
