// Host side of the `per_head` warm-up loss kernels (include/deep_indexer/training/training_per_head.cuh).
#pragma once
#include <deep_indexer/training/training_per_head_layout.hpp>

#include "../jit/kernel_runtime.hpp"
#include "../jit/tma.hpp"
#include "heuristics_sm90.hpp"

namespace deep_indexer {

inline TrainingPerHeadLayout training_per_head_layout(int qk_dim, int head_dim) {
  const TrainingPerHeadLayout l{qk_dim, head_dim};
  DI_CHECK_ARG(l.valid(), "training_per_head: unsupported attention dim {} / indexer dim {} (supported: indexer dim 64 with "
               "attention dim 64, 128 or 192)", qk_dim, head_dim);
  return l;
}

// [rows, heads, cols] bf16 (row-major) in boxes of 64 columns x 1 head x 64 rows (128-byte swizzle): the k tiles
// of one key head, the q / q_I tiles of one head.
inline CUtensorMap make_bf16_head_rows_map(const void* base, uint64_t rows, uint64_t heads, uint64_t cols,
                                           const char* what) {
  return jit::make_tensor_map<3>(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {cols, heads, rows},
                                 {cols * 2, heads * cols * 2}, {64u, 1u, 64u}, CU_TENSOR_MAP_SWIZZLE_128B, what);
}

// Row-major kernel: the forward statistics (bwd = false) or dq_I and dw (bwd = true).
struct TrainingPerHeadRowsRuntime : jit::KernelRuntime<TrainingPerHeadRowsRuntime> {
  struct Params {
    int qk_dim, head_dim;
    bool bwd;
  };
  static const char* kernel_name() { return "training_per_head_rows"; }
  static const char* header() { return "deep_indexer/training/training_per_head.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("training_per_head_rows<Dqk={},D={},{}>", p.qk_dim, p.head_dim, p.bwd ? "bwd" : "fwd");
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::training_per_head_rows_kernel<{}, {}, {}>", p.qk_dim, p.head_dim, p.bwd);
  }
  static unsigned smem_bytes(const Params& p) { return training_per_head_layout(p.qk_dim, p.head_dim).rows_smem_bytes(); }

  struct Args {
    Params params;
    const void* k;    // [N, Hkv, Dqk] bf16
    const void* k_i;  // [N, D] bf16
    PerHeadRowsArgs rows;
    PerHeadBwdOut bwd_out;  // backward only
    float *out_a, *out_b, *out_c;
    int num_rows, num_heads, num_kv_heads, num_keys, t_pad;
    float scale_log2;
  };

  static void launch(const Args& a, CUstream stream, int device) {
    if (a.num_rows == 0) return;
    const TrainingPerHeadLayout l = training_per_head_layout(a.params.qk_dim, a.params.head_dim);
    const CUfunction f = function(a.params, device, stream);
    const CUtensorMap tmap_k = make_bf16_head_rows_map(a.k, static_cast<uint64_t>(a.num_keys),
                                                       static_cast<uint64_t>(a.num_kv_heads),
                                                       static_cast<uint64_t>(a.params.qk_dim), "k");
    const CUtensorMap tmap_ki = jit::make_bf16_rows_map(a.k_i, static_cast<uint64_t>(a.num_keys),
                                                        static_cast<uint64_t>(a.params.head_dim),
                                                        TrainingPerHeadLayout::kTileRows, "k_I");
    jit::LaunchConfig cfg;
    cfg.grid = static_cast<unsigned>(a.t_pad / TrainingPerHeadLayout::kRowsPerCta * a.num_heads);
    cfg.block = TrainingPerHeadLayout::kThreads;
    cfg.smem = l.rows_smem_bytes();
    jit::launch(f, cfg, stream, tmap_k, tmap_ki, a.rows, a.bwd_out, a.out_a, a.out_b, a.out_c, a.num_rows, a.num_heads,
                a.num_heads / a.num_kv_heads, a.num_keys, a.t_pad, a.scale_log2);
  }
};

// Key-major kernel: dk_I partials per head group.
struct TrainingPerHeadDkRuntime : jit::KernelRuntime<TrainingPerHeadDkRuntime> {
  struct Params {
    int qk_dim, head_dim;
  };
  static const char* kernel_name() { return "training_per_head_dk"; }
  static const char* header() { return "deep_indexer/training/training_per_head.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("training_per_head_dk<Dqk={},D={}>", p.qk_dim, p.head_dim);
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::training_per_head_dk_kernel<{}, {}>", p.qk_dim, p.head_dim);
  }
  static unsigned smem_bytes(const Params& p) { return training_per_head_layout(p.qk_dim, p.head_dim).dk_smem_bytes(); }

  struct Args {
    Params params;
    const void *q, *k, *q_i, *k_i;
    const void* info;
    const int *tile_lo, *tile_hi, *tile_lo_max, *tile_hi_min, *kb_first, *kb_last;  // [t_pad / 64] x 4, [num_kblocks] x 2
    float* dk_part;                                     // [groups, part_rows, D]
    int64_t part_rows;
    int num_kblocks, heads_per_group, groups, num_rows, num_heads, num_kv_heads, num_keys, t_pad;
    float scale_log2;
  };

  static void launch(const Args& a, CUstream stream, int device) {
    if (a.num_kblocks == 0 || a.groups == 0) return;
    const TrainingPerHeadLayout l = training_per_head_layout(a.params.qk_dim, a.params.head_dim);
    const CUfunction f = function(a.params, device, stream);
    const uint64_t qk = static_cast<uint64_t>(a.params.qk_dim), d = static_cast<uint64_t>(a.params.head_dim);
    const CUtensorMap tmap_k = make_bf16_head_rows_map(a.k, static_cast<uint64_t>(a.num_keys),
                                                       static_cast<uint64_t>(a.num_kv_heads), qk, "k");
    const CUtensorMap tmap_q = make_bf16_head_rows_map(a.q, static_cast<uint64_t>(a.num_rows),
                                                       static_cast<uint64_t>(a.num_heads), qk, "q");
    const CUtensorMap tmap_qi = make_bf16_head_rows_map(a.q_i, static_cast<uint64_t>(a.num_rows),
                                                        static_cast<uint64_t>(a.num_heads), d, "q_I");
    jit::LaunchConfig cfg;
    cfg.grid = static_cast<unsigned>(a.num_kblocks * a.groups);
    cfg.block = TrainingPerHeadLayout::kThreads;
    cfg.smem = l.dk_smem_bytes();
    jit::launch(f, cfg, stream, tmap_k, tmap_q, tmap_qi, a.k_i, a.info, a.tile_lo, a.tile_hi, a.tile_lo_max,
                a.tile_hi_min, a.kb_first, a.kb_last,
                a.dk_part, a.part_rows, a.num_kblocks, a.heads_per_group, a.num_heads, a.num_heads / a.num_kv_heads,
                a.num_keys, a.t_pad, a.scale_log2);
  }
};

}  // namespace deep_indexer
