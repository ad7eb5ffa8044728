// Shared-memory layout and launch configuration of the decode kernel `paged_mqa_logits_kernel`
// (include/deep_indexer/logits/paged_mqa_logits.cuh). Plain C++17: the host (g++, no CUDA headers) and
// the device code (constexpr) read the same numbers from here.
//
// Host usage:
//   PagedMqaLogitsLayout l = make_paged_mqa_layout(next_n, num_heads, head_dim, block_kv, out_bytes, math_wgs,
//                                                  max_stages);
//   (math_wgs 0: the default for N = next_n * num_heads; num_kv_stages: the deepest ring that fits,
//   at most max_stages rounded down to the ring's granularity)
//   if (!l.valid()) -> unsupported shape
//   grid  = num_sms (== schedule rows - 1), one CTA per SM, persistent
//   block = l.num_threads()
//   dynamic shared memory = l.smem_bytes() (raise CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
//   tmap_q : 2-D {head_dim, B*next_n*num_heads} fp8, row stride head_dim bytes,
//            box {head_dim, l.q_box_rows()}, swizzle = head_dim bytes (128B for D=128, 64B for D=64)
//   tmap_kv: 3-D {head_dim, block_kv, num_blocks} uint8/fp8, strides {head_dim, kv_cache.stride(0)} bytes,
//            box {head_dim, block_kv, 1}, swizzle = head_dim bytes
//   kernel template args: <next_n, num_heads, head_dim, block_kv, l.num_kv_stages, l.num_math_wgs(),
//                          context_lens_2d, OutT, l.split_relu, varlen, q_fp4, kv_fp4>
//
// FP4 (q_fp4: q rows are e2m1 codes + a scale word; kv_fp4: the paged cache holds D / 2 code bytes per
// key then an int32 scale word per key): the KV tile is bulk-copied unswizzled (64 x D / 2 bytes and the
// 64 scale words) and folded into e4m3 WGMMA A fragments in registers by the math warpgroups; q rows
// are bulk-copied into a staging buffer and written into the q slot (folded and/or permuted along D
// to match the register fragments, see paged_mqa_logits.cuh) by the q producer warp.
//
// Work split: every sequence is walked as 64-token tiles. get_paged_mqa_logits_metadata deals
// segments of split_kv() = 256 tokens (DeepGEMM's format). With tile_split (batches of up to
// kTileSplitMaxBatch sequences; the host takes it where segments are one to two per CTA, see
// heuristics_sm90.hpp) the kernel deals the tiles themselves instead: every CTA q or q + 1 of all tiles,
// counted from context_lens, the schedule unread. (Shorter segments in the schedule balance the tile
// counts too but make the KV producers walk more segments, which costs more.) Tile k of a CTA's walk goes
// to math warpgroup k % num_math_wgs() and KV stage k % num_kv_stages.
//
// Shared memory (offsets from a 1024-byte aligned base; smem_bytes() includes 1024 bytes of slack
// to align the dynamic shared-memory base):
//   [q slots]      Q x (next_n*H rows x D bytes), TMA-swizzled; Q = num_q_slots(): 2 (double-buffered
//                  across sequences) up to 64 KB of q rows, else 1 (next_n >= 5 with H = 128, D = 128)
//   [kv stages]    S x (64 tokens x D bytes), TMA-swizzled; a BLOCK_KV=32 tile is 2 stacked blocks
//                  (split_relu: each slot's q rows are followed by linear_cols() pieces rows)
//   [scales]       S x 64 fp32
//   [weights]      Q x next_n*H fp32
//   [q staging]    (FP4) q_stage_rows() source rows of q (D / 2 or D bytes each) + their scale words
//   [stage info]   S x int4 {generation, sequence, first token, flags}
//   [slot info]    Q x slot_info_ints() int {sequence, row lengths L_0..L_{next_n-1}}
//   [amax]         (split_relu) Q x next_n x 4 uint32: per q slot, the pieces' max |value|
//   [barriers]     full[S], empty[S], q_full[2], q_empty[2] (+ pieces_full[2]) (+ q_stage, q_stage_free) (uint64 mbarriers)
#pragma once

