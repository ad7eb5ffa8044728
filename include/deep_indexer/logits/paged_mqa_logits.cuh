// Decode kernel of the lightning indexer over a paged fp8 or FP4 KV cache (fp8_paged_mqa_logits).
//
//   logits[(b*next_n + i) * logits_stride + j] = scale_j * sum_h w[b*next_n+i, h] * relu(q[b,i,h,:] . k_j)
//   for every valid key j < L(b, i) (and j < max_context_len); nothing else is written.
//   L(b, i) = context_lens[b] - next_n + i + 1   (1-D context_lens)   or   context_lens[b, i]  (2-D)
//
// Structure (see paged_mqa_logits_layout.hpp for the numbers and the shared-memory map):
//   * Persistent grid: CTA c walks a range of (sequence, 64-token tile) items in row-major order, its
//     tiles numbered k = 0, 1, ...: the 256-token segments [schedule[c], schedule[c+1]), or with
//     tile_split (batch <= kTileSplitMaxBatch) q or q + 1 of all tiles, dealt from context_lens.
//     Sequences met in the walk are numbered "generations" g = 0, 1, ...; generation g's q and
//     weights live in q slot g % Q (Q = layout.num_q_slots(): 2, or 1 where two slots do not fit).
//   * Varlen (kVarlen, `indices`): every q row is a sequence of its own (next_n = 1) whose block-table
//     row is the first row of its run of equal consecutive ids (a warp looks back 32 ids at a time).
//   * W = layout.num_math_wgs() math warpgroups (default_math_wgs(); DI_PAGED_MATH_WGS)
//     followed by one producer warpgroup (setmaxnreg: layout.math_regs() / producer_regs()):
//       producer warp 0 ("Q producer"): for every generation g, waits q_empty[g % Q], stores the
//               sequence id and row lengths L(b, i) into the slot info, TMA-loads the next_n*H q rows
//               (2-D map, q_num_boxes boxes) and bulk-copies the weights rows into slot g % Q.
//       producer warps 1..P ("KV producers", P = layout.num_kv_producers()): every one walks all
//               tiles and issues tile k when k % P is its index: block-table entries are fetched 32 at
//               a time (a "group" of tiles, prefetched one group ahead), the 64/BLOCK_KV paged
//               blocks of the tile are TMA-loaded (3-D map over the fused cache, 128B/64B swizzle;
//               two 32-token blocks stack into one 64-row WGMMA A tile) and their fp32 scales
//               bulk-copied into stage k % S; the stage info {generation, sequence, first key,
//               flags} is stored before the arrive (release). W sentinel tiles end the walk.
//   * Math WG k % W takes tile k: WGMMA m64 x N_chunk x k32 (A = 64 keys, B = q rows, both K-major
//     swizzled; N processed in equal chunks of whole tokens <= 256 columns), then relu, head
//     weights, in-thread head sum, quad reduce-scatter with shuffles, key scale, predicated stores.
//     With layout.pipeline_tiles() (N <= 64 by default) a WG keeps two tiles in flight: the WGMMA
//     of its next tile is issued before the epilogue of the current one (double-buffered accumulators).
//     With layout.split_relu (split_relu.cuh; single-chunk shapes) the epilogue takes |x| instead of
//     relu(x) and adds the linear half from fp8 pieces of sum_h w q, which math WG 0 builds once per
//     sequence after the q rows of the slot (pieces_full[slot]); their columns join the WGMMA.
//   * FP4 (paged_fp4.cuh). kKVFp4: the KV producers bulk-copy each block's codes and scale words
//     (no tensor map); the math WG folds the tile into e4m3 A fragments in registers (per key: the
//     codes times 2^(e_group - base), the key scale 2^(base - 127)), hands the stage back at once and
//     issues register-A WGMMAs. q's head_dim is then stored permuted to match the fragments.
//     kQFp4 or kKVFp4: the Q producer bulk-copies q rows (codes + scale words, or e4m3) into a staging
//     buffer (q_stage, its own barrier) and every lane writes its rows into the slot (folded,
//     permuted), scales the weights rows by 2^(base - 127) (kQFp4), fences for the async proxy and
//     arrives on q_full without a transaction count. When a sequence's rows fit one staging pass
//     (kQ0ByMath), the first sequence's rows are folded by the math warpgroups instead (stage_q0, one
//     thread per (row, 32-value group)): they wait for that q before their first tile anyway.
//
// Barrier protocol (every parity wait is provably at most one phase away from the barrier):
//   full[s]   : count 1 (KV producer arrive.expect_tx) + TMA bytes; WG s % W waits parity (k / S) & 1.
//   empty[s]  : count 4 (lane 0 of each warp of WG s % W once its WGMMA reading the stage is done,
//               i.e. after the epilogue of the previous tile when two tiles are in flight);
//               KV producer s % P waits parity ((k / S) & 1) ^ 1 before reusing it (S % lcm(W, P) == 0
//               makes one producer and one WG own each stage).
//   q_full[x] : count 1 (Q producer) + TMA bytes (none when staged); generation g is waited with parity
//               (g / Q) & 1.
//               Math WGs wait for generation 0 before their first tile; in a CTA without work the
//               Q producer arrives on q_full[0] without loads, with slot_info[0] = -1.
//   q_empty[x]: count 4W (lane 0 of every math warp, once per generation); the Q producer waits
//               parity ((g / Q) & 1) ^ 1 before loading generation g into slot g % Q.
//   With Q = 1 generation g + 1 loads only once every math WG has handed g back: a WG waiting for it
//   has released g itself, and the other WGs reach their next tile (or sentinel) without it.
//   Every math WG waits for every generation's q_full in order (also those it has no tile of) and
//   arrives on q_empty for it only after that wait and after its last use, so the KV producers may
//   run ahead of the Q producer by any number of sequences without parity aliasing.
//   pieces_full[x] (split_relu): count 1 (thread 0 of math WG 0 once generation g's pieces are in
//               slot g % Q); a WG taking generation g waits parity (g / Q) & 1. WG 0 builds every
//               generation in order (also those it has no tile of) before its q_empty arrival for it,
//               so a phase completes before the slot can be reloaded, and WG 0 never waits on another
//               WG (stage s feeds only WG s % W), hence no cycle.
//
//   q_stage   : count 1 (Q producer) + the pass's bytes; only the Q producer waits, pass by pass. A
//               sequence's first pass is expected (expect_tx) before its row lengths are read and arrived
//               on with the weights rows once the slot is free, so the phase cannot complete early.
//               kQ0ByMath: generation 0's pass (phase 0) also brings its weights rows into slot 0; it is
//               arrived on at once (after slot_info[0] = sequence id; -1 and a plain arrival without work)
//               and waited for by the math warpgroups alone, before q_full[0].
//   q_stage_free (kQ0ByMath): count 1 (math thread 0, after a named barrier of every math thread that
//               follows their reads of generation 0's staged rows); the Q producer waits parity 0 before
//               staging generation 1. One phase per launch.
//
// Host assumptions (details in the report): q, q_sf, kv_cache and weights 16-byte aligned; kv_cache
// stride(0) (block_stride_bytes) a multiple of 16; weights_stride a multiple of 4 floats;
// gridDim.x == schedule rows - 1; blockDim.x == layout.num_threads() (checked: traps otherwise);
// dynamic smem == layout.smem_bytes(); schedule from paged_mqa_metadata_kernel on the same
// context_lens (unread with tile_split, which needs batch_size <= kTileSplitMaxBatch: traps otherwise).
#pragma once
#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>
#include <type_traits>

#include <deep_indexer/logits/paged_mqa_logits_layout.hpp>
#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/logits/paged_fp4.cuh>
#include <deep_indexer/logits/split_relu.cuh>
#include <deep_indexer/common/wgmma_fp8_rs.cuh>
#include <deep_indexer/common/trace.cuh>
#include <deep_indexer/common/varlen.cuh>

