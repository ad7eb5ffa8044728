// Host side of topk (docs/topk.md).
#pragma once
#include <algorithm>
#include <array>
#include <atomic>

#include <deep_indexer/topk/topk_layout.hpp>

#include "../jit/kernel_runtime.hpp"
#include "heuristics_sm90.hpp"

namespace deep_indexer {

// Both top-k kernels wait for the previous kernel in-kernel (programmatic dependent launch).
inline jit::LaunchConfig topk_launch_config(unsigned grid, unsigned threads, unsigned smem, unsigned cluster) {
  jit::LaunchConfig cfg;
  cfg.grid = grid;
  cfg.block = threads;
  cfg.smem = smem;
  cfg.cluster = cluster;
  cfg.pdl = true;
  return cfg;
}

struct TopkRuntime : jit::KernelRuntime<TopkRuntime> {
  struct Params {
    int elem_bytes;  // 4: float32, 2: bfloat16
    bool sorted;
    bool cluster;    // the form launched with clusters of 2-8 CTAs per row
    bool wide;       // TopkLayout::kWideThreads threads per block (one CTA per SM), else kNumThreads
    bool packed = false;  // one word per survivor (bfloat16, one CTA per row, TopkLayout::kPackedMaxCols)
    TopkLayout layout() const {
      DI_CHECK_ARG(elem_bytes == 4 || elem_bytes == 2, "topk: elem_bytes must be 4 or 2, got {}", elem_bytes);
      DI_CHECK_ARG(!(sorted && cluster), "topk: the cluster form is unsorted only");
      DI_CHECK_ARG(!packed || (elem_bytes == 2 && !cluster), "topk: packed survivors need bfloat16 and no cluster");
      return TopkLayout{elem_bytes, sorted};
    }
  };

  static const char* kernel_name() { return "topk"; }
  static const char* header() { return "deep_indexer/topk/topk.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("topk<{}, {}{}{}{}>", p.elem_bytes == 4 ? "float32" : "bfloat16",
                       p.sorted ? "sorted" : "unsorted", p.cluster ? ", cluster" : "", p.wide ? ", wide" : "",
                       p.packed ? ", packed" : "");
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::topk_kernel<{}, {}, {}, {}, {}>", p.elem_bytes, p.sorted ? "true" : "false",
                       p.cluster ? "true" : "false", threads(p), p.packed ? "true" : "false");
  }
  static unsigned smem_bytes(const Params& p) { return p.layout().smem_bytes(); }
  static int threads(const Params& p) { return p.wide ? TopkLayout::kWideThreads : TopkLayout::kNumThreads; }

  // `p.cluster`, `p.wide` and `p.packed` are chosen here (from the launch heuristic).
  static void launch(Params p, const TopkArgs& args, bool rows_aligned, const jit::DeviceInfo& dev, int num_sms,
                     int device, CUstream stream) {
    if (args.num_rows == 0 || args.k == 0) return;
    const TopkLayout l = p.layout();
    DI_CHECK_ARG(l.smem_bytes() <= static_cast<unsigned>(dev.max_smem_per_block_optin),
                 "topk: needs {} B of shared memory per block, the device allows {}", l.smem_bytes(),
                 dev.max_smem_per_block_optin);
    const sm90::TopkLaunch t = sm90::topk_launch(l, args.num_rows, args.num_cols, rows_aligned, num_sms);
    p.cluster = t.cluster > 1;
    p.wide = t.threads == static_cast<unsigned>(TopkLayout::kWideThreads);
    p.packed = t.packed;
    jit::launch(function(p, device, stream), topk_launch_config(t.grid, t.threads, t.smem, t.cluster), stream, args);
  }
};

// The resident form (topk_resident.cuh): rows held in registers by a cluster of C CTAs.
struct TopkResidentRuntime : jit::KernelRuntime<TopkResidentRuntime> {
  struct Params {
    int elem_bytes;       // 4: float32, 2: bfloat16
    int keys_per_thread;  // whole 16-byte vectors: a multiple of 4 (float32) or 8 (bfloat16)
    bool cluster;         // launched with clusters of 2-8 CTAs per row
    int threads;          // 256, 512 or 1024 per CTA
    int ctas_per_sm = 1;  // 2 or 4: CTAs (rows) per SM, one CTA per row
    TopkResidentLayout layout() const {
      DI_CHECK_ARG(elem_bytes == 4 || elem_bytes == 2, "topk_resident: elem_bytes must be 4 or 2, got {}", elem_bytes);
      DI_CHECK_ARG(threads == 256 || threads == 512 || threads == 1024,
                   "topk_resident: threads must be 256, 512 or 1024, got {}", threads);
      const int vec = TopkLayout::kVecBytes / elem_bytes;
      DI_CHECK_ARG(TopkResidentLayout::ctas_per_sm_supported(ctas_per_sm, threads, cluster),
                   "topk_resident: ctas_per_sm must be 1, 2 or 4 (256 threads) without clusters, got {}", ctas_per_sm);
      const int most = TopkResidentLayout::max_keys_per_thread(threads, cluster, elem_bytes, ctas_per_sm);
      DI_CHECK_ARG(keys_per_thread >= vec && keys_per_thread % vec == 0 && keys_per_thread <= most,
                   "topk_resident: keys_per_thread must be a multiple of {} up to {} ({} threads{}), got {}", vec, most,
                   threads, cluster ? ", cluster" : "", keys_per_thread);
      return TopkResidentLayout{elem_bytes, keys_per_thread, threads, ctas_per_sm, cluster};
    }
  };

