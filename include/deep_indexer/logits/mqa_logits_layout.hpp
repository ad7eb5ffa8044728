// Launch geometry and shared-memory layout of the prefill kernel `mqa_logits_kernel`
// (include/deep_indexer/logits/mqa_logits.cuh). Plain C++17: usable from host code compiled by g++ (no
// CUDA headers) and from device code (the kernel builds a constexpr instance from its template
// parameters, so host and device agree on every number below).
//
// Quantities (H = num_heads, D = head_dim, all sizes in bytes unless noted):
//   q_rows_per_tile()  128: rows of q ([S*H, D] view, row = s*H + h) one math warpgroup multiplies
//                      with every KV tile; also the TMA box height of the q tensor map.
//   block_q()          128 / H: query tokens owned by one math warpgroup (16 -> 8, 32 -> 4,
//                      64 -> 2, 128 -> 1).
//   num_math_wgs()     math warpgroups per CTA: default_math_wgs(H, D) = 2 (accumulators double-
//                      buffered, setmaxnreg 40/232) or 3 for H = 128 (single-buffered, 24/160).
//                      The optional 5th field math_wgs overrides it (for mqa_logits_kernel_wgs).
//                      launch_regs() and valid() check the register split against the CTA's
//                      allocation and one SM sub-partition's register file. NOTES: ptxas compiles
//                      the whole kernel within launch_regs() (setmaxnreg only moves registers at run
//                      time), so 4 math warpgroups next to a producer warpgroup (640 threads, 96
//                      registers) spill; with the producer folded into a math warp (512 threads,
//                      128 registers) they launched but ran 2.2-2.3x slower (bench/NOTES.md).
//   tokens_per_cta()   num_math_wgs() * block_q(): query tokens of one "q block". The persistent
//                      grid walks q blocks round-robin (block = blockIdx.x + k * gridDim.x);
//                      number of q blocks = ceil(S / tokens_per_cta()); grid = min(that, #SMs).
//   block_kv()         64: KV rows per KV tile; also the TMA box height of the k tensor map.
//   in_bytes           (7th field) bytes per q / k element: 1 = fp8 e4m3 (the inference ops, with
//                      k scales), 2 = bf16 (the training forward of deep_indexer.training, no scales;
//                      D 64 or 128, no split_relu).
//   row_bytes()        D * in_bytes: one q or k row.
//   swizzle_bytes()    min(row_bytes(), 128): the TMA swizzle mode of both tensor maps (32B, 64B or
//                      128B) and the inner box dimension in bytes. A tile is stored as col_blocks() =
//                      row_bytes() / swizzle_bytes() column blocks of [rows][swizzle_bytes()] (one
//                      TMA box each); a K step (32 bytes: k32 fp8, k16 bf16) stays inside one block.
//   num_threads()      128 * (num_math_wgs() + 1) = 384 (512 for H = 128): warpgroup 0 is the
//                      producer (warp 0 TMA, warps 1..3 the -inf fill), the math warpgroups follow.
//   num_kv_stages      depth of the KV ring (template parameter kNumKVStages).
//   q_tile_bytes()     mma_n() * D rounded up to 1024 (q_box_bytes() = 128 * D of it come by TMA),
//                      kv_tile_bytes() 64 * D.
//   info_bytes()       per q stage: block header {lo, num_tiles}, per-token clamped ranges and
//                      the block's weights, written by the producer.
//   offset_*()         offsets from the 1024-aligned base of dynamic shared memory:
//                        q tiles   [kNumQStages = 2][num_math_wgs()] x q_tile_bytes()
//                        kv tiles  [num_kv_stages] x kv_tile_bytes()
//                        info      [kNumQStages] x info_bytes()
//                        barriers  q_full[2], q_empty[2], kv_full[stages], kv_empty[stages] (8 B each)
//   smem_bytes()       dynamic shared memory to request at launch (includes kAlign bytes of slack
//                      so the kernel can align its base to 1024 bytes). Set
//                      CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to this value.
//   split_relu         (6th field) relu(x) = (x + |x|) / 2 with the linear half on the tensor cores:
//                      each math warpgroup appends linear_rows() rows to its q tile, holding
//                      kLinearPieces fp8 pieces of q~[t] = sum_h w[t, h] q[t, h, :] per token (each
//                      piece with its own per-token scale, the residual of the previous ones); the
//                      WGMMA N grows to mma_n() = 128 + linear_rows() and the epilogue needs one
//                      FFMA (|x| is a free operand modifier) instead of max + FFMA per element.
//                      Row 128 + 8 (t / 2) + 2 p + (t % 2) holds piece p of token t, so that an
//                      accumulator column's token depends on its register only and its piece on
//                      the lane's quad (p = quad).
//   max_kv_stages(H, D, out_bytes)  (static) the largest stage count that fits kMaxSmem (capped
//                      at kMaxKVStages) for the default number of math warpgroups; valid() requires
//                      2 <= num_kv_stages <= that. A handful of stages is plenty: the depth beyond
//                      that does not change the time.
#pragma once

