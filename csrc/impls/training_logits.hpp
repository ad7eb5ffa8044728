// Host side of the training kernel `training_logits_stats_kernel` (include/deep_indexer/training/training_logits.cuh).
#pragma once
#include <deep_indexer/training/training_logits_layout.hpp>

#include "../jit/kernel_runtime.hpp"

namespace deep_indexer {

// The warm-up loss's forward statistics of the indexer side (training_logits_stats_kernel): per row
// t in [row_begin, row_end), lse_out[t] = logsumexp_s I[t, s] and pi_out[t] = sum_s p[t, s] I[t, s].
struct TrainingLogitsStatsRuntime : jit::KernelRuntime<TrainingLogitsStatsRuntime> {
  struct Params {
    int num_heads, head_dim;
    TrainingLogitsLayout layout() const {
      const TrainingLogitsLayout l{num_heads, head_dim};
      DI_CHECK_ARG(l.valid(), "training_logits_stats: unsupported shape: {} heads of dim {} (supported: heads "
                   "16/32/64/128, dims 64/128)", num_heads, head_dim);
      return l;
    }
  };

  static const char* kernel_name() { return "training_logits_stats"; }
  static const char* header() { return "deep_indexer/training/training_logits.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("training_logits_stats<H={},D={}>", p.num_heads, p.head_dim);
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::training_logits_stats_kernel<{}, {}>", p.num_heads, p.head_dim);
  }
  static unsigned smem_bytes(const Params& p) { return p.layout().smem_bytes(); }

  struct Args {
    Params params;
    const void* q;  // [T*H, D] bf16
    const void* k;  // [N, D] bf16
    const float* weights;
    int64_t weights_stride;
    const int *ks, *ke;
    const float* p;  // p[(t - row_begin) * p_stride + s]
    int64_t p_stride;
    float *lse_out, *pi_out;
    int row_begin, row_end, num_keys;
  };

  static void launch(const Args& a, int device, CUstream stream) {
    if (a.row_end <= a.row_begin || a.num_keys == 0) return;
    const TrainingLogitsLayout l = a.params.layout();
    const CUfunction f = function(a.params, device, stream);
    jit::LaunchConfig cfg;
    cfg.grid = static_cast<unsigned>(l.num_ctas(a.row_end - a.row_begin));
    cfg.block = TrainingLogitsLayout::kNumThreads;
    cfg.smem = l.smem_bytes();
    jit::launch(f, cfg, stream, a.q, a.k, a.weights, a.weights_stride, a.ks, a.ke, a.p, a.p_stride, a.lse_out,
                a.pi_out, a.row_begin, a.row_end, a.num_keys);
  }
};

}  // namespace deep_indexer