namespace deep_indexer {
namespace paged_mqa_detail {

constexpr uint64_t kKVCacheHint = ptx::kCacheEvictFirst;  // L2 policy of the KV-cache TMA loads (read once per call)

template <int I, int N, class F>
__device__ __forceinline__ void static_for(F&& f) {
  if constexpr (I < N) {
    f(std::integral_constant<int, I>{});
    static_for<I + 1, N>(f);
  }
}

// Branch-free helpers for the math warpgroups (predicated PTX instead of C++ branches: keeps the
// control flow around the WGMMAs simple for ptxas, which serializes WGMMAs across divergent paths).
__device__ __forceinline__ void mbar_wait_loop(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "DI_PAGED_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra DI_PAGED_WAIT;\n}\n" ::"r"(ptx::smem_addr(bar)),
      "r"(phase)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive_if(uint64_t* bar, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(ptx::smem_addr(bar)),
      "r"(static_cast<uint32_t>(pred))
      : "memory");
}
__device__ __forceinline__ void st_global_if(float* ptr, float v, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %2, 0;\n"
      "@p st.global.f32 [%0], %1;\n}\n" ::"l"(ptr),
      "f"(v), "r"(static_cast<uint32_t>(pred))
      : "memory");
}
__device__ __forceinline__ void st_global_if(__nv_bfloat16* ptr, float v, bool pred) {
  const __nv_bfloat16 h = __float2bfloat16_rn(v);
  const uint16_t bits = *reinterpret_cast<const uint16_t*>(&h);
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %2, 0;\n"
      "@p st.global.b16 [%0], %1;\n}\n" ::"l"(ptr),
      "h"(bits), "r"(static_cast<uint32_t>(pred))
      : "memory");
}
__device__ __forceinline__ int warp_broadcast(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// Walks the (sequence, 64-token tile) items of one CTA's range. Warp-collective: every lane of the
// calling warp must call every member with the same arguments. Sequence lengths are kept in a
// 128-sequence window (4 per lane) so zero-length sequences are skipped 128 at a time.
// A range {b0, t0, b_end, t_end} runs from tile t0 of sequence b0 to tile t_end of sequence b_end
// (exclusive), in row-major order; (batch, 0) ends with the last sequence.
template <int kNextN, bool k2D>
struct RangeWalker {
  using L = PagedMqaLogitsLayout;
  struct Item {
    int b, t, len;
  };

  const int* __restrict__ ctx;
  int batch;
  int b_end, t_end;  // exclusive end item
  int limit;         // sequences >= limit have no item in range
  int win_base;
  int win[4];

  __device__ __forceinline__ int load_len(int idx) const {
    if (idx >= batch) return 0;
    int v;
    if constexpr (k2D) {
      v = __ldg(ctx + static_cast<int64_t>(idx) * kNextN);
#pragma unroll
      for (int i = 1; i < kNextN; ++i) v = max(v, __ldg(ctx + static_cast<int64_t>(idx) * kNextN + i));
    } else {
      v = __ldg(ctx + idx);
    }
    return v > 0 ? v : 0;
  }

  __device__ __forceinline__ void load_window(int base) {
    win_base = base;
    const int lane = static_cast<int>(ptx::lane_idx());
#pragma unroll
    for (int m = 0; m < 4; ++m) win[m] = load_len(base + 32 * m + lane);
  }

  // b must lie in [win_base, win_base + 128).
  __device__ __forceinline__ int len_of(int b) const {
    const int d = b - win_base;
    const int m = d >> 5;
    const int v = m == 0 ? win[0] : (m == 1 ? win[1] : (m == 2 ? win[2] : win[3]));
    return __shfl_sync(0xffffffffu, v, d & 31);
  }

  // Smallest sequence > b with a non-zero length, or `limit`.
  __device__ __forceinline__ int next_nonempty(int b) {
    const int lane = static_cast<int>(ptx::lane_idx());
    int c = b + 1;
    while (c < limit) {
      if (c >= win_base + 128) load_window(c);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int idx = win_base + 32 * m + lane;
        const uint32_t bal = __ballot_sync(0xffffffffu, idx >= c && idx < limit && win[m] > 0);
        if (bal != 0) return win_base + 32 * m + __ffs(bal) - 1;
      }
      c = win_base + 128;
    }
    return limit;
  }

  // The range of CTA `cta` of `ctas` from the schedule rows cta and cta + 1 ({b0, s0, b_end, s_end} in
  // 256-token segments).
  __device__ __forceinline__ static int4 schedule_range(const int* __restrict__ schedule, int cta) {
    const int* row = schedule + 2 * cta;
    const int4 s = make_int4(__ldg(row), __ldg(row + 1), __ldg(row + 2), __ldg(row + 3));
    return make_int4(s.x, s.y * L::kTilesPerSegment, s.z, s.w * L::kTilesPerSegment);
  }

  // tile_split: CTA `cta` of `ctas` takes tiles [x_cta, x_cta+1) of all T tiles in row-major order,
  // x_i = i * (T / ctas) + min(i, T % ctas). batch <= L::kTileSplitMaxBatch: lane l holds the tile
  // counts of sequences [l * P, (l + 1) * P), P = L::kTileSplitPerLane. Assumes T < 2^31 (as the
  // metadata kernel assumes of the segments).
  __device__ __forceinline__ int4 tile_range(const int* __restrict__ ctx_, int batch_, int cta, int ctas) {
    ctx = ctx_;
    batch = batch_;
    constexpr int P = L::kTileSplitPerLane;
    const int lane = static_cast<int>(ptx::lane_idx());
    int tiles[P];
    int sum = 0;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      tiles[i] = L::num_tiles(load_len(lane * P + i));
      sum += tiles[i];
    }
    const int incl = static_cast<int>(ptx::warp_prefix_sum(static_cast<uint32_t>(sum)));
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    const int q = total / ctas, r = total % ctas;
    const int x0 = cta * q + min(cta, r);
    const int x1 = x0 + q + (cta < r ? 1 : 0);
    // The (sequence, tile) of tile x < total, or (batch, 0) for x == total.
    auto locate = [&](int x) -> int2 {
      const uint32_t bal = __ballot_sync(0xffffffffu, incl > x);
      if (bal == 0) return make_int2(batch, 0);
      const int owner = __ffs(bal) - 1;
      int run = incl - sum, b = 0, t = 0;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        if (x >= run && x < run + tiles[i]) b = lane * P + i, t = x - run;
        run += tiles[i];
      }
      return make_int2(__shfl_sync(0xffffffffu, b, owner), __shfl_sync(0xffffffffu, t, owner));
    };
    const int2 s = locate(x0), e = locate(x1);
    return make_int4(s.x, s.y, e.x, e.y);
  }

  __device__ __forceinline__ bool valid(const Item& it) const {
    return it.b < limit && (it.b < b_end || (it.b == b_end && it.t < t_end));
  }

  __device__ __forceinline__ Item to_sequence(int b) const {
    return Item{b, 0, b < limit ? len_of(b) : 0};
  }

  __device__ __forceinline__ Item first(const int4& range, const int* __restrict__ ctx_, int batch_) {
    ctx = ctx_;
    batch = batch_;
    const int b0 = range.x, t0 = range.y;
    b_end = range.z;
    t_end = range.w;
    limit = min(t_end > 0 ? b_end + 1 : b_end, batch);
    if (b0 >= limit) {
      win_base = 0;
      return Item{limit, 0, 0};
    }
    load_window(b0);
    Item it{b0, t0, len_of(b0)};
    if (t0 >= L::num_tiles(it.len)) it = to_sequence(next_nonempty(b0));  // defensive
    return it;
  }

  __device__ __forceinline__ Item next_sequence(const Item& it) { return to_sequence(next_nonempty(it.b)); }

  // ---- groups: the tiles of one sequence whose block-table entries (32 of them) one warp load
  // fetches: tiles [g * kTilesPerGroup, (g + 1) * kTilesPerGroup). t_begin/t_stop: its tiles in range.
  struct Group {
    int b, g, len, t_begin, t_stop;
  };
  template <int kTilesPerGroup>
  __device__ __forceinline__ Group make_group(int b, int g, int len, int t_begin) const {
    int t_stop = min((g + 1) * kTilesPerGroup, L::num_tiles(len));
    if (b == b_end) t_stop = min(t_stop, t_end);
    if (b >= limit) t_stop = t_begin;  // invalid
    return Group{b, g, len, t_begin, t_stop};
  }
  __device__ __forceinline__ static bool valid(const Group& grp) { return grp.t_begin < grp.t_stop; }
  template <int kTilesPerGroup>
  __device__ __forceinline__ Group first_group(const int4& range, const int* __restrict__ ctx_, int batch_) {
    const Item it = first(range, ctx_, batch_);
    return make_group<kTilesPerGroup>(it.b, it.t / kTilesPerGroup, it.len, it.t);
  }
  template <int kTilesPerGroup>
  __device__ __forceinline__ Group next_group(const Group& grp) {
    const int g = grp.g + 1;
    if (g * kTilesPerGroup < L::num_tiles(grp.len))
      return make_group<kTilesPerGroup>(grp.b, g, grp.len, g * kTilesPerGroup);
    const Item it = to_sequence(next_nonempty(grp.b));
    return make_group<kTilesPerGroup>(it.b, 0, it.len, 0);
  }
};

// The kernel's constants and phases (one instantiation per kernel variant, every phase inlined into
// paged_mqa_logits_kernel below, which sets up and dispatches the warps).
// NOTES: the phases keep their helpers as lambdas: turned into functions, they are inlined at another
// point of the optimizer's pipeline and the generated code changes (more instructions, other schedules).
template <int kNextN, int kNumHeads, int kHeadDim, int BLOCK_KV, int kNumKVStages, int kNumMathWGs,
          bool kContextLens2D, typename OutT, bool kSplitRelu, bool kVarlen, bool kQFp4, bool kKVFp4>