#include <deep_indexer/common/host_device.hpp>

namespace deep_indexer {

struct MqaLogitsLayout {
  int num_heads;      // H: 16, 32, 64 or 128
  int head_dim;       // D: 32, 64 or 128 (fp8 bytes per row)
  int num_kv_stages;  // KV ring depth
  int out_bytes;      // 4 (float32 logits) or 2 (bfloat16 logits); does not change the layout
  int math_wgs = 0;   // math warpgroups per CTA (2 or 3); 0 = default_math_wgs(H, D). Leave it out.
  bool split_relu = false;  // linear half of relu on the tensor cores (see above)
  int in_bytes = 1;         // 1: fp8 q / k (with k scales), 2: bf16 (see above)

  static constexpr int kMaxSmem = 232448;  // 227 KB opt-in dynamic shared memory on SM90
  static constexpr int kQRowsPerTile = 128;
  static constexpr int kBlockKV = 64;
  static constexpr int kNumQStages = 2;
  static constexpr int kThreadsPerWG = 128;
  static constexpr int kAlign = 1024;        // alignment of every tile (one 128B-swizzle atom)
  static constexpr int kInfoHeaderBytes = 256;  // {lo, num_tiles} at 0, int2 ranges at 16
  static constexpr int kMaxKVStages = 32;
  static constexpr int kLinearPieces = 4;  // = lanes per quad: piece p sits in quad p's columns

