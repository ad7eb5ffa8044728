// Launch geometry and shared-memory layout of the `per_head` warm-up loss kernels
// (include/deep_indexer/training_per_head.cuh): indexer head h against attention head h over 64-key tiles,
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
//   Row values (the backward, and the dk stages): RowInfo, 8 x 4 bytes per (head, row), head-major.
#pragma once

#include <deep_indexer/host_device.hpp>

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
  static constexpr int kMaxStages = 8;
  static constexpr int kAlign = 1024;
  static constexpr int kMaxSmem = 232448;
  static constexpr int kProducerRegs = 40;
  static constexpr int kMathRegs = 232;

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
      if (s * (rows_stage_bytes() + 16) + kAlign <= kMaxSmem) best = s;
    return best;
  }
  DI_HOST_DEVICE constexpr int rows_offset_barriers() const { return rows_stages() * rows_stage_bytes(); }
  DI_HOST_DEVICE constexpr int rows_smem_bytes() const { return rows_offset_barriers() + 16 * rows_stages() + kAlign; }

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
           // rows kernel: q and q_I fragments, S and S_I (32 each), dq (D_I / 2), dS (16), working set (48: the
           // backward of (256, 64) and (64, 128) spilled with 40 assumed)
           qk_dim / 4 + head_dim / 4 + 64 + head_dim / 2 + 16 + 48 <= kMathRegs;
  }
};

}  // namespace deep_indexer
