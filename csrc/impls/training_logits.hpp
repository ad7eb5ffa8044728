// Host side of the training kernel `training_logits_fwd_kernel` (include/deep_indexer/training_logits.cuh).
#pragma once
#include <deep_indexer/training_logits_layout.hpp>

#include "../jit/kernel_runtime.hpp"

namespace deep_indexer {

struct TrainingLogitsRuntime : jit::KernelRuntime<TrainingLogitsRuntime> {
  struct Params {
    int num_heads, head_dim;
    TrainingLogitsLayout layout() const {
      const TrainingLogitsLayout l{num_heads, head_dim};
      DI_CHECK_ARG(l.valid(), "training_logits: unsupported shape: {} heads of dim {} (supported: heads 16/32/64/128, "
                   "dims 64/128)", num_heads, head_dim);
      return l;
    }
  };

  static const char* kernel_name() { return "training_logits"; }
  static const char* header() { return "deep_indexer/training_logits.cuh"; }
  static std::string name(const Params& p) { return fmt::format("training_logits<H={},D={}>", p.num_heads, p.head_dim); }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::training_logits_fwd_kernel<{}, {}>", p.num_heads, p.head_dim);
  }
  static unsigned smem_bytes(const Params& p) { return p.layout().smem_bytes(); }

  struct Args {
    Params params;
    const void* q;  // [T*H, D] bf16
    const void* k;  // [N, D] bf16
    const float* weights;
    int64_t weights_stride;
    const int *ks, *ke;
    float* logits;
    int64_t logits_stride;
    int num_tokens, num_keys;
  };

  static void launch(const Args& a, int device, CUstream stream) {
    if (a.num_tokens == 0 || a.num_keys == 0) return;
    const TrainingLogitsLayout l = a.params.layout();
    const CUfunction f = function(a.params, device, stream);
    jit::LaunchConfig cfg;
    cfg.grid = static_cast<unsigned>(l.num_ctas(a.num_tokens));
    cfg.block = TrainingLogitsLayout::kNumThreads;
    cfg.smem = l.smem_bytes();
    jit::launch(f, cfg, stream, a.q, a.k, a.weights, a.weights_stride, a.ks, a.ke, a.logits, a.logits_stride,
                a.num_tokens, a.num_keys);
  }
};

}  // namespace deep_indexer