  // ---- geometry
  DI_HOST_DEVICE constexpr int q_rows_per_tile() const { return kQRowsPerTile; }
  DI_HOST_DEVICE constexpr int q_box_rows() const { return kQRowsPerTile; }
  DI_HOST_DEVICE constexpr int block_q() const { return kQRowsPerTile / num_heads; }
  // 2 math warpgroups with double-buffered accumulators, except H = 128 (1 token per warpgroup),
  // where 3 single-buffered warpgroups are faster (a token per warpgroup leaves a short epilogue).
  DI_HOST_DEVICE static constexpr int default_math_wgs(int h, int /*d*/) { return h == 128 ? 3 : 2; }
  DI_HOST_DEVICE constexpr int num_math_wgs() const {
    return math_wgs == 0 ? default_math_wgs(num_heads, head_dim) : math_wgs;
  }
  DI_HOST_DEVICE constexpr int tokens_per_cta() const { return num_math_wgs() * block_q(); }
  // Extra B rows per math warpgroup: an 8-row group per pair of tokens (4 pieces x 2 tokens).
  DI_HOST_DEVICE constexpr int linear_rows() const { return split_relu ? 8 * ((block_q() + 1) / 2) : 0; }
  DI_HOST_DEVICE constexpr int mma_n() const { return kQRowsPerTile + linear_rows(); }
  // Warp roles: warpgroup 0 is the producer (warp 0 TMA, warps 1..3 the -inf fill), the math
  // warpgroups follow. setmaxnreg moves registers from the producer to the math warpgroups: 2 math
  // warpgroups double-buffer their accumulators (232 registers), 3 do not (160).
  DI_HOST_DEVICE constexpr int producer_warps() const { return 4; }
  DI_HOST_DEVICE constexpr int producer_regs() const { return num_math_wgs() == 2 ? 40 : 24; }
  DI_HOST_DEVICE constexpr int math_regs() const { return num_math_wgs() == 2 ? 232 : 160; }
  DI_HOST_DEVICE constexpr bool double_buffered() const { return num_math_wgs() == 2; }
  // Register file: 4 SM sub-partitions of kRegsPerSubPartition each; warp w of the CTA runs on
  // sub-partition w % 4, so each holds one warp of every warpgroup (ceil(warps / 4) warps).
  // Registers are allocated per warp in units of 8 per thread. A launch gets launch_regs() per
  // thread (what __launch_bounds__(num_threads(), 1) lets ptxas use outside
  // the setmaxnreg regions). setmaxnreg.inc draws on the CTA's pool (the launch allocation), so the
  // split must fit both that and one sub-partition (valid()).
  static constexpr int kRegsPerSubPartition = 16384;
  static constexpr int kRegGranule = 8;
  DI_HOST_DEVICE constexpr int warps_per_subpartition() const { return (num_threads() / 32 + 3) / 4; }
  DI_HOST_DEVICE constexpr int launch_regs() const {
    return kRegsPerSubPartition / (32 * warps_per_subpartition()) / kRegGranule * kRegGranule;
  }
  DI_HOST_DEVICE constexpr int split_regs_per_subpartition() const {
    return 32 * (producer_regs() + num_math_wgs() * math_regs());
  }
  DI_HOST_DEVICE constexpr int block_kv() const { return kBlockKV; }
  DI_HOST_DEVICE constexpr int k_box_rows() const { return kBlockKV; }
  DI_HOST_DEVICE constexpr int row_bytes() const { return head_dim * in_bytes; }
  DI_HOST_DEVICE constexpr int swizzle_bytes() const { return row_bytes() < 128 ? row_bytes() : 128; }
  DI_HOST_DEVICE constexpr int box_elems() const { return swizzle_bytes() / in_bytes; }  // TMA box inner size
  DI_HOST_DEVICE constexpr int col_blocks() const { return row_bytes() / swizzle_bytes(); }
  DI_HOST_DEVICE constexpr int k_steps() const { return row_bytes() / 32; }  // WGMMA K steps of 32 bytes
  DI_HOST_DEVICE constexpr int q_col_block_bytes() const { return mma_n() * swizzle_bytes(); }
  DI_HOST_DEVICE constexpr int kv_col_block_bytes() const { return kBlockKV * swizzle_bytes(); }
  DI_HOST_DEVICE constexpr int num_threads() const { return kThreadsPerWG * num_math_wgs() + 32 * producer_warps(); }
  DI_HOST_DEVICE constexpr int num_q_stages() const { return kNumQStages; }
  // Number of q blocks for S query tokens (the host sizes the persistent grid with it).
  DI_HOST_DEVICE constexpr long long num_q_blocks(long long s) const {
    return (s + tokens_per_cta() - 1) / tokens_per_cta();
  }

  // ---- shared memory
  DI_HOST_DEVICE constexpr int q_tile_bytes() const { return align_up(mma_n() * row_bytes(), kAlign); }
  DI_HOST_DEVICE constexpr int q_box_bytes() const { return q_box_rows() * row_bytes(); }  // all column blocks
  DI_HOST_DEVICE constexpr int kv_tile_bytes() const { return kBlockKV * row_bytes(); }
  DI_HOST_DEVICE constexpr int info_bytes() const { return align_up(info_offset_end(), 128); }
  DI_HOST_DEVICE constexpr int offset_q(int stage, int wg) const {
    return (stage * num_math_wgs() + wg) * q_tile_bytes();
  }
  DI_HOST_DEVICE constexpr int offset_kv(int stage) const {
    return offset_q(kNumQStages, 0) + stage * kv_tile_bytes();
  }
  DI_HOST_DEVICE constexpr int offset_info(int qstage) const {
    return offset_kv(num_kv_stages) + qstage * info_bytes();
  }
  // Inside one info block: int lo (union start), int num_tiles, then int2 {lo, hi} per token of the
  // q block (clamped to [0, SKV]; empty when hi <= lo; (0, 0) for tokens >= S), then the weights
  // of the q block as float[tokens_per_cta() * num_heads] (token-major, 0 for tokens >= S), then
  // (split_relu) the pieces' per-token max |value| as float bits [tokens_per_cta()][kLinearPieces],
  // written by the math warpgroups (split_relu::build_pieces).
  DI_HOST_DEVICE constexpr int info_offset_ranges() const { return 16; }
  DI_HOST_DEVICE constexpr int info_offset_weights() const { return kInfoHeaderBytes; }
  DI_HOST_DEVICE constexpr int info_offset_amax() const { return kInfoHeaderBytes + 4 * tokens_per_cta() * num_heads; }
  DI_HOST_DEVICE constexpr int info_offset_end() const {
    return info_offset_amax() + (split_relu ? 4 * kLinearPieces * tokens_per_cta() : 0);
  }
  // fp8: the k scales of each KV stage's 64 rows (copied by the producer warp's cp.async), 256 B per stage.
  DI_HOST_DEVICE constexpr int scale_stage_bytes() const { return in_bytes == 1 ? 4 * kBlockKV : 0; }
  DI_HOST_DEVICE constexpr int offset_scales(int stage) const {
    return offset_info(kNumQStages) + stage * scale_stage_bytes();
  }
  DI_HOST_DEVICE constexpr int offset_barriers() const { return offset_scales(num_kv_stages); }
  DI_HOST_DEVICE constexpr int num_barriers() const { return 2 * kNumQStages + 2 * num_kv_stages; }
  DI_HOST_DEVICE constexpr int offset_q_full(int s) const { return offset_barriers() + 8 * s; }
  DI_HOST_DEVICE constexpr int offset_q_empty(int s) const { return offset_barriers() + 8 * (kNumQStages + s); }
  DI_HOST_DEVICE constexpr int offset_kv_full(int s) const { return offset_barriers() + 8 * (2 * kNumQStages + s); }
  DI_HOST_DEVICE constexpr int offset_kv_empty(int s) const {
    return offset_barriers() + 8 * (2 * kNumQStages + num_kv_stages + s);
  }
  DI_HOST_DEVICE constexpr int smem_used_bytes() const { return offset_barriers() + 8 * num_barriers(); }
  DI_HOST_DEVICE constexpr int smem_bytes() const { return smem_used_bytes() + kAlign; }