  static const char* kernel_name() { return "topk_resident"; }
  static const char* header() { return "deep_indexer/topk/topk_resident.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("topk_resident<{}, {} keys, {} threads{}{}>", p.elem_bytes == 4 ? "float32" : "bfloat16",
                       p.keys_per_thread, p.threads, p.cluster ? ", cluster" : "", p.ctas_per_sm >= 2 ? fmt::format(", {} per SM", p.ctas_per_sm) : std::string());
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::topk_resident_kernel<{}, {}, {}, {}, {}>", p.elem_bytes, p.keys_per_thread,
                       p.cluster ? "true" : "false", p.threads, p.ctas_per_sm);
  }
  static unsigned smem_bytes(const Params& p) { return p.layout().smem_bytes(); }
  static int threads(const Params& p) { return p.threads; }

  static void launch(const Params& p, const sm90::TopkResidentLaunch& t, const TopkArgs& args, int device,
                     CUstream stream) {
    jit::launch(function(p, device, stream), topk_launch_config(t.grid, t.threads, t.smem, t.cluster), stream, args);
  }

  // Clusters of `cluster` CTAs that the device runs at once (cuOccupancyMaxActiveClusters, asked with the
  // form (elem_bytes, keys_per_thread, threads) once per device and size).
  // NOTES: every form launches one CTA per SM (TopkResidentLayout::launch_smem_bytes), so the count depends
  // on the cluster size alone.
  static int64_t clusters_at_once(int elem_bytes, int keys_per_thread, int threads, int64_t cluster, int device,
                                  CUstream stream) {
    DI_CHECK_ARG(device >= 0 && device < jit::kMaxDevices && cluster >= 2 && cluster <= TopkResidentLayout::kMaxCluster,
                 "topk_resident: device {} or cluster size {} out of range", device, cluster);
    static std::array<std::atomic<int>, jit::kMaxDevices * (TopkResidentLayout::kMaxCluster + 1)> cache{};
    std::atomic<int>& slot = cache[device * (TopkResidentLayout::kMaxCluster + 1) + cluster];
    int n = slot.load(std::memory_order_relaxed);  // 0: not asked yet
    if (n == 0) {
      const Params p{elem_bytes, keys_per_thread, true, threads};
      jit::LaunchConfig cfg = topk_launch_config(static_cast<unsigned>(cluster), static_cast<unsigned>(threads),
                                                 p.layout().launch_smem_bytes(), static_cast<unsigned>(cluster));
      cfg.pdl = false;  // the occupancy query: the cluster shape and resources alone
      // at least 1: a cluster that does not fit would have failed to launch anyway
      n = std::max(jit::max_active_clusters(function(p, device, stream), cfg, stream), 1);
      slot.store(n, std::memory_order_relaxed);
    }
    return n;
  }
};

// topk_indices' launch: the resident form where the heuristic takes it, else the buffered kernel.
// `rows_aligned`: every row's column 0 is 16-byte aligned (aligned base and row stride).
// NOTES: then a row's vectors, from the one holding its first valid column lo (lo % vec columns before it)
// to its end (<= num_cols), lie within the ceil(num_cols / vec) vectors of columns [0, num_cols), whatever
// lo is; otherwise a row may span one more.
inline void launch_topk(int elem_bytes, bool sorted, bool rows_aligned, const TopkArgs& args, const jit::DeviceInfo& dev,
                        int num_sms, int device, CUstream stream) {
  if (args.num_rows == 0 || args.k == 0) return;
  const int vec = TopkLayout::kVecBytes / elem_bytes;
  const int64_t vecs = (static_cast<int64_t>(args.num_cols) + vec - 1) / vec + (rows_aligned ? 0 : 1);
  const sm90::TopkResidentLaunch t =
      sm90::topk_resident_launch(elem_bytes, sorted, args.num_rows, vecs, args.k, num_sms,
                                 [&](int kpt, int threads, int64_t c) {
                                   return TopkResidentRuntime::clusters_at_once(elem_bytes, kpt, threads, c, device, stream);
                                 });
  if (t.use) {
    TopkResidentRuntime::launch(
        {elem_bytes, t.keys_per_thread, t.cluster > 1, static_cast<int>(t.threads), static_cast<int>(t.ctas_per_sm)}, t,
        args, device, stream);
    return;
  }
  TopkRuntime::launch({elem_bytes, sorted, false}, args, rows_aligned, dev, num_sms, device, stream);
}

}  // namespace deep_indexer
