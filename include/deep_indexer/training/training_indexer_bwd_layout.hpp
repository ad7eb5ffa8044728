// Launch geometry and shared-memory layout of the indexer backward kernels
// (include/deep_indexer/training/training_indexer_bwd.cuh), H_I = 64 indexer heads, D_I = head_dim (64 or 128):
//   training_indexer_dk_kernel  key-major: a CTA owns 128 keys (64 per math warpgroup) and streams the
//                               rows t of a row range whose key range meets them (one 64 x D_I tile of
//                               q_I per row); dk_I partial per row range.
//   training_indexer_dq_kernel  row-major: a CTA owns 2 rows (one per math warpgroup) and streams the
//                               64-key tiles of k_I over the union of their ranges; dq_I and dw.
//   training_indexer_dq_masked_kernel  as the dq kernel with 4 rows (2 per math warpgroup) and no S: the
//                               signs [S > 0] come from the dk kernel's mask (below), so per tile only
//                               G' += dS' x tile with dS' = bf16(dI) [S > 0]; then dq_I = w G', dw = q_I . G'.
// The sign mask (dk kernel with kMask, read by the masked dq kernel): per row t and 64-key tile of the dk
// grid (keys key_begin + 64 b), 128 words, word 32 warp + lane of the dk warpgroup that owns the tile, bit j
// = [acc[j] > 0] of that thread's S accumulator (see training_indexer_bwd.cuh): kMaskWordsPerTile words.
// Both: warpgroup 0 = producer (its 4 warps take the items round-robin: TMA of the tile + the small
// per-item values into the stage's info), warpgroups 1, 2 = math. Per item a math warpgroup runs
//   S = A (64 x D_I, registers) x tile^T        WGMMA m64n64k16 x D_I / 16, tile K-major
//   dS (bf16, registers) from S and the item's values (epilogue)
//   G += dS (64 x 64) x tile                    WGMMA m64nD_Ik16 x 4, tile MN-major (same shared memory)
// software-pipelined: the next item's S WGMMAs are issued before this item's dS epilogue (two S
// accumulators), so the epilogue runs while the tensor cores work.
//
//   tile_bytes()   64 rows x D_I bf16 = D_I / 64 blocks of [64 rows][128 B] (128-byte swizzle, TMA box
//                  {64, 64}); the blocks are mn_block_bytes() apart (the MN-major descriptor's LBO).
//   info_bytes()   per stage: a header (int item, lo, hi; float g, mass, lse) and kInfoFloats floats:
//                    dk kernel: [0, 64) the row's weights w[t, :], [64, 192) its values at the CTA's 128 keys
//                    dq kernel: [0, 128) dI of the CTA's 2 rows at the tile's 64 keys
//                    masked dq kernel: words [0, 128) dI of the CTA's 4 rows as bf16 pairs (row r: 32 r +
//                    key pair), [128, 640) the 4 rows' mask words of the tile (row r: 128 + 128 r)
//   num_stages()   as many stages as fit (at most kMaxStages).
//   barriers       full[s] 32 arrivals (producer warp) + the tile's bytes, empty[s] 8 (math warps).
#pragma once

#include <deep_indexer/common/host_device.hpp>

namespace deep_indexer {

struct TrainingIndexerBwdLayout {
  int head_dim;  // D_I: 64 or 128

  static constexpr int kNumHeads = 64;  // H_I
  static constexpr int kTileRows = 64;
  static constexpr int kSwizzleBytes = 128;
  static constexpr int kThreads = 384;
  static constexpr int kMathWarps = 8;
  static constexpr int kProducerWarps = 4;  // take items (dk) / tiles (dq) round-robin
  static constexpr int kKeysPerCta = 128;  // dk kernel
  static constexpr int kRowsPerCta = 2;    // dq kernel
  static constexpr int kMaskedRowsPerCta = 4;  // masked dq kernel
  static constexpr int kMaskWordsPerTile = 128;  // one bit per (key, head) of a 64-key tile: 64 x 64 / 32
  static constexpr int kInfoHeaderBytes = 32;
  static constexpr int kInfoFloats = 128 + kMaskedRowsPerCta * kMaskWordsPerTile;  // the masked dq kernel's (largest)
  static constexpr int kMaxStages = 8;
  static constexpr int kAlign = 1024;
  static constexpr int kMaxSmem = 232448;
  static constexpr int kProducerRegs = 40;
  static constexpr int kMathRegs = 232;

  DI_HOST_DEVICE constexpr int k_steps() const { return head_dim / 16; }
  DI_HOST_DEVICE constexpr int num_kblocks() const { return head_dim / 64; }
  DI_HOST_DEVICE constexpr int mn_block_bytes() const { return kTileRows * kSwizzleBytes; }
  DI_HOST_DEVICE constexpr int tile_bytes() const { return num_kblocks() * mn_block_bytes(); }
  DI_HOST_DEVICE constexpr int info_bytes() const { return kInfoHeaderBytes + 4 * kInfoFloats; }
  DI_HOST_DEVICE constexpr int bytes_for(int stages) const { return stages * (tile_bytes() + info_bytes() + 16); }
  DI_HOST_DEVICE constexpr int num_stages() const {
    int best = 0;
    for (int s = 1; s <= kMaxStages; ++s)
      if (bytes_for(s) + kAlign <= kMaxSmem) best = s;
    return best;
  }
  DI_HOST_DEVICE constexpr int offset_tile(int s) const { return s * tile_bytes(); }
  DI_HOST_DEVICE constexpr int offset_info(int s) const { return offset_tile(num_stages()) + s * info_bytes(); }
  DI_HOST_DEVICE constexpr int offset_barriers() const { return offset_info(num_stages()); }
  DI_HOST_DEVICE constexpr int offset_full(int s) const { return offset_barriers() + 8 * s; }
  DI_HOST_DEVICE constexpr int offset_empty(int s) const { return offset_barriers() + 8 * (num_stages() + s); }
  DI_HOST_DEVICE constexpr int smem_used_bytes() const { return offset_barriers() + 16 * num_stages(); }
  DI_HOST_DEVICE constexpr int smem_bytes() const { return smem_used_bytes() + kAlign; }

  // Mask words per row for keys [key_begin, key_end) of a dk call (whole 128-key blocks).
  DI_HOST_DEVICE static constexpr long long mask_words_per_row(long long num_keys) {
    return (num_keys + kKeysPerCta - 1) / kKeysPerCta * (kKeysPerCta / kTileRows) * kMaskWordsPerTile;
  }

  DI_HOST_DEVICE static constexpr bool supported_shape(int heads, int dim) {
    return heads == kNumHeads && (dim == 64 || dim == 128);
  }
  DI_HOST_DEVICE constexpr bool valid() const {
    return supported_shape(kNumHeads, head_dim) && num_stages() >= 2 && smem_bytes() <= kMaxSmem &&
           tile_bytes() % kAlign == 0 && info_bytes() % 16 == 0 && offset_barriers() % 8 == 0 &&
           128 * kProducerRegs + 256 * kMathRegs <= kThreads * 168 &&
           // A fragments (D_I / 4) + two S accumulators (2 x 32, software pipeline) + G (D_I / 2) + dS
           // fragments (16) + working set
           head_dim / 4 + 2 * 32 + head_dim / 2 + 16 + 48 <= kMathRegs;
  }
};

}  // namespace deep_indexer
