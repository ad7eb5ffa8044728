// Per-row helpers shared by the top-k kernels (topk.cuh, topk_resident.cuh): a row's valid columns and
// vectors, and the store of a selected column in the requested index convention (docs/topk.md).
#pragma once
#include <cstdint>
#include <type_traits>

#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/topk/topk_layout.hpp>

namespace deep_indexer {
namespace topk_detail {

// The c low bits set, c in [0, 32].
DI_HOST_DEVICE constexpr uint32_t low_bits(int c) { return c >= 32 ? ~0u : (1u << c) - 1u; }

// The (ks, ke) entries of row r.
__device__ __forceinline__ void load_row_range(const TopkArgs& a, int64_t r, int& ks_v, int& ke_v) {
  const int g = a.range_next_n == 1 ? static_cast<int>(r) : static_cast<int>(r) / a.range_next_n;  // no division per row
  ks_v = a.ks == nullptr ? 0 : __ldg(a.ks + g);
  ke_v = __ldg(a.ke + g);
}

// Row r's valid columns [lo, lo + n) (rows < 2^31: checked by the API) and its 16-byte vectors.
// NOTES: element j of the row sits at lane (j + mis) % kVec of the 16-byte aligned vector
// (j + mis) / kVec; aligned vectors never cross a page, so the few columns outside [lo, hi) they
// hold are read (never used) safely.
template <int kElemBytes>
struct RowSpan {
  static constexpr int kVec = 16 / kElemBytes;
  int lo, n, mis, num_vecs;
  const uint4* vec;
  // kNarrow: the same end computed in 32 bits (ke_r - lo_r and ke_r - d cannot overflow where taken).
  // NOTES: only a register-allocation choice; each kernel takes the form that compiles without spills.
  template <bool kNarrow = false>
  __device__ __forceinline__ RowSpan(const TopkArgs& a, int r, int ks_r, int ke_r, std::bool_constant<kNarrow> = {}) {
    const int i_in = a.range_next_n == 1 ? 0 : r % a.range_next_n;
    const int lo_r = min(max(ks_r, 0), a.num_cols);
    int hi;
    if constexpr (kNarrow) {
      const int d = a.range_next_n - 1 - i_in;  // >= 0
      hi = (ke_r < lo_r || ke_r - lo_r < d) ? lo_r : min(ke_r - d, a.num_cols);
    } else {
      const int64_t hi64 = static_cast<int64_t>(ke_r) - a.range_next_n + i_in + 1;
      hi = static_cast<int>(min(max(hi64, static_cast<int64_t>(lo_r)), static_cast<int64_t>(a.num_cols)));
    }
    init(a, r, lo_r, hi - lo_r);
  }
  // Every column of row r: [0, num_cols).
  __device__ __forceinline__ RowSpan(const TopkArgs& a, int r) { init(a, r, 0, a.num_cols); }
  __device__ __forceinline__ void init(const TopkArgs& a, int r, int lo_r, int n_r) {
    lo = lo_r;
    n = n_r;
    const uint8_t* row_bytes =
        static_cast<const uint8_t*>(a.logits) + (static_cast<int64_t>(r) * a.row_stride + lo) * kElemBytes;
    mis = static_cast<int>((reinterpret_cast<uintptr_t>(row_bytes) & 15u) / kElemBytes);
    vec = reinterpret_cast<const uint4*>(row_bytes - mis * kElemBytes);
    num_vecs = n == 0 ? 0 : (mis + n + kVec - 1) / kVec;
  }
  // Bit c (c < count <= 32): element c of the `count` elements from vector v on is a column of the row
  // (0 <= v * kVec + c - mis < n).
  __device__ __forceinline__ uint32_t valid_bits(int v, int count = kVec) const {
    const int first = v * kVec - mis;
    const int c_lo = min(max(-first, 0), count), c_hi = min(max(n - first, 0), count);
    return low_bits(c_hi) & ~low_bits(c_lo);
  }
};

// Slot mode: row r's block-table row (table_next_n rows per sequence; no division for one).
__device__ __forceinline__ int64_t table_row_of(const TopkArgs& a, int r) {
  return a.table_next_n == 1 ? r : r / a.table_next_n;
}
// Column j's (>= 0) block: a shift for a power-of-two block size (`block_shift`, set by the host), else a division.
__device__ __forceinline__ int block_of(const TopkArgs& a, int j) {
  return a.block_shift >= 0 ? j >> a.block_shift : j / a.block_size;
}

// An entry plus the row's offset (-1 stays -1; int32 arithmetic wraps).
__device__ __forceinline__ int plus_offset(int idx, uint32_t offset) {
  return idx != -1 ? static_cast<int>(static_cast<uint32_t>(idx) + offset) : -1;
}

// Slot mode, one thread's selected columns in rising order (the resident kernel's keys of a thread are
// consecutive columns): each column's block and offset follow from the previous one's, and a block's table entry
// is read once, instead of a division and a load per column.
struct SlotCursor {
  const int* table_row;  // the row's block-table row
  int col = -1;          // the last column mapped (relative to lo); -1: none yet
  int blk = 0, off = 0;  // its block and its offset in it
  int id = 0;            // the block's table entry
  __device__ __forceinline__ SlotCursor(const TopkArgs& a, int64_t seq)
      : table_row(a.block_table + seq * a.table_stride) {}
  // column j (>= 0, above the last one) in slot form, plus the row's offset (-1 past the table)
  __device__ __forceinline__ int map(const TopkArgs& a, int j, uint32_t offset) {
    if (col < 0) {
      blk = block_of(a, j);
      off = j - blk * a.block_size;
      if (blk < a.table_cols) id = __ldg(table_row + blk);
    } else {
      off += j - col;
      if (off >= a.block_size) {
        do {
          off -= a.block_size;
          ++blk;
        } while (off >= a.block_size);
        if (blk < a.table_cols) id = __ldg(table_row + blk);
      }
    }
    col = j;
    return plus_offset(blk < a.table_cols ? id * a.block_size + off : -1, offset);
  }
};

// Column j of a row (relative to lo) in the requested index convention, plus the row's offset (-1 stays -1).
// seq: the row's block-table row (slot mode).
__device__ __forceinline__ int entry_index(const TopkArgs& a, int lo, int64_t seq, uint32_t offset, int j) {
  if (a.index_mode == static_cast<int>(TopkIndexMode::kSlot)) return SlotCursor(a, seq).map(a, j, offset);
  return plus_offset(a.index_mode == static_cast<int>(TopkIndexMode::kAbsolute) ? lo + j : j, offset);
}

// Slot mode: asks L1 for the 128-byte lines of table row `seq` that hold the entries of columns [j0, j1)
// (relative to lo, j0 >= 0), line i by lane i (i < 32: more lines take turns), so that the emission's table
// reads, which its stores wait for, find them there. Called by one warp.
__device__ __forceinline__ void prefetch_table_l1(const TopkArgs& a, int64_t seq, int j0, int j1, int lane) {
  if (j1 <= j0) return;
  const int b0 = block_of(a, j0), b1 = min(block_of(a, j1 - 1) + 1, a.table_cols);  // entries [b0, b1)
  if (b0 >= b1) return;
  const int* row = a.block_table + seq * a.table_stride;
  const uintptr_t first = reinterpret_cast<uintptr_t>(row + b0) & ~uintptr_t{127};
  const uintptr_t end = reinterpret_cast<uintptr_t>(row + b1);  // every line asked holds an entry of [b0, b1)
  for (uintptr_t p = first + 128u * lane; p < end; p += 32u * 128u) ptx::prefetch_l1(reinterpret_cast<const void*>(p));
}

// Writes entry `idx` (column j of row r, relative to lo, in the output's convention) as output entry `pos` of
// `out_row` (row r of the output, computed once per row), and its value when asked.
template <int kElemBytes>
__device__ __forceinline__ void store_entry(const TopkArgs& a, int* out_row, int r, int lo, int pos, int j, int idx) {
  out_row[pos] = idx;
  if (a.out_values != nullptr) {
    const int64_t src = static_cast<int64_t>(r) * a.row_stride + lo + j;
    if constexpr (kElemBytes == 4)
      static_cast<uint32_t*>(a.out_values)[r * a.values_stride + pos] = __ldg(static_cast<const uint32_t*>(a.logits) + src);
    else
      static_cast<uint16_t*>(a.out_values)[r * a.values_stride + pos] = __ldg(static_cast<const uint16_t*>(a.logits) + src);
  }
}

// Entries [total, k) of row r: -1, and -inf values.
template <int kElemBytes, int kThreads>
__device__ __forceinline__ void pad_row(const TopkArgs& a, int r, int total) {
  constexpr uint32_t kNegInfBits = kElemBytes == 4 ? 0xFF800000u : 0xFF80u;
  for (int p = total + static_cast<int>(threadIdx.x); p < a.k; p += kThreads) {
    a.out[static_cast<int64_t>(r) * a.out_stride + p] = -1;
    if (a.out_values != nullptr) {
      if constexpr (kElemBytes == 4)
        static_cast<uint32_t*>(a.out_values)[r * a.values_stride + p] = kNegInfBits;
      else
        static_cast<uint16_t*>(a.out_values)[r * a.values_stride + p] = static_cast<uint16_t>(kNegInfBits);
    }
  }
}

}  // namespace topk_detail
}  // namespace deep_indexer
