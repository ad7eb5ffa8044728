// Host side of `training_target_kernel` (include/deep_indexer/training/training_target.cuh): the head-mean
// attention target of the warm-up KL loss.
#pragma once
#include <deep_indexer/training/training_target_layout.hpp>

#include "../jit/kernel_runtime.hpp"
#include "../jit/tma.hpp"
#include "heuristics_sm90.hpp"

namespace deep_indexer {

struct TrainingTargetRuntime : jit::KernelRuntime<TrainingTargetRuntime> {
  struct Params {
    int head_dim, cluster;
    bool lse_mode = false;  // the attention LSE instead of the target (kLse)
    TrainingTargetLayout layout() const {
      const TrainingTargetLayout l{head_dim, cluster};
      DI_CHECK_ARG(l.valid(), "training_target: unsupported configuration: head dim {} (supported: multiples of 64 up to "
                   "{}), cluster {} (1 or 2)", head_dim, TrainingTargetLayout::kMaxHeadDim, cluster);
      return l;
    }
  };

  static const char* kernel_name() { return "training_target"; }
  static const char* header() { return "deep_indexer/training/training_target.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("training_target<D={},cluster={}{}>", p.head_dim, p.cluster, p.lse_mode ? ",lse" : "");
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::training_target_kernel<{}, {}, {}>", p.head_dim, p.cluster, p.lse_mode);
  }
  static unsigned smem_bytes(const Params& p) { return p.layout().smem_bytes(); }

  struct Args {
    Params params;
    const void* q;  // [T, 128, D] bf16
    const void* k;  // [N, D] bf16
    const float* lse;  // [T, 128] finite
    const int *ks, *ke;
    float* p;
    int64_t p_stride;
    float *plogp, *mass;  // [T] or null
    int row_begin, row_end, num_keys;
    float scale_log2, inv_heads;
    float* lse_out;  // lse_mode: [T, 128]
  };

  static void launch(const Args& a, CUstream stream, int device) {
    if (a.row_end <= a.row_begin || a.num_keys == 0) return;
    const TrainingTargetLayout l = a.params.layout();
    const CUfunction f = function(a.params, device, stream);
    const CUtensorMap tmap_k =
        jit::make_bf16_rows_map(a.k, static_cast<uint64_t>(a.num_keys), static_cast<uint64_t>(a.params.head_dim),
                                l.box_rows(), "k");
    jit::LaunchConfig cfg;
    const int groups = (a.row_end - a.row_begin + a.params.cluster - 1) / a.params.cluster;
    cfg.grid = static_cast<unsigned>(groups * a.params.cluster);
    cfg.block = TrainingTargetLayout::kThreads;
    cfg.smem = l.smem_bytes();
    cfg.cluster = static_cast<unsigned>(a.params.cluster);
    jit::launch(f, cfg, stream, tmap_k, a.q, a.lse, a.ks, a.ke, a.p, a.p_stride, a.plogp, a.mass, a.row_begin,
                a.row_end, a.num_keys, a.scale_log2, a.inv_heads, a.lse_out);
  }
};

}  // namespace deep_indexer
