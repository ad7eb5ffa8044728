// Every SM90 launch heuristic in one place. DI_JIT_DEBUG=1 prints each choice once per shape.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <mutex>
#include <set>
#include <string>

#include <deep_indexer/logits/mqa_logits_layout.hpp>
#include <deep_indexer/logits/paged_mqa_logits_layout.hpp>
#include <deep_indexer/topk/topk_layout.hpp>

#include "../jit/compiler.hpp"
#include "../utils/env.hpp"
#include "../utils/exception.hpp"

namespace deep_indexer::sm90 {

// `make_line` builds the message; it runs only under DI_JIT_DEBUG (these heuristics run on every call).
template <typename F>
inline void print_choice(F&& make_line) {
  if (!env::get_int(env::kDebug)) return;
  const std::string line = make_line();
  static std::mutex m;
  static std::set<std::string> printed;
  std::lock_guard<std::mutex> lock(m);
  if (printed.insert(line).second) std::fprintf(stderr, "deep_indexer: heuristic %s\n", line.c_str());
}

// Prefill math warpgroups: the layout's default (2 with double-buffered accumulators; 3 with one
// accumulator set each for H = 128). DI_MQA_MATH_WGS (2 or 3) forces the count. NOTES: for H <= 64 the
// double-buffered pair beats 3 single-buffered warpgroups (the epilogue hides under the next tile's
// WGMMAs); 4 math warpgroups spill next to a producer warpgroup (MqaLogitsLayout), and without one
// (the producer folded into a math warp) they are much slower.
inline int mqa_logits_math_wgs(int num_heads, int head_dim) {
  const int forced = env::get_int(env::kMqaMathWgs);
  if (forced == 2 || forced == 3) return forced;
  return MqaLogitsLayout::default_math_wgs(num_heads, head_dim);
}

// Prefill epilogue form (MqaLogitsLayout::split_relu): the linear half of relu on the tensor cores
// costs mma_n() / 128 - 1 more MMA (6% for H >= 64, 12% for H = 32, 25% for H = 16) and saves one
// of the two CUDA-core instructions per (pair, head). NOTES: the epilogue bounds the kernel for
// H >= 32, so the trade pays there; for H = 16 the extra MMA share costs more than it saves.
// DI_MQA_SPLIT_RELU=0/1 forces it.
inline bool mqa_logits_split_relu(int num_heads, int /*head_dim*/) {
  const int forced = env::get_int(env::kMqaSplitRelu, -1);
  return forced == 0 || forced == 1 ? forced == 1 : num_heads >= 32;
}

// Prefill: the deepest KV ring that fits, capped at 16 (one CTA per SM; beyond a few stages the depth
// does not matter). in_bytes = 2 (bf16 q / k, the training forward): no split relu
// (its pieces are fp8), and 2 math warpgroups where 3 leave no room for 2 KV stages (H = 128, D = 128:
// 3 x 2 q tiles of 32 KB).
inline MqaLogitsLayout mqa_logits_layout(int num_heads, int head_dim, int out_bytes, int in_bytes = 1) {
  int wgs = mqa_logits_math_wgs(num_heads, head_dim);
  const bool split = in_bytes == 1 && mqa_logits_split_relu(num_heads, head_dim);
  if (in_bytes != 1 && MqaLogitsLayout::max_kv_stages(num_heads, head_dim, out_bytes, wgs, split, in_bytes) < 2)
    wgs = 2;
  const int stages =
      std::min(MqaLogitsLayout::max_kv_stages(num_heads, head_dim, out_bytes, wgs, split, in_bytes), 16);
  const MqaLogitsLayout l{num_heads, head_dim, stages, out_bytes, wgs, split, in_bytes};
  DI_CHECK_ARG(l.valid(), "mqa_logits: unsupported configuration H={} D={} ({}-byte inputs, {}-byte logits)",
               num_heads, head_dim, in_bytes, out_bytes);
  print_choice([&] {
    return fmt::format(
        "mqa_logits H={} D={} in={}B out={}B: math_wgs={} kv_stages={} threads={} smem={} tokens/CTA={} "
        "split_relu={}",
        num_heads, head_dim, in_bytes, out_bytes, wgs, l.num_kv_stages, l.num_threads(), l.smem_bytes(),
        l.tokens_per_cta(), split ? 1 : 0);
  });
  return l;
}

// Persistent prefill grid: one CTA per SM, never more CTAs than q blocks.
inline unsigned mqa_logits_grid(const MqaLogitsLayout& l, long long seq_len, int num_sms) {
  const long long blocks = l.num_q_blocks(seq_len);
  return static_cast<unsigned>(std::max<long long>(1, std::min<long long>(blocks, num_sms)));
}

// Prefill with clean_logits: the kernel's 3 idle producer warps write the -inf fill while the
// math warpgroups run, saving the separate clean pass. Only when every SM gets a CTA: with fewer
// q blocks than SMs the fill would run on few SMs, and the separate, fully parallel kernel is used.
// DI_MQA_FUSED_CLEAN=0/1 forces either path (tests, tuning).
inline bool mqa_logits_fused_clean(const MqaLogitsLayout& l, long long seq_len, int num_sms) {
  const int forced = env::get_int(env::kMqaFusedClean, -1);
  const bool fused = forced == 0 || forced == 1 ? forced == 1 : l.num_q_blocks(seq_len) >= num_sms;
  print_choice([&] {
    return fmt::format("mqa_logits clean S={}: {}", seq_len, fused ? "fused into the kernel" : "separate kernel");
  });
  return fused;
}

// Decode math warpgroups: the layout's default by N = next_n * H, or DI_PAGED_MATH_WGS (2..4) for tuning.
inline int paged_mqa_math_wgs() {
  const int forced = env::get_int(env::kPagedMathWgs);
  return forced >= 2 && forced <= 4 ? forced : 0;
}

// Decode KV ring depth: kPagedKVStages (~100 KB of 64-token tiles in flight per SM) or
// DI_PAGED_KV_STAGES, rounded down to the ring's granularity, never deeper than what fits. NOTES:
// ~100 KB in flight covers the HBM latency; the deepest ring (21-24 stages) is no faster and
// slightly slower on long contexts. An FP4 cache's tiles are half as large: twice the stages keep
// the same bytes in flight.
constexpr int kPagedKVStages = 12;
// Decode epilogue form (PagedMqaLogitsLayout::split_relu, split_relu.cuh): whether the plain layout
// `plain` wants the linear half of relu on the tensor cores. NOTES: it pays only where the epilogue
// is exposed, i.e. one tile in flight per WG; with two tiles in flight (N <= 64) the epilogue already
// hides under the next WGMMA, and with 2 WGs carrying N >= 192 the extra columns cost more than they
// save. Default: 3+ WGs with one tile in flight and next_n <= 2 (N = 128).
// An FP4 cache takes it at next_n = 2 only: at next_n = 1 the tiles' fold is most of the integer work and
// building the pieces delays the first tile of every sequence; at next_n = 2 the epilogue's share doubles.
// DI_PAGED_SPLIT_RELU=0/1 forces it (where the layout cannot take it, it stays off).
inline bool paged_mqa_split_relu(const PagedMqaLogitsLayout& plain) {
  const int forced = env::get_int(env::kPagedSplitRelu, -1);
  if (forced == 0 || forced == 1) return forced == 1;
  return !plain.pipeline_tiles() && plain.num_math_wgs() >= 3 && (plain.kv_fp4 ? plain.next_n == 2 : plain.next_n <= 2);
}

inline PagedMqaLogitsLayout paged_mqa_logits_layout(int next_n, int num_heads, int head_dim, int block_kv,
                                                    int out_bytes, bool q_fp4 = false, bool kv_fp4 = false) {
  const int wgs = paged_mqa_math_wgs();
  const int max_stages = env::get_int(env::kPagedKvStages, kv_fp4 ? 2 * kPagedKVStages : kPagedKVStages);
  PagedMqaLogitsLayout l = make_paged_mqa_layout(next_n, num_heads, head_dim, block_kv, out_bytes, wgs, max_stages,
                                                 false, q_fp4, kv_fp4);
  if (paged_mqa_split_relu(l)) {
    const PagedMqaLogitsLayout split =
        make_paged_mqa_layout(next_n, num_heads, head_dim, block_kv, out_bytes, wgs, max_stages, true, q_fp4, kv_fp4);
    if (split.valid()) l = split;
  }
  DI_CHECK_ARG(l.valid(), "fp8_paged_mqa_logits: unsupported configuration next_n={} H={} D={} block_kv={} ({} math WGs)",
               next_n, num_heads, head_dim, block_kv, l.num_math_wgs());
  print_choice([&] {
    return fmt::format(
        "paged_mqa_logits next_n={} H={} D={} block_kv={} out={}B{}{}: math_wgs={} kv_stages={} threads={} "
        "smem={}{}{}{}",
        next_n, num_heads, head_dim, block_kv, out_bytes, q_fp4 ? " q_fp4" : "", kv_fp4 ? " kv_fp4" : "",
        l.num_math_wgs(), l.num_kv_stages, l.num_threads(), l.smem_bytes(), l.weights_in_regs() ? " weights_in_regs" : "",
        l.pipeline_tiles() ? " pipeline_tiles" : "", l.split_relu ? " split_relu" : "");
  });
  return l;
}

// Decode work split: the schedule's 256-token segments, or (tile_split) every CTA q or q + 1 of all 64-token
// tiles, counted by the kernel from context_lens (batches of up to PagedMqaLogitsLayout::kTileSplitMaxBatch).
// Taken where the segments are more than one and at most two per CTA, judged by their bound from
// max_context_len: there a CTA with a segment more holds up to twice the mean work (one sequence of 34K-67K
// keys on 132 SMs). NOTES: tiles paid 1-8% on one sequence of 40-50K keys (FP8 and FP4, next_n 1 and 2); at
// most one segment per CTA (D1, 32K) they cost ~0.05 us (the lengths' scan), at 70K and 100K keys they were
// level, on 2-16 sequences of 8K-40K keys (2.4-3.9 segments per CTA) 1-5% slower, and at ~15 per CTA (64 x 8K)
// no faster: there the busiest CTA's extra tiles are not what ends the kernel (design-notes).
// DI_PAGED_TILE_SPLIT=0/1 forces either (1 only where the batch allows).
constexpr int64_t kPagedTileSplitSegmentsPerCta = 2;
inline bool paged_mqa_tile_split(int64_t batch, int64_t max_context_len, int64_t ctas) {
  const int64_t segments_bound = batch * PagedMqaLogitsLayout::num_segments(static_cast<int>(
                                             std::min<int64_t>(max_context_len, std::numeric_limits<int>::max())));
  const bool fits = batch <= PagedMqaLogitsLayout::kTileSplitMaxBatch;
  const int forced = env::get_int(env::kPagedTileSplit, -1);
  const bool split =
      fits && (forced == 0 || forced == 1 ? forced == 1
                                          : segments_bound > ctas && segments_bound <= kPagedTileSplitSegmentsPerCta * ctas);
  print_choice([&] {
    return fmt::format("paged_mqa_logits batch={} max_context_len={} ctas={}: work dealt by {}", batch,
                       max_context_len, ctas, split ? "tiles" : "the schedule's segments");
  });
  return split;
}

// Decode logits: the kernel lets its next kernel (the fused call's top-k) launch as soon as it starts only where
// its grid gives every SM of the GPU a CTA. A schedule for fewer SMs leaves SMs to other streams, where the next
// kernel's CTAs would otherwise wait through the whole logits kernel.
inline bool paged_mqa_early_trigger(int64_t ctas, int64_t gpu_sms) {
  const bool early = ctas >= gpu_sms;
  print_choice([&] {
    return fmt::format("paged_mqa_logits ctas={} of {} SMs: next kernel launched {}", ctas, gpu_sms,
                       early ? "at once" : "at the end");
  });
  return early;
}

// Decode metadata: the compact single-chunk kernel for batches it can hold (its critical path is
// mostly instruction fetch, so less code is faster).
inline bool paged_mqa_metadata_small(int64_t batch) { return batch <= kPagedMqaMetadataSmallBatch; }

// Padded row stride of the logits the ops allocate: rows start 256-byte aligned (vector stores).
inline int64_t padded_row_stride(int64_t cols, int elem_bytes) {
  const int64_t align = 256 / elem_bytes;
  return (cols + align - 1) / align * align;
}

// Top-k launch: clusters of C CTAs per row, grid-stride over rows (a cluster per row where
// TopkLayout::row_per_cta), TopkLayout::ctas_per_sm CTAs per SM. For rows longer than a window (kWindow keys),
// C grows (1, 2, 4, 8) while a CTA's share of the longest row needs more than one filter step (kNumThreads x
// kFilterVecs vectors) and rows x C x 8 <= SMs: only a few long rows are split over SMs. CTA 0 of a cluster
// selects and writes alone, so splitting pays only where the filter's read is the row's critical path (a single
// row of 32K keys is faster on one wide CTA than on a cluster). Sorted output takes C = 1 (its sort runs in one
// CTA anyway). DI_TOPK_CLUSTER (1, 2, 4, 8) forces C for unsorted output. Blocks: kWideThreads (one CTA per SM)
// when every row's cluster fits at once with one CTA per SM (rows x C <= SMs: the two-CTA form would leave SMs
// with one CTA anyway), else kNumThreads. DI_TOPK_WIDE (0, 1) forces the choice.
struct TopkLaunch {
  unsigned grid, cluster, smem, threads;
  bool packed;  // one word per survivor (TopkLayout::packed_fits, one CTA per row)
};
// rows_aligned: every row's column 0 sits on a 16-byte boundary (aligned base and row stride).
inline TopkLaunch topk_launch(const TopkLayout& l, int64_t rows, int64_t cols, bool rows_aligned, int num_sms) {
  const int64_t sms = std::max(1, num_sms);
  const int64_t step_keys = static_cast<int64_t>(TopkLayout::kNumThreads) * TopkLayout::kFilterVecs * l.vec();
  int cluster = 1;
  while (cluster < TopkLayout::kMaxClusterCtas && cols > TopkLayout::kWindow &&
         (cols + cluster - 1) / cluster > step_keys && rows * cluster * 2 * 4 <= sms)
    cluster *= 2;
  const int forced = env::get_int(env::kTopkCluster);
  // NOTES: a forced C whose grid of rows x C CTAs (below) would pass the launch's 2^31 - 1 is not taken
  const bool forced_fits = rows * forced <= std::numeric_limits<int32_t>::max();
  if ((forced == 1 || forced == 2 || forced == 4 || forced == 8) && forced_fits) cluster = forced;
  if (l.sorted) cluster = 1;
  const int forced_wide = env::get_int(env::kTopkWide, -1);
  const bool wide = forced_wide == 0 || forced_wide == 1 ? forced_wide == 1 : rows * cluster <= sms;
  TopkLaunch t;
  t.cluster = static_cast<unsigned>(cluster);
  t.threads = wide ? TopkLayout::kWideThreads : TopkLayout::kNumThreads;
  t.smem = l.smem_bytes();
  const int64_t slots = sms * TopkLayout::ctas_per_sm(static_cast<int>(t.threads));
  // NOTES: a cluster (CTA) per row where the kernel runs one row (TopkLayout::row_per_cta: by default those forms
  // have every row's cluster at once; forced, the hardware deals the rows); else rows in turn
  const bool row_per_cta = TopkLayout::row_per_cta(l.sorted, cluster > 1, static_cast<int>(t.threads));
  const int64_t clusters = row_per_cta ? rows : std::min<int64_t>(rows, std::max<int64_t>(1, slots / cluster));
  t.grid = static_cast<unsigned>(clusters * cluster);
  t.packed = cluster == 1 && TopkLayout::packed_fits(l.elem_bytes, cols, rows_aligned) &&
             env::get_int(env::kTopkPacked, 1) != 0;
  print_choice([&] {
    return fmt::format("topk rows={} cols={} elem_bytes={} sorted={}: grid {}, cluster {}, {} threads, smem {} B{}", rows,
                       cols, l.elem_bytes, l.sorted, t.grid, cluster, t.threads, t.smem, t.packed ? ", packed" : "");
  });
  return t;
}

// Resident top-k (topk_resident.cuh), unsorted output: CTAs of 256, 512 or 1024 threads (one per SM) hold
// whole rows in registers, keys_per_thread each (whole 16-byte vectors, up to the register budget
// TopkResidentLayout::max_keys_per_thread); C = the row's vectors over a CTA's.
// - Two 512-thread CTAs per SM, one row each (bfloat16 keys two per register, up to 16K keys a row; float32
//   up to 12K): with more rows than SMs both rows' chains of dependent steps run at once instead of one
//   after the other (DeepSeek-V4 decode rows: 256 x ~8K; float32 K-V4F 14.5 -> 13.0 us, K-D5 15.9 -> 15.1,
//   H200; 1024 x ~8K bfloat16 k = 512 31.6 -> 26.7 us against the buffered kernel), and for bfloat16 with
//   fewer rows than SMs half the warps of one 1024-thread CTA take each block-wide step (64 x ~8K: 9.7 -> 9.0
//   us, H200; float32 rows there stay on one CTA of 1024 threads, which was faster: 9.5 vs 10.0 us).
// - Four 256-thread CTAs per SM, one row each (bfloat16 up to 8K keys, float32 up to 5K), past 2 x SMs rows at
//   k <= 1024: four rows' chains at once (causal 4096 x 4K bfloat16, k = 512: 60.1 -> 38.5 us, H200).
// - Both take one row per CTA, the grid as many CTAs as rows: past 2 (4) x SMs rows the hardware deals the rows
//   as CTAs finish, which balances rows of unequal length (H200, rows in turn per CTA / one row per CTA, us:
//   1024 x ~8K k = 512 bfloat16 26.7 / 25.0, float32 30.7 / 29.6; 2048 x ~8K bfloat16 48.1 / 44.6; causal
//   4096 x 4K-8K bfloat16 57.0 / 51.3, 4096 x 0-4K k = 2048 bfloat16 61.9 / 51.9, float32 66.0 / 66.8).
// - One CTA per row (C = 1) when rows <= SMs: 1024 threads, the fewest keys per thread that hold it. Also
//   for more rows (a CTA takes them in turn, asking L2 for its next row while it selects one) of more than
//   4K keys where k >= 1024; not for k = 512 (the buffered kernel's filter keeps few keys there and wins).
// - Else a cluster of C <= 8 CTAs per row: the fewest threads per CTA (256, else 512, 1024), then the fewest
//   keys per thread (the most CTAs), when the device holds a cluster for every row at once
//   (`clusters_at_once(kpt, threads, C)`: the driver's count, which the GPCs bound below SMs / C; a smaller C
//   is tried where a larger one does not fit). More rows than fit at once are not taken: a second wave of
//   clusters can cost far more than the resident form saves.
// Both for k >= 256 (for smaller k the buffered kernel's filter keeps fewer keys). NOTES: every per-warp
// step (scans, searches, barriers) costs the SM issue slots per warp, so fewer threads with more keys
// each pay where the per-key work is small against them (clusters); for one CTA per row the thread
// count makes no difference and 1024 threads are kept.
// `vecs`: the most 16-byte vectors a row spans (one more than its columns need where the rows' column 0 is
// not known to be 16-byte aligned; launch_topk). DI_TOPK_RESIDENT (0, 1) turns it off / on wherever C <= 8 CTAs
// hold the rows (any row count and k); DI_TOPK_RESIDENT_KEYS / DI_TOPK_RESIDENT_THREADS (256, 512, 1024)
// force the keys per thread / the threads per CTA; DI_TOPK_RESIDENT_CTAS_PER_SM=4 / 2 the four- / two-CTA form
// wherever one CTA holds a row, 1 neither.
struct TopkResidentLaunch {
  bool use = false;
  int keys_per_thread = 8;
  unsigned ctas_per_sm = 1;
  unsigned grid = 0, cluster = 1, smem = 0, threads = TopkResidentLayout::kMaxThreads;
  int64_t clusters_at_once = 0;  // the device's count for the chosen cluster form (0: one CTA per row, or forced)
};
inline TopkResidentLaunch topk_resident_launch(int elem_bytes, bool sorted, int64_t rows, int64_t vecs, int k,
                                               int num_sms,
                                               const std::function<int64_t(int, int, int64_t)>& clusters_at_once) {
  TopkResidentLaunch t;
  const int forced = env::get_int(env::kTopkResident, -1);
  const int forced_keys = env::get_int(env::kTopkResidentKeys, 0);
  const int forced_threads = env::get_int(env::kTopkResidentThreads, 0);
  const int per_sm = env::get_int(env::kTopkResidentCtasPerSm, 0);  // 4 / 2: that form wherever it fits, 1: neither
  if (sorted || forced == 0 || rows <= 0 || (forced != 1 && per_sm < 2 && k < 256)) return t;
  const int64_t sms = std::max(1, num_sms);
  const int vec = TopkLayout::kVecBytes / elem_bytes;
  auto ctas = [&](int kpt, int threads) {  // CTAs per row
    const TopkResidentLayout l{elem_bytes, kpt, threads};
    return std::max<int64_t>(1, (vecs + l.vecs_per_cta() - 1) / l.vecs_per_cta());
  };
  auto fits = [&](int kpt, int threads, bool cluster, int ctas_per_sm) {  // DI_TOPK_RESIDENT_KEYS and the budget
    return (forced_keys == 0 || forced_keys == kpt) &&
           kpt <= TopkResidentLayout::max_keys_per_thread(threads, cluster, elem_bytes, ctas_per_sm);
  };
  auto allowed = [&](int kpt, int threads, bool cluster) {
    return fits(kpt, threads, cluster, 1) && (forced_threads == 0 || forced_threads == threads);
  };
  int kpt = 0, threads = 0;
  // two CTAs per SM (512 threads, one row each): bfloat16 at any row count; float32 for more rows than SMs, and
  // past 2 x SMs rows at k >= 1024 (where one 1024-thread CTA per row takes the rows in turn) only where that
  // form's waves of rows take longer: a float32 wave of the two-CTA form measured ~1.85 of its waves (H200,
  // rows of ~8K keys, k = 2048, two-CTA / one-CTA: 384 rows 23.2 / 20.6 us, 528 rows 24.6 / 25.9, 1024 rows
  // 41.7 / 45.5)
  constexpr int kMostKeys = TopkResidentLayout::kMaxKeysPerThread;
  constexpr int64_t kTwoCtaWaveCost = 185, kOneCtaWaveCost = 100;  // a float32 row wave of each form, relative
  const int64_t waves_one = (rows + sms - 1) / sms, waves_two = (rows + 2 * sms - 1) / (2 * sms);
  const bool fp32_two =
      rows > sms && (rows <= 2 * sms || k < 1024 || kTwoCtaWaveCost * waves_two < kOneCtaWaveCost * waves_one);
  const bool two_default = per_sm == 0 && forced != 1 && (elem_bytes == 2 || fp32_two);
  // four 256-thread CTAs per SM (one row each; bfloat16 rows of up to 8K keys, float32 up to 5K): past 2 x SMs
  // rows at k <= 1024, four rows' chains at once per SM (H200, four / two CTAs per SM, us: causal 4096 x 4K
  // rows bfloat16 k = 512 38.5 / 60.1, k = 1024 50.8 / 62.3, float32 42.9 / 64.5 and 51.8 / 65.2; 1024 x
  // ~6K bfloat16 k = 1024 20.8 / 23.0); at k = 2048 it lost (4096 x 4K bfloat16 92.0 / 86.9, 528 x ~6K
  // 21.2 / 17.2), as did 2 x SMs rows (264 x ~6K bfloat16, k = 512: 9.3 / 9.0)
  constexpr int kFourCtaMostK = 1024;
  const bool four_default = per_sm == 0 && forced != 1 && rows > 2 * sms && k <= kFourCtaMostK;
  auto several_per_sm = [&](int n, int per) {  // `per` CTAs of n threads per SM: the fewest keys that hold a row
    for (int c = vec; c <= kMostKeys; c += vec)
      if (kpt == 0 && fits(c, n, false, per) && ctas(c, n) == 1)
        kpt = c, threads = n, t.ctas_per_sm = static_cast<unsigned>(per);
  };
  if (per_sm == 4 || four_default) several_per_sm(256, 4);
  if (per_sm == 2 || two_default) several_per_sm(512, 2);
  // one CTA per row (1024 threads unless forced); any number of rows per CTA for rows of > 4K keys at k >= 1024.
  // Unless forced, at most the 16 registers of keys per thread (at 1024 threads) this choice was measured with.
  const int one_cta = forced_threads == 256 || forced_threads == 512 ? forced_threads : TopkResidentLayout::kMaxThreads;
  const int one_cta_keys = forced == 1 ? kMostKeys : TopkResidentLayout::default_one_cta_keys(one_cta);
  for (int c = vec; c <= one_cta_keys; c += vec)
    if (kpt == 0 && allowed(c, one_cta, false) && ctas(c, one_cta) == 1 &&
        (forced == 1 || rows <= sms || (k >= 1024 && vecs * vec > 4096)))
      kpt = c, threads = one_cta;
  // bit m: the device does not hold `rows` clusters of m CTAs at once (one CTA per SM: the same for every form)
  uint32_t failed = 0;
  for (const int n : {256, 512, 1024})  // a cluster per row
    for (int c = vec; c <= kMostKeys; c += vec) {
      const int64_t m = ctas(c, n);
      if (kpt != 0 || !allowed(c, n, true) || m < 2 || m > TopkResidentLayout::kMaxCluster || ((failed >> m) & 1u))
        continue;
      if (forced != 1 && (rows > sms / m || rows > (t.clusters_at_once = clusters_at_once(c, n, m)))) {
        failed |= 1u << m;
        continue;
      }
      kpt = c, threads = n;
    }
  // NOTES: a grid of rows x C CTAs (below) must fit the launch's 2^31 - 1; past it (only when forced) the
  // buffered kernel takes the rows
  if (kpt != 0 && ctas(kpt, threads) * rows > std::numeric_limits<int32_t>::max()) kpt = 0;
  if (kpt != 0) {
    const int64_t c = ctas(kpt, threads);
    t.use = true;
    t.keys_per_thread = kpt;
    t.threads = static_cast<unsigned>(threads);
    t.cluster = static_cast<unsigned>(c);
    t.smem = TopkResidentLayout{elem_bytes, kpt, threads, static_cast<int>(t.ctas_per_sm)}.launch_smem_bytes();
    // NOTES: clusters, two or four CTAs per SM: a cluster (CTA) per row (the kernel runs one row); one CTA per
    // SM: rows in turn, next row in L2
    const bool row_per_cta = TopkResidentLayout::row_per_cta(c > 1, static_cast<int>(t.ctas_per_sm));
    const int64_t clusters =
        row_per_cta ? rows : std::min<int64_t>(rows, std::max<int64_t>(1, t.ctas_per_sm * sms / c));
    t.grid = static_cast<unsigned>(clusters * c);
  }
  print_choice([&] {
    return t.use ? fmt::format("topk resident rows={} vecs={} elem_bytes={} k={}: grid {}, cluster {}, {} threads x {} "
                               "keys, {} per SM, smem {} B, clusters at once {}", rows, vecs, elem_bytes, k, t.grid,
                               t.cluster, t.threads, t.keys_per_thread, t.ctas_per_sm, t.smem, t.clusters_at_once)
                 : fmt::format("topk resident rows={} vecs={} elem_bytes={} k={} sorted={}: not taken", rows, vecs,
                               elem_bytes, k, sorted);
  });
  return t;
}

// Training target (training_target.cuh): one CTA per row (cluster 1), or clusters of 2 CTAs (2 consecutive
// rows) that share every key tile by TMA multicast (half the L2 -> SM traffic). NOTES: L2 does not bound
// the single CTA (it runs near the bf16 GEMM rate), and the pair's lockstep costs more than the multicast
// saves: cluster 1 by default. DI_TRAINING_TARGET_CLUSTER=1/2 forces it.
inline int training_target_cluster() {
  const int forced = env::get_int(env::kTrainingTargetCluster);
  const int c = forced == 1 || forced == 2 ? forced : 1;
  print_choice([&] { return fmt::format("training_target cluster={}", c); });
  return c;
}

// Indexer dk kernel (training_indexer_bwd.cuh): a CTA owns 128 keys and a range of rows; the rows of a
// call are split into `splits` ranges so that there are about kTrainingDkCtasPerSm CTAs per SM (causal
// chunks leave many (key block, range) pairs empty), each range at least 64 rows. DI_TRAINING_DK_SPLITS
// forces the count.
constexpr int kTrainingDkCtasPerSm = 8;
inline int training_dk_splits(int num_kblocks, int rows, int num_sms) {
  const int forced = env::get_int(env::kTrainingDkSplits);
  const int max_splits = std::max(1, (rows + 63) / 64);
  int splits = forced > 0 ? forced
                          : (kTrainingDkCtasPerSm * num_sms + std::max(1, num_kblocks) - 1) / std::max(1, num_kblocks);
  splits = std::max(1, std::min(splits, max_splits));
  print_choice([&] { return fmt::format("training_dk kblocks={} rows={}: splits={}", num_kblocks, rows, splits); });
  return splits;
}

// per_head dk kernel (training_per_head.cuh): a CTA owns 128 keys and a group of heads; groups are chosen
// for about 4 CTAs per SM (causal key blocks differ in work), at most 16 (each adds an [N, D_I] fp32 partial
// the host sums). DI_TRAINING_PER_HEAD_GROUPS forces the group count.
inline int training_per_head_dk_heads_per_group(int num_kblocks, int heads, int num_sms) {
  const int forced = env::get_int(env::kTrainingPerHeadGroups);
  int groups = forced > 0 ? forced : (4 * num_sms + std::max(1, num_kblocks) - 1) / std::max(1, num_kblocks);
  groups = std::max(1, std::min({groups, heads, 16}));
  const int per_group = (heads + groups - 1) / groups;
  print_choice([&] {
    return fmt::format("training_per_head_dk kblocks={} heads={}: {} heads per group", num_kblocks, heads, per_group);
  });
  return per_group;
}

}  // namespace deep_indexer::sm90