#include <deep_indexer/common/host_device.hpp>

namespace deep_indexer {

struct PagedMqaLogitsLayout {
  int next_n;         // 1..kMaxNextN
  int num_heads;      // 16, 32, 64, 128
  int head_dim;       // 64, 128
  int block_kv;       // 32, 64 (tokens per paged-cache block)
  int num_kv_stages;  // a multiple of stage_granularity(), <= kMaxKVStages (pick with paged_mqa_max_kv_stages)
  int out_bytes;      // 4 (float) or 2 (bf16)
  int math_wgs = 0;   // math warpgroups, 2..4; 0: default_math_wgs()
  // Linear half of relu on the tensor cores (split_relu.cuh), single-chunk shapes: math WG 0 builds
  // the pieces after the q rows of the slot once per sequence; they join the WGMMA (N + linear_cols()).
  bool split_relu = false;
  bool q_fp4 = false;   // q: FP4 codes [.., D / 2] + int32 scale words, folded into the q slot in-kernel
  bool kv_fp4 = false;  // paged cache: FP4 codes + int32 scale words per key (D / 2 + 4 bytes per key)

  // Tokens per scheduled segment, a power of two >= 64 (the metadata kernel's contract; the CPU
  // reference in the tests assumes 256).
  static constexpr int kSplitKV = 256;
  static constexpr int kTileTokens = 64;     // WGMMA M: tokens per tile
  static constexpr int kMaxKVStages = 24;    // cap on the KV ring depth
  static constexpr int kSmemLimit = 232448;  // sm_90 max dynamic shared memory per block
  static constexpr int kMaxColsPerChunk = 256;  // WGMMA N limit
  static constexpr int kSmemAlignSlack = 1024;
  static constexpr int kMaxNextN = 8;
  static constexpr int kMaxQSlotRowBytes = 65536;  // q rows of one sequence double-buffered up to this size
  static constexpr int kQStageRows = 128;          // FP4: q rows staged per pass of the q producer

