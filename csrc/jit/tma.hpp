// Tensor-map (TMA descriptor) construction on the host.
#pragma once
#include <cuda.h>

#include <array>
#include <cstdint>
#include <cstring>

#include "driver.hpp"

namespace deep_indexer::jit {

inline CUtensorMapSwizzle swizzle_for_row_bytes(int row_bytes) {
  switch (row_bytes) {
    case 128: return CU_TENSOR_MAP_SWIZZLE_128B;
    case 64: return CU_TENSOR_MAP_SWIZZLE_64B;
    case 32: return CU_TENSOR_MAP_SWIZZLE_32B;
    default: return CU_TENSOR_MAP_SWIZZLE_NONE;
  }
}

// A rank-`Rank` tiled map. dims/box innermost first; strides_bytes[i] is the stride of dim i+1.
template <int Rank>
CUtensorMap encode_tensor_map(const void* base, CUtensorMapDataType dtype, const uint64_t (&dims)[Rank],
                            const uint64_t (&strides_bytes)[Rank > 1 ? Rank - 1 : 1], const uint32_t (&box)[Rank],
                            CUtensorMapSwizzle swizzle, const char* what) {
  DI_CHECK(reinterpret_cast<uintptr_t>(base) % 16 == 0, "deep_indexer: {} is not 16-byte aligned", what);
  for (int i = 0; i + 1 < Rank; ++i)
    DI_CHECK(strides_bytes[i] % 16 == 0, "deep_indexer: {} has a stride of {} bytes, not a multiple of 16", what,
             strides_bytes[i]);
  CUtensorMap map;
  uint32_t elem_strides[Rank];
  for (int i = 0; i < Rank; ++i) elem_strides[i] = 1;
  DI_CU_CHECK(driver::api().cuTensorMapEncodeTiled(
      &map, dtype, Rank, const_cast<void*>(base), dims, strides_bytes, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return map;
}



// encode_tensor_map behind a small per-thread cache: engines call the ops on the same buffers
// (KV cache, static q/out buffers under CUDA graphs) step after step, and encoding costs ~1 us.
template <int Rank>
CUtensorMap make_tensor_map(const void* base, CUtensorMapDataType dtype, const uint64_t (&dims)[Rank],
                            const uint64_t (&strides_bytes)[Rank > 1 ? Rank - 1 : 1], const uint32_t (&box)[Rank],
                            CUtensorMapSwizzle swizzle, const char* what) {
  struct Key {
    const void* base;
    int dtype, swizzle;
    uint64_t dims[Rank], strides[Rank > 1 ? Rank - 1 : 1];
    uint32_t box[Rank];
  };
  struct Entry {
    Key key;
    CUtensorMap map;
    bool used;
  };
  constexpr int kEntries = 8;
  thread_local std::array<Entry, kEntries> cache{};
  thread_local int next = 0;
  Key key;
  std::memset(&key, 0, sizeof(key));
  key.base = base;
  key.dtype = static_cast<int>(dtype);
  key.swizzle = static_cast<int>(swizzle);
  std::memcpy(key.dims, dims, sizeof(key.dims));
  std::memcpy(key.strides, strides_bytes, sizeof(key.strides));
  std::memcpy(key.box, box, sizeof(key.box));
  for (const Entry& e : cache)
    if (e.used && std::memcmp(&e.key, &key, sizeof(Key)) == 0) return e.map;
  Entry& slot = cache[next];
  next = (next + 1) % kEntries;
  slot.map = encode_tensor_map<Rank>(base, dtype, dims, strides_bytes, box, swizzle, what);
  slot.key = key;
  slot.used = true;
  return slot.map;
}

// A K-major fp8 matrix of `rows` rows of `row_bytes` bytes (32/64/128, the swizzle width), loaded in
// boxes of `box_rows` full rows: q and k of the prefill kernel, q of the decode kernel.
inline CUtensorMap make_kmajor_fp8_map(const void* base, uint64_t rows, int row_bytes, int box_rows, const char* what) {
  const uint64_t rb = static_cast<uint64_t>(row_bytes);
  return make_tensor_map<2>(base, CU_TENSOR_MAP_DATA_TYPE_UINT8, {rb, rows}, {rb},
                            {static_cast<uint32_t>(row_bytes), static_cast<uint32_t>(box_rows)},
                            swizzle_for_row_bytes(row_bytes), what);
}

// A row-major bf16 matrix of `rows` rows of `cols` elements (cols a multiple of 64), loaded in boxes of
// 64 columns (128 bytes, 128-byte swizzle) x `box_rows` rows: the training kernels' q_I, k_I and k tiles.
inline CUtensorMap make_bf16_rows_map(const void* base, uint64_t rows, uint64_t cols, int box_rows, const char* what) {
  return make_tensor_map<2>(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {cols, rows}, {cols * 2},
                            {64u, static_cast<uint32_t>(box_rows)}, CU_TENSOR_MAP_SWIZZLE_128B, what);
}

}  // namespace deep_indexer::jit