struct PagedMqaKernel {
  static constexpr PagedMqaLogitsLayout kL{kNextN,     kNumHeads,  kHeadDim, BLOCK_KV, kNumKVStages,
                                           static_cast<int>(sizeof(OutT)), kNumMathWGs, kSplitRelu, kQFp4, kKVFp4};
  static_assert(kL.valid(), "unsupported paged_mqa_logits configuration");
  static_assert(!kVarlen || kNextN == 1, "varlen: one q row per sequence");

  static constexpr int kStages = kNumKVStages;
  static constexpr int kN = kL.n_total();
  static constexpr int kTPC = kL.tokens_per_chunk();
  static constexpr int kNumChunks = kL.num_chunks();
  static constexpr int kChunkCols = kL.chunk_cols();
  static constexpr int kHG = kNumHeads / 8;  // 8-column groups per token
  static constexpr int kMmaCols = kL.mma_cols();  // WGMMA N of a chunk (with the pieces columns for split_relu)
  static constexpr int kSplitPieces = split_relu::kPieces;
  static constexpr bool kWeightsInRegs = kL.weights_in_regs();
  static constexpr int kBlocksPerTile = kL.blocks_per_tile();
  static constexpr uint32_t kTileTx = static_cast<uint32_t>(kL.kv_tile_bytes() + kL.scales_bytes_per_stage());
  static constexpr uint32_t kBlockTx = static_cast<uint32_t>(BLOCK_KV * kL.kv_row_bytes() + BLOCK_KV * 4);
  static constexpr bool kQStaged = kL.q_staged();
  static constexpr int kQStageRows = kL.q_stage_rows();
  static constexpr int kQSrcRowBytes = kL.q_src_row_bytes();
  // Staged q whose rows fit one staging pass: generation 0's rows are folded into slot 0 by the math
  // warpgroups (one thread per (row, 32-value group)), which wait for it anyway, instead of the Q producer.
  static constexpr bool kQ0ByMath = kL.q0_by_math();
  static constexpr int kMathThreads = 128 * kNumMathWGs;
  static constexpr uint32_t kQ0BarrierId = 1 + kNumMathWGs;  // named barrier of the math threads (split_relu: 1..W)
  static constexpr int kKSteps = kHeadDim / 32;
  static constexpr int kSentinel = 1;
  static constexpr uint32_t kProducerWarp0 = 4 * kNumMathWGs;  // producer warpgroup: q loader + KV producers
  static constexpr int kNumKVProducers = kL.num_kv_producers();
  static constexpr int kQSlots = kL.num_q_slots();        // generation g: q slot g % kQSlots, parity (g / kQSlots) & 1
  static constexpr int kSlotInfoInts = kL.slot_info_ints();
  static_assert(kQSlots == 1 || kQSlots == 2, "q slots");
  static_assert(kSlotInfoInts >= 1 + kNextN, "slot info");

  using Walker = RangeWalker<kNextN, kContextLens2D>;
  using Item = typename Walker::Item;
  using Group = typename Walker::Group;
  static constexpr int kP = kNumKVProducers;
  static constexpr int kTilesPerGroup = 32 / kBlocksPerTile;  // one warp load of the block table per group

  // ---------------------------------------------------------------- set-up
  // The shared-memory map (paged_mqa_logits_layout.hpp) from the 1024-byte aligned base.
  struct Smem {
    uint8_t* q_smem;
    uint8_t* kv_smem;
    uint32_t* amax_smem;
    float* scales_smem;
    float* weights_smem;
    int4* stage_info;
    int* slot_info;
    uint64_t* full_bar;
    uint64_t* empty_bar;
    uint64_t* q_full_bar;
    uint64_t* q_empty_bar;
    uint64_t* pieces_full_bar;  // split_relu
    uint8_t* q_stage;           // FP4: staged q rows, then (q_fp4) their scale words
    uint64_t* q_stage_bar;      // FP4: the staging buffer's loads landed
    uint64_t* q_stage_free_bar;  // kQ0ByMath: the math warpgroups have read generation 0's staged rows
  };

