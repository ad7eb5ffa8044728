// Arguments and work split of fp4_prefill_fold_kernel (fp4_fold.cuh), shared by host and device.
#pragma once
#include <cstdint>

#include <deep_indexer/common/host_device.hpp>

namespace deep_indexer {

// One FP4 operand of the kernel, passed by value: rows of kHeadDim / 2 code bytes and one scale word.
struct Fp4FoldOperand {
  const uint8_t* codes;  // [rows, D / 2], 16-byte aligned
  const int* sf;         // [rows]
  uint8_t* vals;         // [rows, D] e4m3, 16-byte aligned
  float* scale;          // [rows]: w * 2^(base - 127)
  const void* weights;   // nullptr (w = 1), or [rows / heads, heads] at (w_stride0, w_stride1) elements
  int64_t w_stride0, w_stride1;
  int64_t rows;          // < 2^31
  int heads;
  int w_kind;            // 0 float32, 1 bfloat16, 2 float16
  int blocks;            // CTAs of this operand
};

struct Fp4FoldLayout {
  static constexpr int kNumThreads = 256;
  static constexpr int kUnits = 4;  // rows per thread (every load issued before the first fold)

  DI_HOST_DEVICE static constexpr bool supported(int head_dim) {
    return head_dim == 32 || head_dim == 64 || head_dim == 128;
  }
  DI_HOST_DEVICE static constexpr int lanes_per_row(int head_dim) { return head_dim / 16; }
  DI_HOST_DEVICE static constexpr int rows_per_pass(int head_dim) { return kNumThreads / lanes_per_row(head_dim); }
  DI_HOST_DEVICE static constexpr int rows_per_cta(int head_dim) { return rows_per_pass(head_dim) * kUnits; }
};

}  // namespace deep_indexer
