// Launch geometry and shared-memory layout of the `per_head` warm-up loss kernels
// (include/deep_indexer/training/training_per_head.cuh): indexer head h against attention head h over 64-key tiles,
// flash-attention style (query rows x keys of one head per WGMMA). Plain C++17, shared by host and device.
//
//   training_per_head_rows_kernel<kBwd>  row-major: a CTA owns 128 query rows (2 row tiles, one per math
//        warpgroup) of one head h and streams the 64-key tiles of k (key head of h) and k_I over the union of
//        its rows' ranges. q_h and q_I,h of the warpgroup's 64 rows stay in registers (WGMMA A operands).
//          forward (kBwd = false): per (row, head) the loss term, logsumexp of I_h and the target mass;
//          backward (kBwd = true): dq_I and dw of its rows.
//   training_per_head_dk_kernel           key-major: a CTA owns 128 keys (64 per math warpgroup) and a group
//        of heads; per head the keys' k tile comes into a head buffer (double-buffered) and the row tiles whose
//        ranges meet the keys stream through the stages (q_h and q_I,h tiles and the rows' packed values).
//        dk_I partial per head group (summed by the host in a fixed order).
// Warpgroup 0 = producer (warp 0 issues TMA), warpgroups 1, 2 = math.
//
//   Tiles: 64 rows x D bf16 as D / 64 blocks of [64 rows][128 B] (128-byte swizzle, TMA box {64, 1, 64}
//   over [rows, heads, D]); blocks are block_bytes() apart.
//   Row values of the dk stages: RowInfo, 8 x 4 bytes per (head, row), head-major, written by the backward
//   row-major kernel (which, like the forward, reads the rows' bounds and values from the caller's tensors).
#pragma once

#include <deep_indexer/common/host_device.hpp>

namespace deep_indexer {

struct TrainingPerHeadLayout {
  int qk_dim;    // Dqk: 64, 128, 192 or 256
  int head_dim;  // D_I: 64 or 128

  static constexpr int kTileRows = 64;  // rows of a tile (keys or query rows) = the WGMMA M and N
  static constexpr int kRowsPerCta = 128;
  static constexpr int kKeysPerCta = 128;
  static constexpr int kSwizzleBytes = 128;
  static constexpr int kThreads = 384;
  static constexpr int kMathWarps = 8;
  static constexpr int kInfoFloats = 8;  // RowInfo
  static constexpr int kHeaderBytes = 16;
  static constexpr int kHullInts = 16;  // row-major kernel: 4 warps x {lo min, hi max, lo max, hi min}
  static constexpr int kMaxStages = 8;
  static constexpr int kAlign = 1024;
  static constexpr int kMaxSmem = 232448;
  static constexpr int kProducerRegs = 24;
  static constexpr int kMathRegs = 240;

  DI_HOST_DEVICE static constexpr bool supported(int qk, int d) {
    return (qk == 64 || qk == 128 || qk == 192 || qk == 256) && (d == 64 || d == 128);
  }
  DI_HOST_DEVICE constexpr int block_bytes() const { return kTileRows * kSwizzleBytes; }
  DI_HOST_DEVICE constexpr int qk_tile_bytes() const { return qk_dim / 64 * block_bytes(); }
  DI_HOST_DEVICE constexpr int idx_tile_bytes() const { return head_dim / 64 * block_bytes(); }
  DI_HOST_DEVICE constexpr int info_bytes() const { return kTileRows * kInfoFloats * 4; }

  // ---- row-major kernel: stage = k tile + k_I tile.
  DI_HOST_DEVICE constexpr int rows_stage_bytes() const { return qk_tile_bytes() + idx_tile_bytes(); }
  DI_HOST_DEVICE constexpr int rows_stages() const {
    int best = 0;
    for (int s = 1; s <= kMaxStages; ++s)
      if (s * (rows_stage_bytes() + 16) + 4 * kHullInts + kAlign <= kMaxSmem) best = s;
    return best;
  }
  DI_HOST_DEVICE constexpr int rows_offset_barriers() const { return rows_stages() * rows_stage_bytes(); }
  // + full / empty barriers per stage, then the hull reduction.
  DI_HOST_DEVICE constexpr int rows_smem_bytes() const {
    return rows_offset_barriers() + 16 * rows_stages() + 4 * kHullInts + kAlign;
  }