  // Thread 0: the barrier counts of the protocol above.
  __device__ __forceinline__ static void init_barriers(const Smem& sm) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&sm.full_bar[s], 1);
      ptx::mbar_init(&sm.empty_bar[s], 4);
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      ptx::mbar_init(&sm.q_full_bar[x], 1);
      ptx::mbar_init(&sm.q_empty_bar[x], 4 * kNumMathWGs);
      if constexpr (kSplitRelu) ptx::mbar_init(&sm.pieces_full_bar[x], 1);
    }
    if constexpr (kQStaged) ptx::mbar_init(sm.q_stage_bar, 1);
    if constexpr (kQ0ByMath) ptx::mbar_init(sm.q_stage_free_bar, 1);
    ptx::fence_mbar_init();
  }

  // ---------------------------------------------------------------- Q producer (producer warp 0)
  // For every sequence of the range (generation g): its row lengths and sequence id into the slot
  // info, its q rows (TMA) and weights rows (bulk copies) into q slot g % Q. FP4 (kQStaged): the q rows
  // come through the staging buffer instead, kQStageRows at a time, and every lane writes its rows
  // into the slot (stage_q_row: folded, permuted for an FP4 cache) and scales their weights by the
  // rows' 2^(base - 127).
  __device__ __forceinline__ static void q_producer(const Smem& sm, Walker& walker, const Item& q_cur,
                                                    const CUtensorMap& tmap_q, const uint8_t* __restrict__ q_raw,
                                                    const int* __restrict__ q_sf, const float* __restrict__ weights,
                                                    int64_t weights_stride, const int* __restrict__ context_lens,
                                                    int max_context_len, uint32_t lane, Tracer& tr) {
    uint8_t* q_smem = sm.q_smem;
    float* weights_smem = sm.weights_smem;
    int* slot_info = sm.slot_info;
    uint64_t* q_full_bar = sm.q_full_bar;
    uint64_t* q_empty_bar = sm.q_empty_bar;

    Item cur = q_cur;
    tr.mark<1>(cur.len);
    if (!walker.valid(cur) && lane == 0) {  // no work: release the math WGs' wait for generation 0
      slot_info[0] = -1;
      ptx::mbar_arrive(&q_full_bar[0]);
      if constexpr (kQ0ByMath) ptx::mbar_arrive(sm.q_stage_bar);
    }
    uint32_t g = 0;
    [[maybe_unused]] uint32_t stage_phase = 0;
    while (walker.valid(cur)) {
      const int b = cur.b;
      // FP4: the first staging pass's loads go out before the row lengths are read (the staging buffer is
      // free: the previous sequence's passes are done, and with kQ0ByMath generation 0's reads by the math
      // warpgroups). The weights rows wait for the slot below, except generation 0's with kQ0ByMath.
      const bool q0_by_math = kQ0ByMath && g == 0;
      if constexpr (kQStaged) {
        if (kQ0ByMath && g == 1) ptx::mbar_wait(sm.q_stage_free_bar, 0);
        if (q0_by_math)
          issue_q0(sm, b, q_raw, q_sf, weights, weights_stride, lane);
        else
          issue_q_stage(sm, b, 0, q_raw, q_sf, lane);
      }
      // Row lengths L(b, i) (lane i), clamped to max_context_len.
      int my_len = 0;
      if (static_cast<int>(lane) < kNextN) {
        if constexpr (kContextLens2D)
          my_len = __ldg(context_lens + static_cast<int64_t>(b) * kNextN + lane);
        else
          my_len = __ldg(context_lens + b) - kNextN + static_cast<int>(lane) + 1;
        my_len = min(my_len, max_context_len);
      }
      int lens[kNextN];
#pragma unroll
      for (int i = 0; i < kNextN; ++i) lens[i] = __shfl_sync(0xffffffffu, my_len, i);
      const uint32_t slot = g % kQSlots;
      ptx::mbar_wait(&q_empty_bar[slot], ((g / kQSlots) & 1u) ^ 1u);
      if constexpr (kQStaged) {
        if (lane == 0) {
          int* info = slot_info + slot * kSlotInfoInts;
          if (!q0_by_math) info[0] = b;  // generation 0's: stored by issue_q0
#pragma unroll
          for (int i = 0; i < kNextN; ++i) info[1 + i] = lens[i];
        }
        if (q0_by_math) {  // the row lengths; the math warpgroups fold the q rows
          stage_phase ^= 1u;  // the staging buffer's phase 0, waited for by the math warpgroups
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(&q_full_bar[0]);
        } else {
          stage_q_rows(sm, slot, b, q_raw, q_sf, weights, weights_stride, stage_phase, lane);
          ptx::fence_proxy_async();  // the slot's rows, written by every lane, seen by the WGMMAs
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(&q_full_bar[slot]);
        }
      } else if (lane == 0) {
        int* info = slot_info + slot * kSlotInfoInts;
        info[0] = b;
#pragma unroll
        for (int i = 0; i < kNextN; ++i) info[1 + i] = lens[i];
        ptx::mbar_arrive_expect_tx(&q_full_bar[slot], static_cast<uint32_t>(kL.q_tx_bytes()));
        uint8_t* q_dst = q_smem + slot * kL.q_slot_bytes();
#pragma unroll
        for (int x = 0; x < kL.q_num_boxes(); ++x)
          ptx::tma_load_2d(q_dst + x * kL.q_box_rows() * kHeadDim, &tmap_q, &q_full_bar[slot], 0,
                           b * kN + x * kL.q_box_rows());
        issue_weights(weights_smem + slot * kN, b, weights, weights_stride, &q_full_bar[slot]);
      }
      __syncwarp();
      tr.mark<2>();
#ifdef DI_KERNEL_TRACE
      if (g == 0) {  // when generation 0's q and weights have landed
        ptx::mbar_wait(&q_full_bar[0], 0);
        tr.mark<3>();
      }
#endif
      ++g;
      cur = walker.next_sequence(cur);
    }
    if (lane == 0) tr.print("q", 0, static_cast<int>(g));
  }

  // Sequence b's weights rows into `w_dst` (one thread), counted by `bar`.
  __device__ __forceinline__ static void issue_weights(float* w_dst, int b, const float* __restrict__ weights,
                                                       int64_t weights_stride, uint64_t* bar) {
#pragma unroll
    for (int i = 0; i < kNextN; ++i)
      ptx::bulk_load(w_dst + i * kNumHeads, weights + (static_cast<int64_t>(b) * kNextN + i) * weights_stride,
                     kNumHeads * 4, bar);
  }

  // kQ0ByMath: lane 0 stores generation 0's sequence id into slot 0's info and issues its q rows (one pass)
  // and weights rows (into slot 0, free before generation 0), all counted by q_stage_bar's phase 0 and
  // arrived on at once: the math warpgroups wait for that phase alone before folding, in parallel with
  // the row lengths' load, and learn from the id that the CTA has work.
  __device__ __forceinline__ static void issue_q0(const Smem& sm, int b, const uint8_t* __restrict__ q_raw,
                                                  const int* __restrict__ q_sf, const float* __restrict__ weights,
                                                  int64_t weights_stride, uint32_t lane) {
    static_assert(!kQ0ByMath || kQStageRows == kN, "one staging pass");
    if (lane != 0) return;
    sm.slot_info[0] = b;
    ptx::mbar_arrive_expect_tx(sm.q_stage_bar, q_rows_bytes(kN) + static_cast<uint32_t>(kN * 4));
    load_q_rows(sm, b, 0, kN, q_raw, q_sf);
    issue_weights(sm.weights_smem, b, weights, weights_stride, sm.q_stage_bar);
  }

  // Bytes of `rows` staged q rows with their scale words (kQFp4).
  __host__ __device__ static constexpr uint32_t q_rows_bytes(int rows) {
    return static_cast<uint32_t>(rows * (kQSrcRowBytes + (kQFp4 ? 4 : 0)));
  }
  // Sequence b's q rows [r0, r0 + rows) (and their scale words) into the staging buffer (one thread),
  // counted by q_stage_bar.
  __device__ __forceinline__ static void load_q_rows(const Smem& sm, int b, int r0, int rows,
                                                     const uint8_t* __restrict__ q_raw, const int* __restrict__ q_sf) {
    const int64_t row0 = static_cast<int64_t>(b) * kN + r0;
    ptx::bulk_load(sm.q_stage, q_raw + row0 * kQSrcRowBytes, static_cast<uint32_t>(rows * kQSrcRowBytes), sm.q_stage_bar);
    if constexpr (kQFp4)
      ptx::bulk_load(sm.q_stage + kQStageRows * kQSrcRowBytes, q_sf + row0, static_cast<uint32_t>(rows * 4),
                     sm.q_stage_bar);
  }

  // FP4: lane 0 issues the loads of sequence b's q rows [r0, r0 + kQStageRows) (and their scale words) into
  // the staging buffer, counted by q_stage_bar (the first pass without its arrival: stage_q_rows arrives with
  // the weights rows).
  __device__ __forceinline__ static void issue_q_stage(const Smem& sm, int b, int r0, const uint8_t* __restrict__ q_raw,
                                                       const int* __restrict__ q_sf, uint32_t lane) {
    if (lane != 0) return;
    const int rows = min(kQStageRows, kN - r0);
    // NOTES: the lanes' generic reads of the previous pass (ordered by __syncwarp) come before these
    // async-proxy writes to the same buffer.
    ptx::fence_proxy_async();
    if (r0 == 0) ptx::mbar_expect_tx(sm.q_stage_bar, q_rows_bytes(rows));
    else ptx::mbar_arrive_expect_tx(sm.q_stage_bar, q_rows_bytes(rows));
    load_q_rows(sm, b, r0, rows, q_raw, q_sf);
  }

  // FP4: sequence b's q rows into q slot `slot` through the staging buffer (kQStageRows rows per pass; the
  // first pass already issued by issue_q_stage), and its weights rows into the slot (bulk copies, their
  // own barrier phase). The q producer warp, every lane.
  __device__ __forceinline__ static void stage_q_rows(const Smem& sm, uint32_t slot, int b,
                                                      const uint8_t* __restrict__ q_raw, const int* __restrict__ q_sf,
                                                      const float* __restrict__ weights, int64_t weights_stride,
                                                      uint32_t& stage_phase, uint32_t lane) {
    uint8_t* q_dst = sm.q_smem + slot * kL.q_slot_bytes();
    float* w_dst = sm.weights_smem + slot * kN;
    const uint32_t* stage_sf = reinterpret_cast<const uint32_t*>(sm.q_stage + kQStageRows * kQSrcRowBytes);
    if (lane == 0) {
      // the weights rows (the slot is free: q_empty waited for), with the first pass's arrival
      ptx::mbar_arrive_expect_tx(sm.q_stage_bar, static_cast<uint32_t>(kN * 4));
      issue_weights(w_dst, b, weights, weights_stride, sm.q_stage_bar);
    }
#pragma unroll 1
    for (int r0 = 0; r0 < kN; r0 += kQStageRows) {
      const int rows = min(kQStageRows, kN - r0);
      if (r0 > 0) issue_q_stage(sm, b, r0, q_raw, q_sf, lane);
      ptx::mbar_wait(sm.q_stage_bar, stage_phase);
      stage_phase ^= 1u;
      for (int r = static_cast<int>(lane); r < rows; r += 32) {
        const int base = paged_fp4::stage_q_row<kHeadDim, kQFp4, kKVFp4>(
            sm.q_stage + r * kQSrcRowBytes, kQFp4 ? stage_sf[r] : 0u, q_dst, r0 + r);
        if constexpr (kQFp4) w_dst[r0 + r] *= paged_fp4::pow2_biased(base);
      }
      __syncwarp();
    }
  }

  // ---------------------------------------------------------------- KV producers (producer warps 1..P)
  // Waits until stage st (parity ph) is free; lane 0 stores the stage info and issues the tile's
  // loads: paged block id0 (and id1 if `two`: two 32-token blocks stack into one 64-row tile) and
  // their fp32 scales, all counted by full[st].
  __device__ __forceinline__ static void issue_kv_tile(const Smem& sm, const CUtensorMap& tmap_kv,
                                                       const uint8_t* __restrict__ kv_cache,
                                                       int64_t block_stride_bytes, uint32_t st, uint32_t ph,
                                                       const int4& info, int id0, int id1, bool two, uint32_t lane,
                                                       Tracer& tr) {
    tr.mark<2>(id0 + id1);
    const uint64_t t_wait = tr.now();
    ptx::mbar_wait(&sm.empty_bar[st], ph ^ 1u);
    tr.add_since<6>(t_wait);
    if (lane == 0) {
      sm.stage_info[st] = info;
      uint8_t* kv_dst = sm.kv_smem + st * kL.kv_tile_bytes();
      float* sc_dst = sm.scales_smem + st * 64;
      const uint32_t tx = kBlocksPerTile == 1 ? kTileTx : (two ? 2 * kBlockTx : kBlockTx);
      ptx::mbar_arrive_expect_tx(&sm.full_bar[st], tx);
      if constexpr (kKVFp4) {  // codes then scale words of each block, unswizzled
        constexpr uint32_t kCodeBytes = BLOCK_KV * kHeadDim / 2;
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          if (x == 1 && !two) break;
          const uint8_t* blk = kv_cache + static_cast<int64_t>(x == 0 ? id0 : id1) * block_stride_bytes;
          ptx::bulk_load(kv_dst + x * kCodeBytes, blk, kCodeBytes, &sm.full_bar[st]);
          ptx::bulk_load(sc_dst + x * BLOCK_KV, blk + kCodeBytes, BLOCK_KV * 4, &sm.full_bar[st]);
        }
      } else {
        ptx::tma_load_3d(kv_dst, &tmap_kv, &sm.full_bar[st], 0, 0, id0, kKVCacheHint);
        ptx::bulk_load(sc_dst, kv_cache + static_cast<int64_t>(id0) * block_stride_bytes + BLOCK_KV * kHeadDim,
                       BLOCK_KV * 4, &sm.full_bar[st]);
        if (two) {
          ptx::tma_load_3d(kv_dst + BLOCK_KV * kHeadDim, &tmap_kv, &sm.full_bar[st], 0, 0, id1, kKVCacheHint);
          ptx::bulk_load(sc_dst + BLOCK_KV,
                         kv_cache + static_cast<int64_t>(id1) * block_stride_bytes + BLOCK_KV * kHeadDim,
                         BLOCK_KV * 4, &sm.full_bar[st]);
        }
      }
    }
    __syncwarp();
  }

  // ---------------------------------------------------------------- math warpgroups
  // kQ0ByMath: generation 0's q rows (staged in one pass with its weights rows in slot 0: q_stage_bar's
  // phase 0 waited for) folded into slot 0 by every math thread, one (row, group) at a time; the rows'
  // weights scaled by 2^(base - 127) (kQFp4); the staging buffer handed back to the Q producer.
  __device__ __forceinline__ static void stage_q0(const Smem& sm) {
    constexpr int kGroups = kHeadDim / 32;
    constexpr int kUnits = kN * kGroups;
    static_assert(kUnits % 32 == 0 && kMathThreads % kGroups == 0, "a row's groups in one warp, whole warps per pass");
    const uint32_t* stage_sf = reinterpret_cast<const uint32_t*>(sm.q_stage + kQStageRows * kQSrcRowBytes);
#pragma unroll 1
    for (int u = static_cast<int>(threadIdx.x); u < kUnits; u += kMathThreads) {
      const int r = u / kGroups, g = u % kGroups;
      const int base = paged_fp4::stage_q_group<kHeadDim, kQFp4, kKVFp4>(
          sm.q_stage + r * kQSrcRowBytes, kQFp4 ? stage_sf[r] : 0u, sm.q_smem, r, g);
      if constexpr (kQFp4) {
        if (g == 0) sm.weights_smem[r] *= paged_fp4::pow2_biased(base);
      }
    }
    ptx::fence_proxy_async();  // the slot's rows seen by the WGMMAs
    ptx::named_barrier_sync(kQ0BarrierId, kMathThreads);
    if (threadIdx.x == 0) ptx::mbar_arrive(sm.q_stage_free_bar);
  }

  // Math WG wg takes tiles wg, wg + W, ... of the walk: WGMMA of the tile against the q rows of its
  // generation, then the epilogue (relu, head weights, head sum, reduce-scatter, key scale, stores).
  __device__ __forceinline__ static void math_warpgroups(const Smem& sm, OutT* __restrict__ logits,
                                                         int64_t logits_stride, uint32_t warp, uint32_t lane,
                                                         Tracer& tr) {
    uint8_t* q_smem = sm.q_smem;
    uint8_t* kv_smem = sm.kv_smem;
    uint32_t* amax_smem = sm.amax_smem;
    float* scales_smem = sm.scales_smem;
    float* weights_smem = sm.weights_smem;
    int4* stage_info = sm.stage_info;
    int* slot_info = sm.slot_info;
    uint64_t* full_bar = sm.full_bar;
    uint64_t* empty_bar = sm.empty_bar;
    uint64_t* q_full_bar = sm.q_full_bar;
    uint64_t* q_empty_bar = sm.q_empty_bar;
    [[maybe_unused]] uint64_t* pieces_full_bar = sm.pieces_full_bar;

    const uint32_t wg = warp / 4;
    const uint32_t warp_in_wg = warp % 4;
    const uint32_t quad = lane & 3u;
    const bool hi = (lane & 2u) != 0;   // after the first reduce step: row r0 (false) or r0 + 8 (true)
    const bool odd = (lane & 1u) != 0;  // after the second step: which tokens of the chunk
    const int row_in_tile = static_cast<int>(warp_in_wg * 16 + (lane >> 2) + (hi ? 8 : 0));

    float2 wreg[kWeightsInRegs ? kNextN : 1][kWeightsInRegs ? kHG : 1];
    // split_relu: coef[i] = sigma of piece `quad` of token i of the current sequence.
    float coef[kSplitRelu ? kNextN : 1];
    auto amax_of = [&](uint32_t slot) { return amax_smem + slot * kNextN * kSplitPieces; };
    // Math WG 0 builds the pieces of the sequence in q slot `slot` (its q_full has been waited for) and
    // arrives on pieces_full[slot]. The other WGs' WGMMAs of the slot's previous sequence are done:
    // they arrived on its q_empty before the slot was reloaded.
    [[maybe_unused]] auto build_pieces = [&](uint32_t slot) {
      const int tid = static_cast<int>(threadIdx.x % 128);
      uint8_t* q = q_smem + slot * kL.q_slot_bytes();
      split_relu::build_pieces<kNumHeads, kHeadDim, kNextN>(q, q + kN * kHeadDim, weights_smem + slot * kN,
                                                            amax_of(slot), kNextN, tid, 1 + wg);
      if (tid == 0) ptx::mbar_arrive(&pieces_full_bar[slot]);
    };
    int row_len[kNextN];
    int seq_b = 0;
    int cur_gen = -1;  // generation whose q / weights this WG uses; every WG walks all generations in order

    // Moves this WG to generation `gen` (q slot gen % 2). Returns false for the sentinel (gen = count).
    // Generations are waited for (q_full) and handed back (q_empty) strictly in order by every WG,
    // including those it has no tile of: waiting for gen h only after gen h - 2 keeps each parity wait
    // within one phase of the barrier, and arriving on q_empty for h only after q_full(h) keeps the
    // arrivals in h's phase. No WGMMA of this WG may be in flight here.
    // Reads generation gen's slot info and weights (its q_full has been waited for).
    auto take_generation = [&](int gen) {
      const uint32_t slot = static_cast<uint32_t>(gen) % kQSlots;
      const int* sinfo = slot_info + slot * kSlotInfoInts;
      seq_b = sinfo[0];
  #pragma unroll
      for (int i = 0; i < kNextN; ++i) row_len[i] = sinfo[1 + i];
      if constexpr (kWeightsInRegs) {
        const float* wsl = weights_smem + slot * kN;
  #pragma unroll
        for (int i = 0; i < kNextN; ++i)
  #pragma unroll
          for (int hg = 0; hg < kHG; ++hg)
            wreg[i][hg] = *reinterpret_cast<const float2*>(wsl + i * kNumHeads + hg * 8 + quad * 2);
      }
      if constexpr (kSplitRelu) {
        if (wg == 0) build_pieces(slot);
        mbar_wait_loop(&pieces_full_bar[slot], (static_cast<uint32_t>(gen) / kQSlots) & 1u);
        const uint32_t* amax = amax_of(slot);
  #pragma unroll
        for (int i = 0; i < kNextN; ++i) coef[i] = split_relu::piece_scale(amax[i * kSplitPieces + quad]);
      }
      cur_gen = gen;
    };

    auto switch_generation = [&](const int4& info) -> bool {
      const int gen = info.x;
      __syncwarp();
      mbar_arrive_if(&q_empty_bar[static_cast<uint32_t>(cur_gen) % kQSlots], cur_gen >= 0 && lane == 0);
      for (int h = cur_gen + 1; h < gen; ++h) {
        mbar_wait_loop(&q_full_bar[static_cast<uint32_t>(h) % kQSlots], (static_cast<uint32_t>(h) / kQSlots) & 1u);
        // split_relu: WG 0 builds every sequence's pieces, also those it has no tile of
        if constexpr (kSplitRelu) {
          if (wg == 0) build_pieces(static_cast<uint32_t>(h) % kQSlots);
        }
        __syncwarp();
        mbar_arrive_if(&q_empty_bar[static_cast<uint32_t>(h) % kQSlots], lane == 0);
      }
      if (info.w & kSentinel) return false;
      mbar_wait_loop(&q_full_bar[static_cast<uint32_t>(gen) % kQSlots], (static_cast<uint32_t>(gen) / kQSlots) & 1u);
      take_generation(gen);
      return true;
    };

    // NOTES: generation 0 is taken before the first KV tile arrives (its q lands well before the KV).
    // A CTA without work gets a q_full[0] arrival without loads and slot_info[0] = -1 instead.
    // kQ0ByMath: generation 0's q rows are folded first (its sequence id, or -1, is stored before the
    // staging pass's arrival), while the Q producer reads the row lengths.
    if constexpr (kQ0ByMath) {
      mbar_wait_loop(sm.q_stage_bar, 0);
      if (slot_info[0] >= 0) stage_q0(sm);
    }
    mbar_wait_loop(&q_full_bar[0], 0);
    if (slot_info[0] >= 0) take_generation(0);

    // WGMMA of chunk c of the tile in stage `stage` into acc (committed, not waited); kKVFp4: A from
    // the tile's fragments `afrag` instead of the stage.
    auto issue_chunk = [&](auto chunk_c, float* acc, uint32_t stage, const uint32_t (&afrag)[kKSteps][4]) {
      constexpr int c = decltype(chunk_c)::value;
      constexpr int tok0 = c * kTPC;
      constexpr int tpc = (kNextN - tok0) < kTPC ? (kNextN - tok0) : kTPC;
      constexpr int cols = tpc * kNumHeads + kL.linear_cols();  // split_relu: one chunk, pieces after its rows
      const uint64_t desc_b = ptx::make_kmajor_desc<kHeadDim>(
          q_smem + (static_cast<uint32_t>(cur_gen) % kQSlots) * kL.q_slot_bytes() + tok0 * kNumHeads * kHeadDim);
      ptx::fence_accum<cols / 2>(acc);
      if constexpr (kKVFp4) ptx::fence_regs<kKSteps * 4>(const_cast<uint32_t*>(&afrag[0][0]));
      ptx::wgmma_fence();
      if constexpr (kKVFp4) {
  #pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk)
          ptx::WgmmaFp8RS<cols>::mma(acc, afrag[kk], desc_b + static_cast<uint64_t>(kk * 2), kk > 0);
      } else {
        const uint64_t desc_a = ptx::make_kmajor_desc<kHeadDim>(kv_smem + stage * kL.kv_tile_bytes());
  #pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk)
          ptx::WgmmaFp8<cols>::mma(acc, desc_a + static_cast<uint64_t>(kk * 2), desc_b + static_cast<uint64_t>(kk * 2),
                                   kk > 0);
      }
      ptx::wgmma_commit();
    };

    // Per element: relu(x), or with split_relu |x| (a free FFMA operand modifier) plus, per (token, row),
    // the linear half sigma_p * (piece_p . k) from the pieces columns (token 2 g + c, piece `quad`, after
    // the chunk's columns); the sum is then halved with the key scale.
    // NOTES: with an FP4 cache, relu(x) is taken as (x + |x|) / 2, an FADD with a free |x| operand instead
    // of an FMNMX on the integer pipe that the fold keeps busy; the halving joins the key scale (exact:
    // the accumulators of folded, finite operands are finite).
    constexpr bool kReluByAdd = kKVFp4 && !kSplitRelu;
    auto relu_part = [](float x) { return kSplitRelu ? fabsf(x) : kReluByAdd ? x + fabsf(x) : fmaxf(x, 0.0f); };

    // Epilogue of chunk c: relu, head weights, head sum, quad reduce-scatter, key scale, stores.
    auto epilogue_chunk = [&](auto chunk_c, const float* acc, int key, float key_scale) {
      if constexpr (kSplitRelu || kReluByAdd) key_scale *= 0.5f;
      constexpr int c = decltype(chunk_c)::value;
      constexpr int tok0 = c * kTPC;
      constexpr int tpc = (kNextN - tok0) < kTPC ? (kNextN - tok0) : kTPC;
      [[maybe_unused]] const float* w_slot = weights_smem + (static_cast<uint32_t>(cur_gen) % kQSlots) * kN;
      // v[j][t] = sum over my heads of w * relu(acc), rows r0 + 8j, token tok0 + t
      float part[2][tpc][2];
  #pragma unroll
      for (int j = 0; j < 2; ++j)
  #pragma unroll
        for (int t = 0; t < tpc; ++t) part[j][t][0] = part[j][t][1] = 0.0f;
  #pragma unroll
      for (int t = 0; t < tpc; ++t) {
  #pragma unroll
        for (int hg = 0; hg < kHG; ++hg) {
          float2 w;
          if constexpr (kWeightsInRegs)
            w = wreg[tok0 + t][hg];
          else
            w = *reinterpret_cast<const float2*>(w_slot + (tok0 + t) * kNumHeads + hg * 8 + quad * 2);
          const int g = t * kHG + hg;
  #pragma unroll
          for (int j = 0; j < 2; ++j) {
            part[j][t][0] = fmaf(w.x, relu_part(acc[4 * g + 2 * j + 0]), part[j][t][0]);
            part[j][t][1] = fmaf(w.y, relu_part(acc[4 * g + 2 * j + 1]), part[j][t][1]);
          }
        }
        if constexpr (kSplitRelu) {
  #pragma unroll
          for (int j = 0; j < 2; ++j)
            part[j][t][0] =
                fmaf(coef[tok0 + t], acc[kChunkCols / 2 + 4 * (t / 2) + 2 * j + t % 2], part[j][t][0]);
        }
      }
      // quad reduce-scatter, step 1 (lane ^ 2): keep row r0 + 8*hi, all tokens
      float u[tpc];
  #pragma unroll
      for (int t = 0; t < tpc; ++t) {
        const float v0 = part[0][t][0] + part[0][t][1];
        const float v1 = part[1][t][0] + part[1][t][1];
        const float send = hi ? v0 : v1;
        const float keep = hi ? v1 : v0;
        u[t] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
      }
      auto store = [&](int i, float val, bool valid) {  // i: token of the sequence's window (0..next_n-1)
        OutT* dst = logits + (static_cast<int64_t>(seq_b) * kNextN + i) * logits_stride + key;
        st_global_if(dst, val * key_scale, valid);
      };
      // step 2 (lane ^ 1) and the stores
      if constexpr (tpc % 2 == 0) {
        constexpr int h = tpc / 2;
  #pragma unroll
        for (int t = 0; t < h; ++t) {
          const float send = odd ? u[t] : u[t + h];
          const float keep = odd ? u[t + h] : u[t];
          const float f = keep + __shfl_xor_sync(0xffffffffu, send, 1);
          const int i_even = tok0 + t, i_odd = tok0 + t + h;
          store(odd ? i_odd : i_even, f, key < (odd ? row_len[i_odd] : row_len[i_even]));
        }
      } else {
  #pragma unroll
        for (int t = 0; t < tpc; ++t) u[t] += __shfl_xor_sync(0xffffffffu, u[t], 1);
  #pragma unroll
        for (int t = 0; t < tpc; t += 2) {
          if (t + 1 < tpc) {  // even lanes store token t, odd lanes token t + 1
            const int i_even = tok0 + t, i_odd = tok0 + t + 1;
            store(odd ? i_odd : i_even, odd ? u[t + 1] : u[t], key < (odd ? row_len[i_odd] : row_len[i_even]));
          } else {
            store(tok0 + t, u[t], !odd && key < row_len[tok0 + t]);
          }
        }
      }
    };

    // Lane 0 of every warp hands the stage back once the warp no longer reads it.
    auto release_stage = [&](uint32_t stage) {
      __syncwarp();
      mbar_arrive_if(&empty_bar[stage], lane == 0);
    };

    uint32_t st = wg, ph = 0;
    auto advance = [&]() {
      st += kNumMathWGs;
      if (st >= static_cast<uint32_t>(kStages)) {
        st -= kStages;
        ph ^= 1u;
      }
    };

    // The next tile of this WG: waits for its stage, returns its info (warp-uniform fields broadcast).
    auto next_info = [&]() {
      const uint64_t t_wait = tr.now();
      mbar_wait_loop(&full_bar[st], ph);
      tr.add_since<5>(t_wait);
      const int4 raw = stage_info[st];
      return make_int4(warp_broadcast(raw.x), raw.y, warp_broadcast(raw.z), warp_broadcast(raw.w));
    };
    // What the epilogue of the tile in stage `st` needs once the stage may be handed back.
    struct Tile {
      uint32_t st;
      int key;
      float scale;
    };
    // The tile in stage st. kKVFp4: folds its codes into `afrag` (this thread's A fragments) and hands
    // the stage back at once (the WGMMAs read the registers); the key scale comes from the row's base.
    auto take_tile = [&](const int4& info, uint32_t (&afrag)[kKSteps][4]) -> Tile {
      if constexpr (kKVFp4) {
        int base[2];
        paged_fp4::tile_fragments<kHeadDim>(kv_smem + st * kL.kv_tile_bytes(),
                                            reinterpret_cast<const uint32_t*>(scales_smem) + st * 64,
                                            static_cast<int>(warp_in_wg * 16 + (lane >> 2)), quad, afrag, base);
        const Tile t{st, info.z + row_in_tile, paged_fp4::pow2_biased(hi ? base[1] : base[0])};
        release_stage(st);
        return t;
      } else {
        return Tile{st, info.z + row_in_tile, scales_smem[st * 64 + row_in_tile]};
      }
    };

    [[maybe_unused]] int num_tiles = 0;
    if constexpr (kL.pipeline_tiles()) {
      // Two tiles in flight: the WGMMA of the WG's next tile is issued before the epilogue of the
      // current one. NOTES: every program point has a fixed number of WGMMA groups in flight (one at the
      // inner loop's head, none at the outer loop's), else ptxas serializes the WGMMAs. A generation
      // switch (and the sentinel) first finishes the tile in flight, which uses the old q / weights / rows.
      static_assert(kNumChunks == 1, "pipelined tiles: one chunk");
      using Chunk0 = std::integral_constant<int, 0>;
      float acc2[2][kMmaCols / 2];
      uint32_t afrag2[2][kKSteps][4];  // kKVFp4: the A fragments of the two tiles in flight
      auto start_tile = [&](auto slot_c, const int4& info) {
        const Tile t = take_tile(info, afrag2[decltype(slot_c)::value]);
        issue_chunk(Chunk0{}, acc2[decltype(slot_c)::value], st, afrag2[decltype(slot_c)::value]);
        advance();
  #ifdef DI_KERNEL_TRACE
        ++num_tiles;
  #endif
        return t;
      };
      auto finish_tile = [&](auto slot_c, const Tile& t) {
        constexpr int x = decltype(slot_c)::value;
        ptx::fence_accum<kMmaCols / 2>(acc2[x]);
        if constexpr (!kKVFp4) release_stage(t.st);
        epilogue_chunk(Chunk0{}, acc2[x], t.key, t.scale);
      };
      int4 info = next_info();
      // The tile in flight is in slot a (pa): start the next tile in slot b (pb), then finish a. At the
      // end of the generation only finishes a and returns false (nothing in flight).
      auto pipeline_step = [&](auto a, auto b, const Tile& pa, Tile& pb) -> bool {
        info = next_info();
        if (info.x != cur_gen) {
          ptx::wgmma_wait<0>();
          finish_tile(a, pa);
          return false;
        }
        pb = start_tile(b, info);
        ptx::wgmma_wait<1>();
        finish_tile(a, pa);
        return true;
      };
      using Slot0 = std::integral_constant<int, 0>;
      using Slot1 = std::integral_constant<int, 1>;
      while (info.x == cur_gen || switch_generation(info)) {
        Tile p0 = start_tile(Slot0{}, info), p1;
        while (pipeline_step(Slot0{}, Slot1{}, p0, p1) && pipeline_step(Slot1{}, Slot0{}, p1, p0)) {
        }
      }
    } else {
      // One tile at a time per WG (the other WGs' WGMMAs and epilogues overlap with it); multi-chunk
      // shapes reuse one accumulator set per chunk.
      float acc[kMmaCols / 2];
      uint32_t afrag[kKSteps][4];  // kKVFp4
      while (true) {
        const int4 info = next_info();
        tr.mark<1>();
        if (info.x != cur_gen && !switch_generation(info)) break;
        tr.mark<2>();
        const Tile t = take_tile(info, afrag);
        static_for<0, kNumChunks>([&](auto chunk_c) {
          constexpr int c = decltype(chunk_c)::value;
          issue_chunk(chunk_c, acc, t.st, afrag);
          ptx::wgmma_wait<0>();
          ptx::fence_accum<kMmaCols / 2>(acc);
          if constexpr (c == kNumChunks - 1 && !kKVFp4) release_stage(t.st);  // keys, scales and info all read
          epilogue_chunk(chunk_c, acc, t.key, t.scale);
        });
        tr.mark<3>();
        advance();
  #ifdef DI_KERNEL_TRACE
        ++num_tiles;
  #endif
      }
    }
    tr.mark<4>();
    if (threadIdx.x % 128 == 0) tr.print("math", static_cast<int>(wg), num_tiles);
  }
};

}  // namespace paged_mqa_detail

