// clean_logits: writes -inf outside each row's valid key range, in place (docs/api.md).
// Row r belongs to group g = r / next_n (i = r % next_n) and keeps columns
// [max(ks[g], 0), min(ke[g] - next_n + i + 1, num_cols)); everything else becomes -inf.
// Compressed prefill logits (num_keys > 0, next_n = 1): column c of row r holds key lo + c with
// lo = max(ks[r], 0), so the row keeps [0, min(ke[r], num_keys) - lo) (clamped into [0, num_cols]).
#pragma once
#include <cstdint>
#include <type_traits>

namespace deep_indexer {

// kElemBytes: 4 (float32 logits) or 2 (bfloat16 logits). One CTA per row (grid-stride).
template <int kElemBytes, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads) clean_logits_kernel(void* __restrict__ logits, int64_t row_stride,
                                                                   int64_t num_rows, int num_cols, int next_n,
                                                                   const int* __restrict__ ks,
                                                                   const int* __restrict__ ke, int num_keys) {
  static_assert(kElemBytes == 4 || kElemBytes == 2, "float32 or bfloat16 logits");
  using Elem = typename std::conditional<kElemBytes == 4, uint32_t, uint16_t>::type;
  constexpr Elem kNegInf = kElemBytes == 4 ? Elem(0xFF800000u) : Elem(0xFF80u);
  constexpr uint32_t kNegInfWord = kElemBytes == 4 ? 0xFF800000u : 0xFF80FF80u;
  constexpr int kVec = 16 / kElemBytes;
  constexpr int kUnroll = 4;
  const uint4 neg_inf_vec = make_uint4(kNegInfWord, kNegInfWord, kNegInfWord, kNegInfWord);

  // Fills [a, b) of `row` with -inf: scalar head to a 16-byte boundary, vector body, scalar tail.
  auto fill = [&](Elem* row, int a, int b) {
    if (a >= b) return;
    const int misalign = static_cast<int>((reinterpret_cast<uintptr_t>(row + a) & 15u) / kElemBytes);
    const int head = min(misalign == 0 ? 0 : kVec - misalign, b - a);
    if (static_cast<int>(threadIdx.x) < head) row[a + threadIdx.x] = kNegInf;
    const int body = a + head;
    const int num_vec = (b - body) / kVec;
    uint4* vec = reinterpret_cast<uint4*>(row + body);
    for (int v = threadIdx.x; v < num_vec; v += kNumThreads * kUnroll) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v + u * kNumThreads < num_vec) vec[v + u * kNumThreads] = neg_inf_vec;
    }
    for (int t = body + num_vec * kVec + threadIdx.x; t < b; t += kNumThreads) row[t] = kNegInf;
  };

  for (int64_t r = blockIdx.x; r < num_rows; r += gridDim.x) {
    const int64_t g = r / next_n;
    const int64_t i = r - g * next_n;
    const int64_t lo = ks == nullptr ? 0 : max(static_cast<int64_t>(__ldg(ks + g)), int64_t(0));
    const int64_t hi = static_cast<int64_t>(__ldg(ke + g)) - next_n + i + 1;
    int lo_c, hi_c;
    if (num_keys > 0) {
      lo_c = 0;
      hi_c = static_cast<int>(min(max(min(hi, static_cast<int64_t>(num_keys)) - lo, int64_t(0)),
                                  static_cast<int64_t>(num_cols)));
    } else {
      lo_c = static_cast<int>(min(lo, static_cast<int64_t>(num_cols)));
      hi_c = static_cast<int>(min(max(hi, static_cast<int64_t>(lo_c)), static_cast<int64_t>(num_cols)));
    }
    Elem* row = static_cast<Elem*>(logits) + r * row_stride;
    fill(row, 0, lo_c);
    fill(row, hi_c, num_cols);
  }
}

}  // namespace deep_indexer
