// Launch geometry and shared-memory layout of `training_logits_stats_kernel`
// (include/deep_indexer/training/training_logits.cuh): per-row statistics of the bf16 indexer logits
//   I[t, s] = sum_h w[t, h] relu(q[t, h, :] . k[s, :])   for ks[t] <= s < ke[t].
// Plain C++17, shared by host (g++) and device code.
//
//   q_rows()        128 rows of the [T*H, D] view of q per CTA (the WGMMA N); tokens_per_cta() = 128 / H.
//   block_kv()      64 keys per tile (the WGMMA M).
//   num_kblocks()   D / 64: a 128-byte-swizzled column block holds 64 bf16 of every row; a K step of
//                   16 elements is 32 bytes inside a block.
//   q_tile_bytes()  128 rows x D x 2, stored as num_kblocks() blocks of [128 rows][128 B].
//   k_tile_bytes()  64 rows x D x 2, same block structure; kNumKStages buffers (the next tile is
//                   stored while the current one is in the tensor cores).
//   smem_bytes()    offsets are from a 1024-byte-aligned base (one swizzle atom); + kAlign of slack.
#pragma once

#include <deep_indexer/common/host_device.hpp>

namespace deep_indexer {

struct TrainingLogitsLayout {
  int num_heads;  // H: 16, 32, 64 or 128
  int head_dim;   // D: 64 or 128 (bf16)

  static constexpr int kQRows = 128;
  static constexpr int kBlockKV = 64;
  static constexpr int kSwizzleBytes = 128;
  static constexpr int kSwizzleElems = kSwizzleBytes / 2;
  static constexpr int kNumThreads = 128;  // one warpgroup
  static constexpr int kNumKStages = 2;
  static constexpr int kAlign = 1024;
  static constexpr int kMaxSmem = 232448;

  DI_HOST_DEVICE constexpr int q_rows() const { return kQRows; }
  DI_HOST_DEVICE constexpr int block_kv() const { return kBlockKV; }
  DI_HOST_DEVICE constexpr int tokens_per_cta() const { return kQRows / num_heads; }
  DI_HOST_DEVICE constexpr int num_kblocks() const { return head_dim / kSwizzleElems; }
  DI_HOST_DEVICE constexpr int chunks_per_row() const { return head_dim * 2 / 16; }  // 16-byte chunks
  DI_HOST_DEVICE constexpr int q_block_bytes() const { return kQRows * kSwizzleBytes; }
  DI_HOST_DEVICE constexpr int k_block_bytes() const { return kBlockKV * kSwizzleBytes; }
  DI_HOST_DEVICE constexpr int q_tile_bytes() const { return num_kblocks() * q_block_bytes(); }
  DI_HOST_DEVICE constexpr int k_tile_bytes() const { return num_kblocks() * k_block_bytes(); }
  DI_HOST_DEVICE constexpr int offset_q() const { return 0; }
  DI_HOST_DEVICE constexpr int offset_k(int stage) const { return q_tile_bytes() + stage * k_tile_bytes(); }
  DI_HOST_DEVICE constexpr int smem_used_bytes() const { return offset_k(kNumKStages); }
  DI_HOST_DEVICE constexpr int smem_bytes() const { return smem_used_bytes() + kAlign; }
  DI_HOST_DEVICE constexpr long long num_ctas(long long tokens) const {
    return (tokens + tokens_per_cta() - 1) / tokens_per_cta();
  }

  DI_HOST_DEVICE static constexpr bool supported_shape(int h, int d) {
    return (h == 16 || h == 32 || h == 64 || h == 128) && (d == 64 || d == 128);
  }
  DI_HOST_DEVICE constexpr bool valid() const {
    return supported_shape(num_heads, head_dim) && smem_bytes() <= kMaxSmem && q_block_bytes() % kAlign == 0 &&
           k_block_bytes() % kAlign == 0 && tokens_per_cta() * num_heads == kQRows;
  }
};

}  // namespace deep_indexer