template <int kNextN, int kNumHeads, int kHeadDim, int BLOCK_KV, int kNumKVStages, int kNumMathWGs,
          bool kContextLens2D, typename OutT /* float or __nv_bfloat16 */, bool kSplitRelu = false,
          bool kVarlen = false /* indices: kNextN == 1, block-table row = first row of the run */,
          bool kQFp4 = false /* q: FP4 codes (q_raw) + scale words (q_sf) */,
          bool kKVFp4 = false /* the paged cache: FP4 codes + scale words */>
__global__ void __launch_bounds__(PagedMqaLogitsLayout{kNextN, kNumHeads, kHeadDim, BLOCK_KV, kNumKVStages,
                                                       static_cast<int>(sizeof(OutT)), kNumMathWGs, kSplitRelu,
                                                       kQFp4, kKVFp4}
                                      .num_threads(),
                                  1)
    paged_mqa_logits_kernel(const __grid_constant__ CUtensorMap tmap_q, const __grid_constant__ CUtensorMap tmap_kv,
                            const uint8_t* __restrict__ kv_cache, int64_t block_stride_bytes,
                            const float* __restrict__ weights, int64_t weights_stride,
                            const int* __restrict__ context_lens, const int* __restrict__ block_table,
                            int64_t block_table_stride, int block_table_cols, const int* __restrict__ schedule,
                            OutT* __restrict__ logits, int64_t logits_stride, int batch_size, int max_context_len,
                            const int* __restrict__ indices, const uint8_t* __restrict__ q_raw,
                            const int* __restrict__ q_sf, int tile_split, int early_trigger) {
  static_assert(std::is_same<OutT, float>::value || std::is_same<OutT, __nv_bfloat16>::value, "OutT");
  using K = paged_mqa_detail::PagedMqaKernel<kNextN, kNumHeads, kHeadDim, BLOCK_KV, kNumKVStages, kNumMathWGs,
                                             kContextLens2D, OutT, kSplitRelu, kVarlen, kQFp4, kKVFp4>;
  constexpr PagedMqaLogitsLayout kL = K::kL;
  constexpr int kStages = K::kStages;
  constexpr uint32_t kProducerWarp0 = K::kProducerWarp0;

  // ================================================================== set-up
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (ptx::smem_addr(smem_raw) & 1023u)) & 1023u);
  uint8_t* q_smem = smem + kL.q_offset();
  uint8_t* kv_smem = smem + kL.kv_offset();
  uint32_t* amax_smem = reinterpret_cast<uint32_t*>(smem + kL.amax_offset());
  float* scales_smem = reinterpret_cast<float*>(smem + kL.scales_offset());
  float* weights_smem = reinterpret_cast<float*>(smem + kL.weights_offset());
  int4* stage_info = reinterpret_cast<int4*>(smem + kL.stage_info_offset());
  int* slot_info = reinterpret_cast<int*>(smem + kL.slot_info_offset());
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kL.barrier_offset());
  uint64_t* full_bar = bars;
  uint64_t* empty_bar = bars + kStages;
  uint64_t* q_full_bar = bars + 2 * kStages;
  uint64_t* q_empty_bar = bars + 2 * kStages + 2;
  uint64_t* pieces_full_bar = bars + 2 * kStages + 4;  // split_relu
  uint64_t* q_stage_bar = bars + 2 * kStages + 4 + (kSplitRelu ? 2 : 0);  // FP4
  const typename K::Smem sm{q_smem,      kv_smem,   amax_smem, scales_smem, weights_smem,
                            stage_info,  slot_info, full_bar,  empty_bar,   q_full_bar,
                            q_empty_bar, pieces_full_bar, smem + kL.q_stage_offset(), q_stage_bar,
                            q_stage_bar + 1};

  // A launch with another block size would deadlock (missing warpgroups): fail loudly instead.
  if (blockDim.x != static_cast<uint32_t>(kL.num_threads())) __trap();
  if (tile_split && batch_size > PagedMqaLogitsLayout::kTileSplitMaxBatch) __trap();

  Tracer tr;
  tr.start();
  const uint32_t warp = ptx::warp_idx();
  const uint32_t lane = ptx::lane_idx();

  // A launch with programmatic stream serialization (PDL) may start before the previous kernel has
  // finished: every read of the inputs comes after this (a no-op otherwise).
  ptx::grid_dependency_wait();
  // NOTES: the next kernel (the fused call's top-k) may launch at once: its CTAs take the SMs whose CTAs end
  // first and start up there, and its own griddepcontrol.wait still waits for this whole grid and its stores.
  // After the wait above, so a dependent's launch also follows the kernels before this one. early_trigger:
  // sm90::paged_mqa_early_trigger (not where the grid leaves SMs to other streams).
  if (early_trigger) ptx::launch_dependents();

  // NOTES: thread 0 sets the barriers up (spreading this over warp 0's lanes is slower)
  // while the producers resolve their first work items (schedule rows -> context lengths -> block
  // table entries: dependent global loads) before the prologue's barrier, which they do not need for
  // that: its latency overlaps theirs.
  if (threadIdx.x == 0) K::init_barriers(sm);
  if (warp == kProducerWarp0 && lane == 0) {  // FP4 operands are bulk-copied: their maps are unused
    if constexpr (!kKVFp4) ptx::prefetch_tensor_map(&tmap_kv);
    if constexpr (!K::kQStaged) ptx::prefetch_tensor_map(&tmap_q);
  }

  // ================================================================== the producers' first work items
  using Walker = typename K::Walker;
  using Item = typename K::Item;
  using Group = typename K::Group;
  constexpr int kTilesPerGroup = K::kTilesPerGroup;
  const int p = static_cast<int>(warp) - static_cast<int>(kProducerWarp0) - 1;  // KV producer index
  const bool is_q_producer = warp == kProducerWarp0;
  const bool is_kv_producer = p >= 0 && p < K::kP;
  // Varlen: the block-table row of row b is the first row of its run of equal request ids
  // (varlen::run_first_row, warp-collective); the last lookup is cached (a sequence's groups share it).
  [[maybe_unused]] int cached_b = -1, cached_row = 0;
  auto table_row = [&](int b) -> int {
    if constexpr (!kVarlen) {
      return b;
    } else {
      if (b != cached_b) cached_row = varlen::run_first_row(indices, b, lane);
      cached_b = b;
      return cached_row;
    }
  };
  // lane l: physical block of logical block grp.g * 32 + l (if it exists)
  auto load_ids = [&](const Group& grp) -> int {
    int id = 0;
    if (Walker::valid(grp)) {
      const int nb = (grp.len / BLOCK_KV) + ((grp.len % BLOCK_KV) != 0 ? 1 : 0);
      const int blk = grp.g * 32 + static_cast<int>(lane);
      const int64_t row = table_row(grp.b);
      if (blk < nb && blk < block_table_cols) id = __ldg(block_table + row * block_table_stride + blk);
    }
    return id;
  };
  // NOTES: the first group's block-table entries are fetched with the schedule row alone, alongside
  // its context length (entries past the length are never used; any column < block_table_cols may be
  // read), and reloaded only if the first group is another one (an empty sequence at b0).
  constexpr bool kEarlyBlockTable = !kVarlen;  // varlen: the row is known only after the run lookup
  Walker walker;
  Item q_cur{0, 0, 0};                                 // Q producer: its first sequence
  Group kv_cur{0, 0, 0, 0, 0}, kv_nxt{0, 0, 0, 0, 0};  // KV producers: the first two block-table groups
  int kv_ids = 0, kv_ids_next = 0;
  if (is_q_producer || is_kv_producer) {
    // NOTES: tile_split reads context_lens where the schedule path reads its row first: the same number
    // of dependent trips before the first block-table entries, one fewer before the first q rows.
    int4 range;
    if (tile_split) {
      range = walker.tile_range(context_lens, batch_size, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
    } else {
      range = Walker::schedule_range(schedule, static_cast<int>(blockIdx.x));
    }
    tr.mark<7>(range.x);  // the range is known
    if (is_q_producer) {
      q_cur = walker.first(range, context_lens, batch_size);
      tr.mark<4>(q_cur.len);  // and its context length
    } else {
      // the schedule path guesses the first group from the row alone (exact unless b0 is empty)
      const bool guess = kEarlyBlockTable && !tile_split;
      const int guess_b = range.x, guess_g = range.y / kTilesPerGroup;
      const int guess_blk = guess_g * 32 + static_cast<int>(lane);
      if (guess && guess_b < batch_size && guess_blk < block_table_cols)
        kv_ids = __ldg(block_table + static_cast<int64_t>(guess_b) * block_table_stride + guess_blk);
      kv_cur = walker.template first_group<kTilesPerGroup>(range, context_lens, batch_size);
      if (!guess || kv_cur.b != guess_b || kv_cur.g != guess_g) kv_ids = load_ids(kv_cur);
      kv_nxt = kv_cur;
      if (Walker::valid(kv_cur)) kv_nxt = walker.template next_group<kTilesPerGroup>(kv_cur);
      kv_ids_next = load_ids(kv_nxt);  // a whole group ahead
    }
  }
  __syncthreads();
  tr.mark<0>();

  if (warp >= kProducerWarp0) {
    // ================================================================ producer warpgroup
    ptx::reg_dealloc<static_cast<uint32_t>(kL.producer_regs())>();
    if (is_q_producer) {
      K::q_producer(sm, walker, q_cur, tmap_q, q_raw, q_sf, weights, weights_stride, context_lens, max_context_len,
                    lane, tr);
    } else {
      // ---------------------------------------------------------- KV producers (the other 3 warps)
      // Every KV producer walks all tiles of the range (tile counter k) and issues those with
      // k % kNumKVProducers == its index: tile k -> stage k % S (parity (k / S) & 1), WG k % W.
      // NOTES: the walk stays in the kernel body: as a function of its own, the optimizer no longer
      // shares the first groups' bounds (computed above) with the loop and emits more instructions.
      if (!is_kv_producer) return;
      auto stage_of = [](int k, uint32_t& st, uint32_t& ph) {
        st = static_cast<uint32_t>(k % kStages);
        ph = static_cast<uint32_t>((k / kStages) & 1);
      };

      Group cur = kv_cur, nxt = kv_nxt;
      tr.mark<1>(cur.len);
      int ids = kv_ids, ids_next = kv_ids_next;
      int k = 0;                     // tile counter of the CTA's walk
      int gen = 0;                   // generation (sequence count) of `cur`
      const bool any = Walker::valid(cur);
      while (Walker::valid(cur)) {
        const int tile0 = cur.g * kTilesPerGroup;
        // first tile of this group owned by this producer
        for (int t = cur.t_begin + ((p - k) % K::kP + K::kP) % K::kP; t < cur.t_stop; t += K::kP) {
          const int kt = k + (t - cur.t_begin);
          const int j0 = 64 * t;
          const int lb = (t - tile0) * K::kBlocksPerTile;  // < 32
          const int id0 = __shfl_sync(0xffffffffu, ids, lb);
          const int id1 = __shfl_sync(0xffffffffu, ids, (lb + 1) & 31);
          const bool two = K::kBlocksPerTile == 2 && (j0 + BLOCK_KV < cur.len);
          uint32_t st, ph;
          stage_of(kt, st, ph);
          K::issue_kv_tile(sm, tmap_kv, kv_cache, block_stride_bytes, st, ph, make_int4(gen, cur.b, j0, 0), id0, id1,
                           two, lane, tr);
          tr.mark<3>();
#ifdef DI_KERNEL_TRACE
          if (kt == p) {  // latency of a plain load from the tile just issued (same pages, L2-bypassing L1)
            int probe;
            asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(probe) : "l"(kv_cache + static_cast<int64_t>(id0) *
                                                                                    block_stride_bytes + 4096));
            tr.mark<5>(probe);
          }
#endif
        }
        k += cur.t_stop - cur.t_begin;
        if (!Walker::valid(nxt)) break;
        if (nxt.b != cur.b) ++gen;
        cur = nxt;
        ids = ids_next;
        nxt = walker.template next_group<kTilesPerGroup>(cur);
        ids_next = load_ids(nxt);
      }
      tr.mark<4>();
      // One sentinel per math warpgroup (tiles k, k + 1); it carries the number of generations.
      const int num_gens = any ? gen + 1 : 0;
#pragma unroll
      for (int x = 0; x < kNumMathWGs; ++x) {
        const int kt = k + x;
        if (kt % K::kP == p) {
          uint32_t st, ph;
          stage_of(kt, st, ph);
          ptx::mbar_wait(&empty_bar[st], ph ^ 1u);
          if (lane == 0) {
            stage_info[st] = make_int4(num_gens, 0, 0, K::kSentinel);
            ptx::mbar_arrive(&full_bar[st]);
          }
          __syncwarp();
        }
      }
      if (lane == 0) tr.print("kv", p, k);
    }
    return;
  }

  // ================================================================== math warpgroups
  ptx::reg_alloc<static_cast<uint32_t>(kL.math_regs())>();
  K::math_warpgroups(sm, logits, logits_stride, warp, lane, tr);
}

}  // namespace deep_indexer