  // ---------------------------------------------------------------- launch
  constexpr DI_HOST_DEVICE int split_kv() const { return kSplitKV; }
  static_assert(kSplitKV >= 64 && (kSplitKV & (kSplitKV - 1)) == 0, "split_kv: a power of two >= 64");
  // Segments of a sequence of `len` >= 0 tokens (metadata and logits kernels alike).
  static constexpr DI_HOST_DEVICE int num_segments(int len) { return len / kSplitKV + (len % kSplitKV != 0 ? 1 : 0); }
  // 64-token tiles of a sequence of `len` >= 0 tokens, and per segment.
  static constexpr DI_HOST_DEVICE int num_tiles(int len) { return len / kTileTokens + (len % kTileTokens != 0 ? 1 : 0); }
  static constexpr int kTilesPerSegment = kSplitKV / kTileTokens;
  // The in-kernel tile split reads every sequence's length in one warp, kTileSplitPerLane per lane.
  static constexpr int kTileSplitPerLane = 8;
  static constexpr int kTileSplitMaxBatch = 32 * kTileSplitPerLane;
  constexpr DI_HOST_DEVICE int tile_tokens() const { return kTileTokens; }
  // Math warpgroups (tile k -> WG k % num_math_wgs()): 3 up to N = 128, else 2 (register budget).
  // For N <= 64 the 3 WGs keep two tiles in flight each (pipeline_tiles()), which beats 4 WGs with one
  // tile each.
  // kv_fp4: 4 WGs up to N = 64, 3 up to N = 256 (folding the tiles' codes adds integer work per tile,
  // which more warpgroups overlap better; chunks of at most 128 columns leave room for the A fragments).
  constexpr DI_HOST_DEVICE int default_math_wgs() const {
    return kv_fp4 ? (n_total() <= 64 ? 4 : (n_total() <= 256 ? 3 : 2)) : (n_total() <= 128 ? 3 : 2);
  }
  constexpr DI_HOST_DEVICE int num_math_wgs() const { return math_wgs != 0 ? math_wgs : default_math_wgs(); }
  constexpr DI_HOST_DEVICE int num_threads() const { return (num_math_wgs() + 1) * 128; }  // + 1 producer WG
  // Producer warpgroup: warp 0 loads q + weights, warps 1..num_kv_producers() issue the KV tiles
  // (tile k -> producer k % P). Fewer tiles per second are needed where N is large.
  constexpr DI_HOST_DEVICE int num_kv_producers() const { return num_math_wgs() == 2 ? 2 : 3; }
  // The ring depth must be a multiple of both the math WG count (stage s always feeds WG s % W) and
  // the KV producer count (stage s is always filled by producer s % P): then every mbarrier of the
  // ring is only ever waited on by one producer and one WG, each at most one phase apart.
  constexpr DI_HOST_DEVICE int stage_granularity() const {
    return num_math_wgs() == 4 ? 12 : (num_math_wgs() == 3 ? 3 : (num_kv_producers() == 3 ? 6 : 2));  // lcm(W, P)
  }
  // Register split (setmaxnreg). With __launch_bounds__(num_threads(), 1) every thread starts with
  // launch_regs() (65536 / threads rounded down to a multiple of 8; ptxas reports exactly this);
  // the counts after the reconfiguration must fit in that pool or setmaxnreg.inc never returns.
  constexpr DI_HOST_DEVICE int launch_regs() const { return (65536 / num_threads()) / 8 * 8; }
  constexpr DI_HOST_DEVICE int producer_regs() const { return 64; }
  constexpr DI_HOST_DEVICE int math_regs() const {
    return ((num_math_wgs() + 1) * launch_regs() - producer_regs()) / num_math_wgs() / 8 * 8 > 216
               ? 216
               : ((num_math_wgs() + 1) * launch_regs() - producer_regs()) / num_math_wgs() / 8 * 8;
  }
  constexpr DI_HOST_DEVICE int blocks_per_tile() const { return kTileTokens / block_kv; }

  // ---------------------------------------------------------------- q / WGMMA N
  constexpr DI_HOST_DEVICE int n_total() const { return next_n * num_heads; }  // q rows per sequence
  // q rows are processed in chunks of whole tokens of at most 256 columns: equal chunks for next_n <= 4;
  // beyond, the fewest chunks, balanced (the last may be smaller: next_n = 5, H = 64 -> 3 + 2 tokens),
  // except one token per chunk for H = 128 and odd next_n.
  // kv_fp4: at most 128 columns per chunk (the tile's A fragments stay live across the chunks).
  constexpr DI_HOST_DEVICE int max_chunk_cols() const { return kv_fp4 ? kMaxColsPerChunk / 2 : kMaxColsPerChunk; }
  constexpr DI_HOST_DEVICE int tokens_per_chunk() const {
    const int cap = next_n < max_chunk_cols() / num_heads ? next_n : max_chunk_cols() / num_heads;
    if (next_n > 4) {
      const int chunks = (next_n + cap - 1) / cap;
      const int t = (next_n + chunks - 1) / chunks;
      // H = 128, odd next_n: 2 + ... + 2 + 1 tokens spilled (ptxas, bf16 logits); 1-token chunks do not
      return t == 2 && next_n % 2 == 1 ? 1 : t;
    }
    int t = cap;
    while (next_n % t != 0) --t;
    return t;
  }
  constexpr DI_HOST_DEVICE int num_chunks() const { return (next_n + tokens_per_chunk() - 1) / tokens_per_chunk(); }
  constexpr DI_HOST_DEVICE int chunk_cols() const { return tokens_per_chunk() * num_heads; }  // accumulator N
  // q of one sequence is loaded with q_num_boxes() TMA boxes of q_box_rows() rows (<= 256 each): the
  // fewest boxes that split the rows evenly into whole swizzle atoms (N = 640: 4 x 160).
  constexpr DI_HOST_DEVICE int q_num_boxes() const {
    int boxes = (n_total() + 255) / 256;
    while (boxes < n_total() && (n_total() % boxes != 0 || (n_total() / boxes * head_dim) % 1024 != 0)) ++boxes;
    return boxes;
  }
  constexpr DI_HOST_DEVICE int q_box_rows() const { return n_total() / q_num_boxes(); }
  // Head weights live in registers (n_total() / 4 per thread) for small N when they fit next to the
  // accumulators (the split relu's pieces columns included) with kMathRegsOther to spare, otherwise they
  // are read from shared memory (ptxas spilled multi-chunk shapes, N > 192, that passed the register count
  // alone, and the forced split relu at next_n = 8, H = 16 when its pieces were not counted).
  static constexpr int kMathRegsOther = 40;  // addresses, loop state, partial sums (from ptxas reports)
  constexpr DI_HOST_DEVICE bool weights_in_regs() const {
    return n_total() <= 192 && mma_cols() / 2 + n_total() / 4 + kMathRegsOther <= math_regs();
  }

