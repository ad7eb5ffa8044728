// Shared-memory layout and digit schedule of the top-k kernel, shared by host and device.
#pragma once
#include <cstdint>

#include "host_device.hpp"

namespace deep_indexer {

struct TopkLayout {
  static constexpr int kMaxK = 2048;        // largest supported k
  static constexpr int kHistBins = 2048;    // widest radix digit: 11 bits
  static constexpr int kNumThreads = 512;   // one CTA per row
  static constexpr int kNumWarps = kNumThreads / 32;
  static constexpr int kVecBytes = 16;      // one uint4 of logits (or keys) per lane access

  // CTAs per SM the kernel is built for (64 registers per thread for 2): the unsorted kernels
  // may share an SM between two CTAs; the sorted ones (the bitonic sort) take 1.
  DI_HOST_DEVICE static constexpr int ctas_per_sm_max(bool sorted) { return sorted ? 1 : 2; }

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

  // Byte offsets inside dynamic shared memory (every region 16-byte aligned). The candidate lists
  // (kNumWarps x `cand_per_warp` uint32 element indices) and the row cache are sized per launch.
  DI_HOST_DEVICE constexpr unsigned hist_offset() const { return 0; }
  DI_HOST_DEVICE constexpr unsigned scratch_offset() const { return hist_offset() + kHistBins * 4; }
  static constexpr unsigned kScratchBytes = 2 * kNumWarps * 4 + 16 * 4;  // warp sums x2 + row scalars
  DI_HOST_DEVICE constexpr unsigned sort_offset() const { return scratch_offset() + kScratchBytes; }
  DI_HOST_DEVICE constexpr unsigned sort_bytes() const { return sorted ? kMaxK * 8u : 0u; }
  DI_HOST_DEVICE constexpr unsigned cand_offset() const { return sort_offset() + sort_bytes(); }
  DI_HOST_DEVICE static constexpr unsigned cand_bytes(int cand_per_warp) {
    return static_cast<unsigned>(cand_per_warp) * kNumWarps * 4u;
  }
  DI_HOST_DEVICE constexpr unsigned cache_offset(int cand_per_warp) const {
    return cand_offset() + cand_bytes(cand_per_warp);
  }
  DI_HOST_DEVICE constexpr unsigned fixed_bytes(int cand_per_warp = 0) const { return cache_offset(cand_per_warp); }
  // Dynamic shared memory for a row cache of `cache_vecs` 16-byte vectors of keys.
  DI_HOST_DEVICE constexpr unsigned smem_bytes(int cache_vecs, int cand_per_warp) const {
    return fixed_bytes(cand_per_warp) + static_cast<unsigned>(cache_vecs) * kVecBytes;
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
  int64_t table_stride;
  int table_cols;
  int block_size;
  const int* row_offset;  // may be null
  int* out;
  int64_t out_stride;
  void* out_values;       // may be null; logits dtype
  int64_t values_stride;
  int cache_vecs;         // 16-byte vectors of keys cached in shared memory per row
  int cand_per_warp;      // entries of each warp's candidate list (a multiple of 4)
};

}  // namespace deep_indexer