  // ---- validity
  DI_HOST_DEVICE static constexpr bool supported_shape(int h, int d, int in_bytes = 1) {
    return (h == 16 || h == 32 || h == 64 || h == 128) &&
           (in_bytes == 1 ? (d == 32 || d == 64 || d == 128) : in_bytes == 2 && (d == 64 || d == 128));
  }
  DI_HOST_DEVICE static constexpr int max_kv_stages(int h, int d, int out_bytes, int math_wgs = 0,
                                                    bool split_relu = false, int in_bytes = 1) {
    int best = 0;
    if (!supported_shape(h, d, in_bytes) || (out_bytes != 2 && out_bytes != 4)) return 0;
    for (int s = 1; s <= kMaxKVStages; ++s)
      if (MqaLogitsLayout{h, d, s, out_bytes, math_wgs, split_relu, in_bytes}.smem_bytes() <= kMaxSmem) best = s;
    return best;
  }
  DI_HOST_DEVICE constexpr bool valid() const {
    return supported_shape(num_heads, head_dim, in_bytes) && !(split_relu && in_bytes != 1) &&
           (out_bytes == 2 || out_bytes == 4) && num_kv_stages >= 2 &&
           num_kv_stages <= kMaxKVStages && smem_bytes() <= kMaxSmem &&
           (num_math_wgs() == 2 || num_math_wgs() == 3) && tokens_per_cta() <= 32 && mma_n() <= 256 &&
           info_offset_ranges() + 8 * tokens_per_cta() <= info_offset_weights() &&
           launch_regs() <= 255 && split_regs_per_subpartition() <= kRegsPerSubPartition &&
           32 * producer_warps() * producer_regs() + num_math_wgs() * kThreadsPerWG * math_regs() <=
               num_threads() * launch_regs() &&
           producer_regs() % kRegGranule == 0 && math_regs() % kRegGranule == 0 &&
           // every tile on a 1024-byte boundary (the 128B swizzle atom; 32B/64B atoms divide it)
           q_tile_bytes() % kAlign == 0 && kv_tile_bytes() % kAlign == 0 && offset_kv(0) % kAlign == 0 &&
           // several column blocks (bf16, D = 128): each on a 1024-byte boundary too
           (col_blocks() == 1 || (q_col_block_bytes() % kAlign == 0 && kv_col_block_bytes() % kAlign == 0)) &&
           offset_info(0) % 16 == 0 && info_bytes() % 16 == 0 && offset_barriers() % 8 == 0 &&
           info_offset_end() % 16 == 0;
  }

 private:
  DI_HOST_DEVICE static constexpr int align_up(int x, int a) { return (x + a - 1) / a * a; }
};

}  // namespace deep_indexer