  // ---- key-major kernel: 2 head buffers (the CTA's 128 keys of k), stages = q tile + q_I tile + info + header.
  DI_HOST_DEVICE constexpr int head_buf_bytes() const { return 2 * qk_tile_bytes(); }
  DI_HOST_DEVICE constexpr int dk_stage_bytes() const { return qk_tile_bytes() + idx_tile_bytes() + info_bytes(); }
  DI_HOST_DEVICE constexpr int dk_fixed_bytes() const { return 2 * head_buf_bytes() + 8 * 4; }
  DI_HOST_DEVICE constexpr int dk_stages() const {
    int best = 0;
    for (int s = 1; s <= kMaxStages; ++s)
      if (dk_fixed_bytes() + s * (dk_stage_bytes() + kHeaderBytes + 16) + kAlign <= kMaxSmem) best = s;
    return best;
  }
  DI_HOST_DEVICE constexpr int dk_offset_stage(int s) const { return 2 * head_buf_bytes() + s * dk_stage_bytes(); }
  DI_HOST_DEVICE constexpr int dk_offset_headers() const { return dk_offset_stage(dk_stages()); }
  DI_HOST_DEVICE constexpr int dk_offset_barriers() const { return dk_offset_headers() + kHeaderBytes * dk_stages(); }
  DI_HOST_DEVICE constexpr int dk_smem_bytes() const { return dk_offset_barriers() + 16 * dk_stages() + 32 + kAlign; }

  DI_HOST_DEVICE constexpr bool valid() const {
    return supported(qk_dim, head_dim) && rows_stages() >= 2 && dk_stages() >= 2 && rows_smem_bytes() <= kMaxSmem &&
           dk_smem_bytes() <= kMaxSmem && 128 * kProducerRegs + 256 * kMathRegs <= kThreads * 168 &&
           // rows kernel: q and q_I fragments, S and S_I (32 each), dq (D_I / 2), dS (16), working set (56: the
           // backward of (256, 64) and (64, 128) spilled at 240 registers)
           qk_dim / 4 + head_dim / 4 + 64 + head_dim / 2 + 16 + 56 <= kMathRegs;
  }
};

// The values of one (head, row), log2 units; lo / hi are the row's key range (ints in float slots; 0, 0 when
// empty). The backward's dI = gq (mass exp2(I2 - lseI2) - P) is gq (exp2(I2 - lsei2) - P) with the mass folded into
// lsei2 = lseI2 - log2(mass) (+inf for mass 0), and dS = dI w = gqw (exp2(I2 - lsei2) - P) [S > 0].
struct RowInfo {
  float lse2;   // attention LSE x log2 e (0 for an empty row)
  float lsei2;  // indexer LSE x log2 e - log2(mass) (backward)
  float wl;     // w x log2 e
  float gqw;    // gq x w (backward)
  int lo, hi;
  float gq;     // g[t] / total_heads (backward)
  float pad;
};
static_assert(sizeof(RowInfo) == TrainingPerHeadLayout::kInfoFloats * 4, "RowInfo size");

// The inputs of a row-major CTA: the rows' bounds and values, straight from the caller's tensors.
struct PerHeadRowsArgs {
  const void* q;        // [T, H, Dqk] bf16
  const void* q_i;      // [T, H, D_I] bf16
  const int *ks, *ke;   // [T]
  const float* lse;     // [T, H] attention LSE (non-finite: an empty row)
  const float* w;       // [T, H]
  const float* lse_i;   // [T, H] indexer LSE (backward)
  const float* mass;    // [T, H] (backward)
  const float* g;       // [T] loss gradient / total_heads (backward)
};

// The backward's by-products for the key-major kernel: every (head, row < t_pad)'s RowInfo, the row tiles'
// hulls and intersections (CTAs of head 0), and per 128-key block the first / last row tile meeting it (atomicMin / atomicMax
// on kb_first = INT_MAX, kb_last = -1: order-independent).
struct PerHeadBwdOut {
  RowInfo* info;  // [H, t_pad]
  int *tile_lo, *tile_hi;        // per 64-row tile: the union of its rows' ranges (lo >= hi: none)
  int *tile_lo_max, *tile_hi_min;  // ... and their intersection (INT_MAX / INT_MIN when a row is empty or past T)
  int *kb_first, *kb_last;
};

}  // namespace deep_indexer
