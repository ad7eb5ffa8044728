// Varlen decode batches (`indices`): an int32 request id per q row; a run of equal consecutive ids is
// one request, whose block-table row is the run's first row. Shared by the paged logits and top-k kernels.
#pragma once
#include <cstdint>

namespace deep_indexer {
namespace varlen {

// The first row of the run of equal ids that holds row b. Warp-collective (every lane calls it with the
// same b and gets the same result); one 32-row window back per step. Ids are only compared, so any value
// is safe; rows < 0 are never read.
__device__ __forceinline__ int run_first_row(const int* __restrict__ indices, int b, uint32_t lane) {
  const int id = __ldg(indices + b);
  int base = b;  // rows [base - 32, base) are examined next
  while (base > 0) {
    const int r = base - 32 + static_cast<int>(lane);
    const uint32_t bal = __ballot_sync(0xffffffffu, r >= 0 && __ldg(indices + r) != id);
    if (bal != 0) return base - 32 + (31 - __clz(static_cast<int>(bal))) + 1;
    base -= 32;
  }
  return 0;
}

}  // namespace varlen
}  // namespace deep_indexer
