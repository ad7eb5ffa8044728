// Host side of clean_logits (docs/api.md).
#pragma once
#include "../jit/kernel_runtime.hpp"

namespace deep_indexer {

struct CleanLogitsRuntime : jit::KernelRuntime<CleanLogitsRuntime> {
  static constexpr unsigned kNumThreads = 512;

  struct Params {
    int elem_bytes;  // 4: float32, 2: bfloat16
  };

  static const char* kernel_name() { return "clean_logits"; }
  static const char* header() { return "deep_indexer/logits/clean_logits.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("clean_logits<{}>", p.elem_bytes == 4 ? "float32" : "bfloat16");
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::clean_logits_kernel<{}, {}>", p.elem_bytes, kNumThreads);
  }
  static unsigned smem_bytes(const Params&) { return 0; }

  struct Args {
    void* logits;
    int elem_bytes;
    int64_t row_stride, num_rows;
    int num_cols, next_n;
    const int* ks;  // may be null (0)
    const int* ke;
    int num_keys = 0;  // > 0: compressed prefill logits over num_keys keys (see clean_logits.cuh)
  };

  static void launch(const Args& a, int device, CUstream stream) {
    if (a.num_rows == 0 || a.num_cols == 0) return;
    const CUfunction f = function(Params{a.elem_bytes}, device, stream);
    jit::LaunchConfig cfg;
    cfg.grid = static_cast<unsigned>(std::min<int64_t>(a.num_rows, int64_t(1) << 30));
    cfg.block = kNumThreads;
    jit::launch(f, cfg, stream, a.logits, a.row_stride, a.num_rows, a.num_cols, a.next_n, a.ks, a.ke, a.num_keys);
  }
};

}  // namespace deep_indexer