  // Two tiles in flight per math WG (double-buffered accumulators): the epilogue of tile k runs
  // while the WGMMA of the WG's next tile computes. Single-chunk shapes whose two accumulator sets
  // fit next to the weights: 3 math WGs for N <= 64 (the default), 2 for N <= 128 (DI_PAGED_MATH_WGS=2).
  // kv_fp4: the in-flight tiles' A fragments (head_dim / 8 registers each) stay live too.
  constexpr DI_HOST_DEVICE bool pipeline_tiles() const {
    return num_chunks() == 1 && n_total() <= 128 &&
           mma_cols() + n_total() / 4 + kMathRegsOther + (kv_fp4 ? 2 * a_frag_regs() : 0) <= math_regs();
  }
  // kv_fp4: registers of one tile's A fragments (4 per 32-wide k-step).
  constexpr DI_HOST_DEVICE int a_frag_regs() const { return head_dim / 8; }
  // split_relu: the pieces columns (an 8-column group per 2 tokens) and the WGMMA N with them.
  constexpr DI_HOST_DEVICE int linear_cols() const { return split_relu ? 8 * ((next_n + 1) / 2) : 0; }
  constexpr DI_HOST_DEVICE int mma_cols() const { return chunk_cols() + linear_cols(); }

  // ---------------------------------------------------------------- shared memory
  constexpr DI_HOST_DEVICE int swizzle_bytes() const { return head_dim; }  // 128B or 64B swizzle
  // q slots (generation g uses slot g % Q, parity (g / Q) & 1). One slot where two would crowd out the KV
  // ring: the next sequence's q then loads once every math WG is done with the current one.
  constexpr DI_HOST_DEVICE int num_q_slots() const { return n_total() * head_dim <= kMaxQSlotRowBytes ? 2 : 1; }
  // Ints of a slot's info: {sequence, L_0..L_{next_n-1}}, 8 or 16.
  constexpr DI_HOST_DEVICE int slot_info_ints() const { return next_n + 1 <= 8 ? 8 : 16; }
  // A q slot: the sequence's q rows (+ the pieces rows with split_relu), 1024-aligned.
  constexpr DI_HOST_DEVICE int q_slot_bytes() const { return align1024((n_total() + linear_cols()) * head_dim); }
  constexpr DI_HOST_DEVICE int kv_row_bytes() const { return kv_fp4 ? head_dim / 2 : head_dim; }
  constexpr DI_HOST_DEVICE int kv_tile_bytes() const { return kTileTokens * kv_row_bytes(); }
  // FP4: q rows go through the staging buffer (folded / permuted by the q producer) instead of TMA.
  constexpr DI_HOST_DEVICE bool q_staged() const { return q_fp4 || kv_fp4; }
  constexpr DI_HOST_DEVICE int q_src_row_bytes() const { return q_fp4 ? head_dim / 2 : head_dim; }
  constexpr DI_HOST_DEVICE int q_stage_rows() const { return n_total() < kQStageRows ? n_total() : kQStageRows; }
  // Staged q in one pass: the math warpgroups fold the first sequence's rows (paged_mqa_logits.cuh).
  constexpr DI_HOST_DEVICE bool q0_by_math() const { return q_staged() && n_total() <= kQStageRows; }
  constexpr DI_HOST_DEVICE int q_stage_bytes() const {
    return q_staged() ? q_stage_rows() * (q_src_row_bytes() + (q_fp4 ? 4 : 0)) : 0;
  }
  constexpr DI_HOST_DEVICE int scales_bytes_per_stage() const { return kTileTokens * 4; }
  constexpr DI_HOST_DEVICE int weights_slot_bytes() const { return n_total() * 4; }
  constexpr DI_HOST_DEVICE int q_offset() const { return 0; }
  constexpr DI_HOST_DEVICE int kv_offset() const { return q_offset() + num_q_slots() * q_slot_bytes(); }
  constexpr DI_HOST_DEVICE int scales_offset() const { return kv_offset() + num_kv_stages * kv_tile_bytes(); }
  constexpr DI_HOST_DEVICE int weights_offset() const {
    return scales_offset() + num_kv_stages * scales_bytes_per_stage();
  }
  constexpr DI_HOST_DEVICE int q_stage_offset() const { return weights_offset() + num_q_slots() * weights_slot_bytes(); }
  constexpr DI_HOST_DEVICE int stage_info_offset() const { return q_stage_offset() + q_stage_bytes(); }
  constexpr DI_HOST_DEVICE int slot_info_offset() const { return stage_info_offset() + num_kv_stages * 16; }
  // split_relu: per q slot, the pieces' max |value| (float bits) [next_n][4]
  constexpr DI_HOST_DEVICE int amax_offset() const { return slot_info_offset() + num_q_slots() * slot_info_ints() * 4; }
  constexpr DI_HOST_DEVICE int barrier_offset() const {
    return amax_offset() + (split_relu ? num_q_slots() * next_n * 16 : 0);
  }
  // full[S], empty[S], q_full[2], q_empty[2], with split_relu pieces_full[2] (with one q slot the second
  // of each pair is unused), with staged q q_stage, and with q0_by_math q_stage_free
  constexpr DI_HOST_DEVICE int num_barriers() const {
    return 2 * num_kv_stages + 4 + (split_relu ? 2 : 0) + (q_staged() ? 1 : 0) + (q0_by_math() ? 1 : 0);
  }
  constexpr DI_HOST_DEVICE int smem_used_bytes() const { return barrier_offset() + num_barriers() * 8; }
  constexpr DI_HOST_DEVICE int smem_bytes() const { return smem_used_bytes() + kSmemAlignSlack; }
  // Bytes one sequence's q + weights TMA brings in (expect_tx of q_full).
  constexpr DI_HOST_DEVICE int q_tx_bytes() const { return n_total() * head_dim + weights_slot_bytes(); }

