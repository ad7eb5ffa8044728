// Launch geometry and shared-memory layout of `training_target_kernel`
// (include/deep_indexer/training/training_target.cuh): the `mean` target of the warm-up KL loss,
//   p[t, s] = inv_heads * sum_h exp(scale * q[t, h, :] . k[s, :] - lse[t, h])   for ks[t] <= s < ke[t],
// with H = 128 attention heads and one key head (MQA). Plain C++17, shared by host (g++) and device code.
//
//   One CTA per query token; clusters of `cluster` (1 or 2) CTAs own consecutive tokens and walk the
//   64-key tiles of the union of their ranges, each CTA loading 64 / cluster keys of every tile by TMA
//   multicast into every CTA of the cluster (the tile is read from L2 once per cluster).
//   Warpgroup 0: warp 0 the TMA producer, warps 1..2 the reducer (the cross-warp head sum, p stores,
//   row statistics), warp 3 idle. Warpgroups 1, 2 (math): heads [64 (w - 1), 64 w): the token's q slice
//   of 64 heads x D stays in registers as the WGMMA A operand (D / 4 registers per thread); per tile
//   WGMMA m64n64k16 x D / 16 (B = the key tile, K-major, 128-byte swizzle), then exp2, the sum over the
//   thread's two rows, a reduce-scatter over the warp's 8 row groups (3 shuffle steps), and the warp's
//   64 column sums go to the reducer through shared memory.
//
//   stage_bytes()   64 keys x D bf16 as D / 64 blocks of [64 keys][128 B] (TMA box {64, 64 / cluster},
//                   128-byte swizzle); num_stages() as many as fit (at most kMaxStages).
//   red_bytes()     kRedStages x [8 math warps][64 keys] fp32 partial sums.
//   barriers        full[stages] (1 arrival + tx), empty[stages] (8 math warps x cluster CTAs),
//                   red_full[kRedStages] (8 math warps), red_empty[kRedStages] (2 reducer warps).
//   Registers       setmaxnreg: producer warpgroup kProducerRegs, math warpgroups kMathRegs.
#pragma once

#include <deep_indexer/common/host_device.hpp>

namespace deep_indexer {

struct TrainingTargetLayout {
  int head_dim;  // Dqk: a multiple of 64, 64..576
  int cluster;   // CTAs per cluster: 1 or 2

  static constexpr int kNumHeads = 128;  // attention heads (2 math warpgroups x 64)
  static constexpr int kBlockKV = 64;    // keys per tile (the WGMMA N)
  static constexpr int kSwizzleBytes = 128;
  static constexpr int kThreads = 384;
  static constexpr int kMathWarps = 8;
  static constexpr int kReducerThreads = 64;  // warps 1..2: one key column each
  static constexpr int kRedStages = 2;
  static constexpr int kMaxStages = 8;
  static constexpr int kAlign = 1024;
  static constexpr int kMaxSmem = 232448;
  static constexpr int kProducerRegs = 40;
  static constexpr int kMathRegs = 232;
  static constexpr int kRegsPerSM = 65536;
  static constexpr int kMaxHeadDim = 576;
  // Named barriers (0 is __syncthreads): the two math warpgroups' issue order, the reducer's final sum.
  static constexpr int kBarSchedule0 = 1;  // warpgroup 1 waits here before issuing (kBarSchedule0 + 1: warpgroup 2)
  static constexpr int kBarReducer = 3;

  DI_HOST_DEVICE constexpr int k_steps() const { return head_dim / 16; }
  DI_HOST_DEVICE constexpr int q_regs() const { return head_dim / 4; }  // A fragments per thread (b32)
  DI_HOST_DEVICE constexpr int num_kblocks() const { return head_dim / 64; }
  DI_HOST_DEVICE constexpr int block_bytes() const { return kBlockKV * kSwizzleBytes; }
  DI_HOST_DEVICE constexpr int stage_bytes() const { return num_kblocks() * block_bytes(); }
  DI_HOST_DEVICE constexpr int box_rows() const { return kBlockKV / cluster; }  // keys each CTA loads per tile
  DI_HOST_DEVICE constexpr int red_bytes() const { return kRedStages * kMathWarps * kBlockKV * 4; }
  DI_HOST_DEVICE constexpr int fixed_bytes() const { return red_bytes() + 8 * (2 * kRedStages) + 16; }
  DI_HOST_DEVICE constexpr int bytes_for(int stages) const { return stages * stage_bytes() + fixed_bytes() + 16 * stages; }
  DI_HOST_DEVICE constexpr int num_stages() const {
    int best = 0;
    for (int s = 1; s <= kMaxStages; ++s)
      if (bytes_for(s) + kAlign <= kMaxSmem) best = s;
    return best;
  }
  DI_HOST_DEVICE constexpr int offset_stage(int s) const { return s * stage_bytes(); }
  DI_HOST_DEVICE constexpr int offset_red(int r) const { return offset_stage(num_stages()) + r * kMathWarps * kBlockKV * 4; }
  DI_HOST_DEVICE constexpr int offset_barriers() const { return offset_red(kRedStages); }
  DI_HOST_DEVICE constexpr int offset_full(int s) const { return offset_barriers() + 8 * s; }
  DI_HOST_DEVICE constexpr int offset_empty(int s) const { return offset_barriers() + 8 * (num_stages() + s); }
  DI_HOST_DEVICE constexpr int offset_red_full(int r) const { return offset_barriers() + 8 * (2 * num_stages() + r); }
  DI_HOST_DEVICE constexpr int offset_red_empty(int r) const {
    return offset_barriers() + 8 * (2 * num_stages() + kRedStages + r);
  }
  DI_HOST_DEVICE constexpr int offset_scratch() const { return offset_red_empty(kRedStages); }  // float2 per reducer warp
  DI_HOST_DEVICE constexpr int smem_used_bytes() const { return offset_scratch() + 16; }
  DI_HOST_DEVICE constexpr int smem_bytes() const { return smem_used_bytes() + kAlign; }

  DI_HOST_DEVICE static constexpr bool supported_head_dim(int d) { return d >= 64 && d <= kMaxHeadDim && d % 64 == 0; }
  DI_HOST_DEVICE constexpr bool valid() const {
    return supported_head_dim(head_dim) && (cluster == 1 || cluster == 2) && num_stages() >= 2 &&
           smem_bytes() <= kMaxSmem && stage_bytes() % kAlign == 0 && block_bytes() % kAlign == 0 &&
           (box_rows() * kSwizzleBytes) % kAlign == 0 && offset_barriers() % 8 == 0 &&
           // register split: producer warpgroup + 2 math warpgroups within the SM's file, and within what
           // __launch_bounds__(kThreads, 1) gives at launch (65536 / 384 = 170 -> 168 per thread)
           128 * kProducerRegs + 256 * kMathRegs <= kRegsPerSM && 128 * kProducerRegs + 256 * kMathRegs <= kThreads * 168 &&
           // q fragments + 32 accumulators + working set must fit the math warpgroups' registers
           q_regs() + 32 + 40 <= kMathRegs;
  }
};

}  // namespace deep_indexer
