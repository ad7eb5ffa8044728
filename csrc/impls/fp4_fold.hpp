// Host side of fp4_fold (include/deep_indexer/logits/fp4_fold.cuh, docs/fp4.md).
#pragma once
#include <deep_indexer/logits/fp4_fold_layout.hpp>

#include "../jit/kernel_runtime.hpp"

namespace deep_indexer {

struct Fp4FoldRuntime : jit::KernelRuntime<Fp4FoldRuntime> {
  static constexpr unsigned kNumThreads = 256;

  struct Params {
    int head_dim;  // 32, 64, 96 or 128 (head_dim / 2 code bytes per row)
  };

  static bool supported(int head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128; }

  static const char* kernel_name() { return "fp4_fold"; }
  static const char* header() { return "deep_indexer/logits/fp4_fold.cuh"; }
  static std::string name(const Params& p) { return fmt::format("fp4_fold<head_dim={}>", p.head_dim); }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::fp4_fold_kernel<{}, {}>", p.head_dim, kNumThreads);
  }
  static unsigned smem_bytes(const Params&) { return 0; }

  struct Args {
    const uint8_t* codes;  // [num_rows, head_dim / 2], 16-byte aligned
    const int* sf;         // [num_rows]
    uint8_t* vals;         // [num_rows, head_dim] e4m3, 16-byte aligned
    int* base;             // [num_rows]
    int64_t num_rows;
    int head_dim;
  };

  static void launch(const Args& a, int device, CUstream stream) {
    if (a.num_rows == 0) return;
    const CUfunction f = function(Params{a.head_dim}, device, stream);
    jit::LaunchConfig cfg;
    const int64_t blocks = (a.num_rows + kNumThreads - 1) / kNumThreads;
    cfg.grid = static_cast<unsigned>(std::min<int64_t>(blocks, int64_t(1) << 30));  // grid-stride beyond
    cfg.block = kNumThreads;
    jit::launch(f, cfg, stream, a.codes, a.sf, a.vals, a.base, a.num_rows);
  }
};

// fp4_prefill_fold_kernel: FP4 q (with its weights) and / or FP4 k -> the FP8 prefill kernel's inputs,
// one launch for both operands.
struct Fp4PrefillFoldRuntime : jit::KernelRuntime<Fp4PrefillFoldRuntime> {
  struct Params {
    int head_dim;  // 32, 64 or 128 (the prefill kernel's)
  };

  static const char* kernel_name() { return "fp4_prefill_fold"; }
  static const char* header() { return "deep_indexer/logits/fp4_fold.cuh"; }
  static std::string name(const Params& p) { return fmt::format("fp4_prefill_fold<head_dim={}>", p.head_dim); }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::fp4_prefill_fold_kernel<{}>", p.head_dim);
  }
  static unsigned smem_bytes(const Params&) { return 0; }

  // q and k: their rows (0: no such operand) and pointers; `blocks` is set here.
  static void launch(Fp4FoldOperand q, Fp4FoldOperand k, int head_dim, int device, CUstream stream) {
    const int64_t per_cta = Fp4FoldLayout::rows_per_cta(head_dim);
    const int64_t qb = (q.rows + per_cta - 1) / per_cta, kb = (k.rows + per_cta - 1) / per_cta;
    DI_CHECK(q.rows < (int64_t(1) << 31) && k.rows < (int64_t(1) << 31), "fp4_prefill_fold: rows must be < 2^31");
    if (qb + kb == 0) return;
    q.blocks = static_cast<int>(qb);
    k.blocks = static_cast<int>(kb);
    const CUfunction f = function(Params{head_dim}, device, stream);
    jit::LaunchConfig cfg;
    cfg.grid = static_cast<unsigned>(qb + kb);
    cfg.block = Fp4FoldLayout::kNumThreads;
    jit::launch(f, cfg, stream, q, k);
  }
};

}  // namespace deep_indexer
