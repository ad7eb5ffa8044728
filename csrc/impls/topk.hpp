// Host side of topk (docs/topk.md).
#pragma once
#include <deep_indexer/topk_layout.hpp>

#include "../jit/kernel_runtime.hpp"
#include "heuristics_sm90.hpp"

namespace deep_indexer {


struct TopkRuntime : jit::KernelRuntime<TopkRuntime> {
  struct Params {
    int elem_bytes;  // 4: float32, 2: bfloat16
    bool sorted;
    bool cluster;    // the form launched with clusters of 2-8 CTAs per row
    bool wide;       // TopkLayout::kWideThreads threads per block (one CTA per SM), else kNumThreads
    TopkLayout layout() const {
      DI_CHECK_ARG(elem_bytes == 4 || elem_bytes == 2, "topk: elem_bytes must be 4 or 2, got {}", elem_bytes);
      DI_CHECK_ARG(!(sorted && cluster), "topk: the cluster form is unsorted only");
      return TopkLayout{elem_bytes, sorted};
    }
  };

  static const char* kernel_name() { return "topk"; }
  static const char* header() { return "deep_indexer/topk.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("topk<{}, {}{}{}>", p.elem_bytes == 4 ? "float32" : "bfloat16",
                       p.sorted ? "sorted" : "unsorted", p.cluster ? ", cluster" : "", p.wide ? ", wide" : "");
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::topk_kernel<{}, {}, {}, {}>", p.elem_bytes, p.sorted ? "true" : "false",
                       p.cluster ? "true" : "false", threads(p));
  }
  static unsigned smem_bytes(const Params& p) { return p.layout().smem_bytes(); }
  static int threads(const Params& p) { return p.wide ? TopkLayout::kWideThreads : TopkLayout::kNumThreads; }

  // `p.cluster` and `p.wide` are chosen here (from the launch heuristic).
  static void launch(Params p, const TopkArgs& args, const jit::DeviceInfo& dev, int num_sms, int device,
                     CUstream stream) {
    if (args.num_rows == 0 || args.k == 0) return;
    const TopkLayout l = p.layout();
    DI_CHECK_ARG(l.smem_bytes() <= static_cast<unsigned>(dev.max_smem_per_block_optin),
                 "topk: needs {} B of shared memory per block, the device allows {}", l.smem_bytes(),
                 dev.max_smem_per_block_optin);
    const sm90::TopkLaunch t = sm90::topk_launch(l, args.num_rows, args.num_cols, num_sms);
    p.cluster = t.cluster > 1;
    p.wide = t.threads == static_cast<unsigned>(TopkLayout::kWideThreads);
    const CUfunction f = function(p, device, stream);
    jit::LaunchConfig cfg;
    cfg.grid = t.grid;
    cfg.block = t.threads;
    cfg.smem = t.smem;
    cfg.cluster = t.cluster;
    cfg.pdl = true;
    jit::launch(f, cfg, stream, args);
  }
};

}  // namespace deep_indexer