  static constexpr DI_HOST_DEVICE int align1024(int x) { return (x + 1023) / 1024 * 1024; }

  // ---------------------------------------------------------------- checks
  constexpr DI_HOST_DEVICE bool shape_supported() const {
    return next_n >= 1 && next_n <= kMaxNextN &&
           (num_heads == 16 || num_heads == 32 || num_heads == 64 || num_heads == 128) &&
           (head_dim == 64 || head_dim == 128) && (block_kv == 32 || block_kv == 64) &&
           (out_bytes == 4 || out_bytes == 2);
  }
  constexpr DI_HOST_DEVICE bool valid() const {
    return shape_supported() && num_math_wgs() >= 2 && num_math_wgs() <= 4 &&
           num_kv_stages >= stage_granularity() && num_kv_stages <= kMaxKVStages &&
           num_kv_stages % stage_granularity() == 0 &&
           producer_regs() + num_math_wgs() * math_regs() <= (num_math_wgs() + 1) * launch_regs() &&
           mma_cols() / 2 + kMathRegsOther <= math_regs() &&  // the accumulators fit
           (!split_relu || (num_chunks() == 1 && mma_cols() <= 256)) &&
           // swizzle atoms: every q slot / KV tile / q box / chunk start on a 1024-byte boundary
           q_slot_bytes() % 1024 == 0 && kv_tile_bytes() % 1024 == 0 && (q_box_rows() * head_dim) % 1024 == 0 &&
           (chunk_cols() * head_dim) % 1024 == 0 && (kv_fp4 || (block_kv * head_dim) % 1024 == 0) &&
           q_stage_bytes() % 16 == 0 && (block_kv * kv_row_bytes()) % 16 == 0 &&
           q_box_rows() <= 256 && q_box_rows() * q_num_boxes() == n_total() && chunk_cols() <= 256 &&
           chunk_cols() % 8 == 0 && smem_bytes() <= kSmemLimit;
  }
};

// Deepest KV ring that fits in shared memory: a multiple of stage_granularity(), at most max_stages
// (and kMaxKVStages) rounded down to such a multiple, at least one granule; 0 if the shape is unsupported.
constexpr DI_HOST_DEVICE int paged_mqa_max_kv_stages(int next_n, int num_heads, int head_dim, int block_kv,
                                                   int out_bytes, int math_wgs = 0,
                                                   int max_stages = PagedMqaLogitsLayout::kMaxKVStages,
                                                   bool split_relu = false, bool q_fp4 = false,
                                                   bool kv_fp4 = false) {
  const int w = PagedMqaLogitsLayout{next_n, num_heads, head_dim, block_kv, 0, out_bytes, math_wgs, split_relu, q_fp4, kv_fp4}
                    .stage_granularity();
  const int cap = max_stages < PagedMqaLogitsLayout::kMaxKVStages ? max_stages : PagedMqaLogitsLayout::kMaxKVStages;
  for (int s = (cap / w > 1 ? cap / w : 1) * w; s >= w; s -= w) {
    const PagedMqaLogitsLayout l{next_n, num_heads, head_dim, block_kv, s, out_bytes, math_wgs, split_relu, q_fp4, kv_fp4};
    if (l.valid()) return s;
  }
  return 0;
}

constexpr DI_HOST_DEVICE PagedMqaLogitsLayout make_paged_mqa_layout(
    int next_n, int num_heads, int head_dim, int block_kv, int out_bytes, int math_wgs = 0,
    int max_stages = PagedMqaLogitsLayout::kMaxKVStages, bool split_relu = false, bool q_fp4 = false,
    bool kv_fp4 = false) {
  const int stages = paged_mqa_max_kv_stages(next_n, num_heads, head_dim, block_kv, out_bytes, math_wgs, max_stages,
                                             split_relu, q_fp4, kv_fp4);
  return PagedMqaLogitsLayout{next_n, num_heads, head_dim, block_kv, stages, out_bytes, math_wgs, split_relu, q_fp4, kv_fp4};
}

// Metadata kernel launch: one CTA, no dynamic shared memory. Batches of at most
// kPagedMqaMetadataSmallBatch sequences use the compact single-chunk variant with
// kPagedMqaMetadataSmallThreads threads (4 sequences each); larger ones the general variant.
constexpr int kPagedMqaMetadataThreads = 1024;
constexpr int kPagedMqaMetadataSmallThreads = 256;
constexpr int kPagedMqaMetadataSmallBatch = 4 * kPagedMqaMetadataSmallThreads;

}  // namespace deep_indexer

