// Host side of the indexer backward kernels (include/deep_indexer/training/training_indexer_bwd.cuh).
#pragma once
#include <deep_indexer/training/training_indexer_bwd_layout.hpp>

#include "../jit/kernel_runtime.hpp"
#include "../jit/tma.hpp"
#include "heuristics_sm90.hpp"

namespace deep_indexer {

inline TrainingIndexerBwdLayout training_indexer_bwd_layout(int head_dim) {
  const TrainingIndexerBwdLayout l{head_dim};
  DI_CHECK_ARG(l.valid(), "training_indexer_bwd: unsupported head dim {} (supported: 64, 128 with 64 heads)", head_dim);
  return l;
}

// dk_I (key-major) and, with `loss`, dI of the warm-up loss; with `mask`, the signs of S for the masked dq kernel.
struct TrainingIndexerDkRuntime : jit::KernelRuntime<TrainingIndexerDkRuntime> {
  struct Params {
    int head_dim;
    bool loss;
    bool mask;
  };
  static const char* kernel_name() { return "training_indexer_dk"; }
  static const char* header() { return "deep_indexer/training/training_indexer_bwd.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("training_indexer_dk<D={},{}{}>", p.head_dim, p.loss ? "loss" : "grad", p.mask ? ",mask" : "");
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::training_indexer_dk_kernel<{}, {}, {}>", p.head_dim, p.loss, p.mask);
  }
  static unsigned smem_bytes(const Params& p) { return training_indexer_bwd_layout(p.head_dim).smem_bytes(); }

  struct Args {
    Params params;
    const void* q_i;  // [T, 64, D] bf16
    const void* k_i;  // [N, D] bf16
    const float* w;   // [T, 64]
    const int *ks, *ke;
    const float* vals;
    int64_t vals_stride;
    int vals_row0;
    const float *g, *mass, *lse;  // loss only
    float* di_out;                // loss only
    int64_t di_stride;
    float* dk_part;  // [splits, part_rows, D]
    int64_t part_rows;
    uint32_t* mask;  // mask only: [rows - mask_row0, mask_stride] words
    int64_t mask_stride;
    int mask_row0;
    int num_tokens, row_begin, row_end, rows_per_split, splits, key_begin, num_kblocks, num_keys;
  };

  static void launch(const Args& a, CUstream stream, int device) {
    if (a.num_kblocks <= 0 || a.splits <= 0) return;
    const TrainingIndexerBwdLayout l = training_indexer_bwd_layout(a.params.head_dim);
    const CUfunction f = function(a.params, device, stream);
    const CUtensorMap tmap_q = jit::make_bf16_rows_map(
        a.q_i, static_cast<uint64_t>(a.num_tokens) * TrainingIndexerBwdLayout::kNumHeads,
        static_cast<uint64_t>(a.params.head_dim), TrainingIndexerBwdLayout::kTileRows, "q_I");
    jit::LaunchConfig cfg;
    cfg.grid = static_cast<unsigned>(a.num_kblocks * a.splits);
    cfg.block = TrainingIndexerBwdLayout::kThreads;
    cfg.smem = l.smem_bytes();
    jit::launch(f, cfg, stream, tmap_q, a.k_i, a.w, a.ks, a.ke, a.vals, a.vals_stride, a.vals_row0, a.g, a.mass, a.lse,
                a.di_out, a.di_stride, a.dk_part, a.part_rows, a.mask, a.mask_stride, a.mask_row0, a.row_begin, a.row_end, a.rows_per_split, a.key_begin,
                a.num_kblocks, a.num_keys);
  }
};

// dq_I and dw (row-major): S recomputed (fp32 dq_I), or with `masked` the signs from the dk kernel's mask
// (training_indexer_dq_masked_kernel; dq_I fp32 or, with bf16_out, bf16).
struct TrainingIndexerDqRuntime : jit::KernelRuntime<TrainingIndexerDqRuntime> {
  struct Params {
    int head_dim;
    bool masked;
    bool bf16_out;
  };
  static const char* kernel_name() { return "training_indexer_dq"; }
  static const char* header() { return "deep_indexer/training/training_indexer_bwd.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("training_indexer_dq<D={}{}{}>", p.head_dim, p.masked ? ",masked" : "", p.bf16_out ? ",bf16" : "");
  }
  static std::string instantiation(const Params& p) {
    DI_CHECK_ARG(p.masked || !p.bf16_out, "training_indexer_dq: bf16 dq_I only with the mask");
    return p.masked ? fmt::format("&deep_indexer::training_indexer_dq_masked_kernel<{}, {}>", p.head_dim, p.bf16_out)
                    : fmt::format("&deep_indexer::training_indexer_dq_kernel<{}>", p.head_dim);
  }
  static unsigned smem_bytes(const Params& p) { return training_indexer_bwd_layout(p.head_dim).smem_bytes(); }

  struct Args {
    Params params;
    const void* q_i;  // [T, 64, D] bf16
    const void* k_i;  // [N, D] bf16
    const float* w;   // [T, 64]
    const int *ks, *ke;
    const float* di;
    int64_t di_stride;
    int di_row0;
    const uint32_t* mask;  // masked only, as written by the dk kernel
    int64_t mask_stride;
    int mask_row0, mask_key0, mask_key1;  // the dk call's rows from mask_row0 and keys [mask_key0, mask_key1)
    void* dq;   // [T, 64, D] fp32 (bf16 with bf16_out)
    float* dw;  // [T, 64]
    int row_begin, row_end, num_keys;
  };

  static void launch(const Args& a, CUstream stream, int device) {
    if (a.row_end <= a.row_begin) return;
    const TrainingIndexerBwdLayout l = training_indexer_bwd_layout(a.params.head_dim);
    const CUfunction f = function(a.params, device, stream);
    const CUtensorMap tmap_k = jit::make_bf16_rows_map(a.k_i, static_cast<uint64_t>(a.num_keys),
                                                       static_cast<uint64_t>(a.params.head_dim),
                                                       TrainingIndexerBwdLayout::kTileRows, "k_I");
    jit::LaunchConfig cfg;
    const int rows_per_cta =
        a.params.masked ? TrainingIndexerBwdLayout::kMaskedRowsPerCta : TrainingIndexerBwdLayout::kRowsPerCta;
    cfg.grid = static_cast<unsigned>((a.row_end - a.row_begin + rows_per_cta - 1) / rows_per_cta);
    cfg.block = TrainingIndexerBwdLayout::kThreads;
    cfg.smem = l.smem_bytes();
    if (a.params.masked)
      jit::launch(f, cfg, stream, tmap_k, a.q_i, a.w, a.ks, a.ke, a.di, a.di_stride, a.di_row0, a.mask, a.mask_stride,
                  a.mask_row0, a.mask_key0, a.dq, a.dw, a.row_begin, a.row_end, a.mask_key1);
    else
      jit::launch(f, cfg, stream, tmap_k, a.q_i, a.w, a.ks, a.ke, a.di, a.di_stride, a.di_row0,
                  static_cast<float*>(a.dq), a.dw, a.row_begin, a.row_end, a.num_keys);
  }
};

}  // namespace deep_indexer
