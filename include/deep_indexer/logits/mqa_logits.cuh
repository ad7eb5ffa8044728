// Prefill lightning-indexer logits (docs/api.md):
//   logits[i, c(j)] = k_scale[j] * sum_h weights[i, h] * relu(q[i, h, :] . k[j, :])
// for lo_i <= j < hi_i, lo_i = max(ks[i], 0), hi_i = min(ke[i], SKV); outside that range nothing is
// written unless `clean` (then -inf, by the producer's idle warps; otherwise a separate kernel).
// Column map: full width (max_seqlen_k == 0) c(j) = j over SKV columns; compressed (max_seqlen_k =
// M > 0) c(j) = j - lo_i over M columns, and hi_i is first cut to min(hi_i, lo_i + M) (a longer row
// keeps its first M keys), so every store lands inside [0, M). The cut also shortens the tile walk.
// weights: float32, or bfloat16 when weights_bf16 (converted to fp32 as they are staged in smem).
// kInBytes = 2: bf16 q and k (the training forward, deep_indexer.training.indexer_logits): no k scales
// (k_scale unused), WGMMA k16 bf16; a q / k row is D / 64 column blocks of 128 swizzled bytes, one TMA
// box each. Everything else is shared with the fp8 form.
//
// Structure (sizes and offsets: mqa_logits_layout.hpp):
//   * persistent grid; a CTA walks q blocks blockIdx.x, blockIdx.x + gridDim.x, ... of
//     tokens_per_cta() = W * (128 / H) query tokens (W = num_math_wgs(): 2, 3 or 4, host heuristic);
//     math warpgroup w owns the block's tokens [w * 128/H, (w + 1) * 128/H), i.e. 128 rows of the
//     [S*H, D] view of q.
//   * warpgroup 0 = producer: warp 0 loads the block's ks/ke/weights into an "info" area of the
//     q stage, TMA-loads the W q tiles (2 q stages), then TMA-loads the KV tiles of 64 rows
//     covering the union of the block's ranges into a ring of kNumKVStages stages that all math
//     warpgroups read (fp8: the warp's lanes also copy each tile's 64 k scales into the stage by
//     cp.async). Warps 1..3 write the -inf fill (clean) and exit.
//     With W = 4 the roles are reordered: math warpgroups are warps 0..15, then one TMA warp and
//     one fill warp (no producer warpgroup, no setmaxnreg; see the layout).
//   * warpgroups 1..W = math: WGMMA m64n128k32 (A = KV tile: 64 KV rows, B = 128 q rows, both
//     K-major, D-byte swizzle), then on CUDA cores: relu, head weights (registers), in-thread head
//     sum, quad reduce-scatter (each lane finishes distinct outputs), k scale, streaming stores.
//     With W = 2 the accumulators are double-buffered: tile t+1's WGMMAs are in flight while the
//     epilogue of tile t runs. With W = 3 or 4 each warpgroup has one accumulator set (and with
//     W = 4 reads its head weights from shared memory: 112 registers per thread).
//
// Synchronisation (all mbarriers, parities derived from running counters, nothing reset):
//   q_full[s]   count 32 (every lane of producer warp 0 arrives after writing info) + TMA tx bytes
//   q_empty[s]  count 4 W (lane 0 of each math warp, after its last use of q stage s and its info)
//   kv_full[s]  count 1 (producer lane 0 arrive.expect_tx) + TMA tx bytes; fp8: + 32 (each lane of
//               producer warp 0, once its cp.async copies of the stage's k scales have landed)
//   kv_empty[s] count 4 W (lane 0 of each math warp after wgmma.wait_group retired the tile)
// The q stage of the n-th q block of a CTA is n % 2 with parity (n / 2) % 2; the KV ring state
// (index, parity) runs on across q blocks in both roles, which consume the same tile sequence
// (the consumers read the block's tile count from info, written by the producer).
#pragma once
#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>
#include <type_traits>

#include <deep_indexer/logits/mqa_logits_layout.hpp>
#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/logits/split_relu.cuh>
#include <deep_indexer/common/wgmma_bf16.cuh>
#include <deep_indexer/common/wgmma_fp8.cuh>

namespace deep_indexer {

namespace mqa_detail {

DI_DEVICE void store_out(float* ptr, float v) {
  asm volatile("st.global.cs.f32 [%0], %1;" ::"l"(ptr), "f"(v) : "memory");
}
DI_DEVICE void store_out(__nv_bfloat16* ptr, float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  const uint16_t bits = *reinterpret_cast<const uint16_t*>(&b);
  asm volatile("st.global.cs.b16 [%0], %1;" ::"l"(ptr), "h"(bits) : "memory");
}

// One warp writes -inf to elements [a, b) of `row`: scalar head up to a 16-byte boundary, 16-byte
// streaming stores, scalar tail.
template <typename OutT>
DI_DEVICE void fill_neg_inf_warp(OutT* row, int a, int b, uint32_t lane) {
  if (a >= b) return;
  constexpr int kE = static_cast<int>(sizeof(OutT));
  constexpr int kVec = 16 / kE;
  constexpr uint32_t kWord = kE == 4 ? 0xFF800000u : 0xFF80FF80u;
  using Bits = typename std::conditional<kE == 4, uint32_t, uint16_t>::type;
  Bits* r = reinterpret_cast<Bits*>(row);
  const int mis = static_cast<int>((reinterpret_cast<uintptr_t>(r + a) & 15u) / kE);
  const int head = min(mis == 0 ? 0 : kVec - mis, b - a);
  if (static_cast<int>(lane) < head) r[a + lane] = static_cast<Bits>(kWord);
  const int body = a + head;
  const int nvec = (b - body) / kVec;
  uint4* v = reinterpret_cast<uint4*>(r + body);
#pragma unroll 1
  for (int i = static_cast<int>(lane); i < nvec; i += 32)
    asm volatile("st.global.cs.v4.b32 [%0], {%1, %1, %1, %1};" ::"l"(v + i), "r"(kWord) : "memory");
  if (const int t = body + nvec * kVec + static_cast<int>(lane); t < b) r[t] = static_cast<Bits>(kWord);  // tail < kVec
}

}  // namespace mqa_detail

// The kernel body; kMathWGs = 0 picks the layout's default number of math warpgroups.
template <int kNumHeads, int kHeadDim, int kNumKVStages, typename OutT, int kMathWGs, bool kSplitRelu, int kInBytes>
DI_DEVICE void mqa_logits_body(const CUtensorMap& tmap_q, const CUtensorMap& tmap_k, const float* __restrict__ k_scale,
                               const void* __restrict__ weights, int64_t weights_stride, int weights_bf16,
                               const int* __restrict__ ks, const int* __restrict__ ke, OutT* __restrict__ logits,
                               int64_t logits_stride, int S, int SKV, int max_seqlen_k, int clean) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  constexpr MqaLogitsLayout L{kNumHeads, kHeadDim, kNumKVStages, static_cast<int>(sizeof(OutT)), kMathWGs,
                              kSplitRelu, kInBytes};
  constexpr bool kBf16 = kInBytes == 2;
  constexpr bool kStageScales = !kBf16;  // k scales copied into each KV stage by the producer warp
  static_assert(L.valid(), "unsupported mqa_logits configuration");
  static_assert(sizeof(OutT) == 4 || sizeof(OutT) == 2, "OutT must be float or __nv_bfloat16");

  constexpr int H = kNumHeads;
  constexpr int D = kHeadDim;
  constexpr int T = L.block_q();          // tokens per math warpgroup
  constexpr int T2 = L.tokens_per_cta();  // tokens per q block
  constexpr int G = H / 8;                // 8-column accumulator groups per token
  constexpr int kBlockKV = L.block_kv();
  using Mma = std::conditional_t<kBf16, ptx::WgmmaBf16<L.mma_n()>, ptx::WgmmaFp8<L.mma_n()>>;
  constexpr int kNumAccum = Mma::kNumAccum;  // 64 (+ 4 per token pair with split_relu)
  constexpr int kP = split_relu::kPieces;
  constexpr int kKSteps = L.k_steps();  // 32 bytes each
  constexpr int kSwizzle = L.swizzle_bytes();
  constexpr int kStepsPerBlock = kSwizzle / 32;
  constexpr uint32_t kQBoxBytes = L.q_box_bytes();  // what one q TMA load delivers (rows 0..127)
  constexpr uint32_t kKVTileBytes = L.kv_tile_bytes();
  constexpr int kNumMathWarps = L.num_math_wgs() * 4;
  static_assert(kNumAccum == 64 + L.linear_rows() / 2 && G >= 1 && T >= 1, "layout assumptions");
  static_assert(!kSplitRelu || kP == MqaLogitsLayout::kLinearPieces, "one piece count");

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((MqaLogitsLayout::kAlign - (ptx::smem_addr(smem_raw) & (MqaLogitsLayout::kAlign - 1))) &
                              (MqaLogitsLayout::kAlign - 1));
  auto q_full = [&](int s) { return reinterpret_cast<uint64_t*>(smem + L.offset_q_full(0)) + s; };
  auto q_empty = [&](int s) { return reinterpret_cast<uint64_t*>(smem + L.offset_q_empty(0)) + s; };
  auto kv_full = [&](int s) { return reinterpret_cast<uint64_t*>(smem + L.offset_kv_full(0)) + s; };
  auto kv_empty = [&](int s) { return reinterpret_cast<uint64_t*>(smem + L.offset_kv_empty(0)) + s; };

  const uint32_t warp = ptx::warp_idx();
  const uint32_t lane = ptx::lane_idx();
  const int num_blocks = (S + T2 - 1) / T2;
  ptx::grid_dependency_wait();  // PDL: inputs and the logits buffer only after the previous kernel
  // NOTES: q blocks are dealt in snake order: wave w (gridDim.x blocks) runs forward when w is even
  // and backward when odd, so with the causal pattern (later blocks longer) every CTA's total
  // stays near the mean. Only the last, partial wave yields indices >= num_blocks.
  auto q_block = [&](int it) -> int {
    const int pos = (it & 1) ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
    return it * static_cast<int>(gridDim.x) + pos;
  };

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < L.num_q_stages(); ++s) {
      ptx::mbar_init(q_full(s), 32);
      ptx::mbar_init(q_empty(s), kNumMathWarps);
    }
#pragma unroll
    for (int s = 0; s < kNumKVStages; ++s) {
      ptx::mbar_init(kv_full(s), 1 + (kStageScales ? 32 : 0));  // + the scale-copying lanes
      ptx::mbar_init(kv_empty(s), kNumMathWarps);
    }
    ptx::fence_mbar_init();
  }
  constexpr int kFillWarps = L.producer_warps() - 1;
  if (warp == 0 && lane == 0) {
    ptx::prefetch_tensor_map(&tmap_q);
    ptx::prefetch_tensor_map(&tmap_k);
  }
  __syncthreads();

  // Producer steps, run by the whole producer warp 0.
  // q block `blk` into q stage qs (free): per-token ranges, their union, the weights, the q TMA
  // loads; returns the union start and the number of KV tiles.
  auto produce_block = [&](int blk, int qs, int& u_lo_out, int& tiles_out) {
    uint8_t* info = smem + L.offset_info(qs);
    const int tok0 = blk * T2;
    // Per-token clamped ranges and their union.
    int u_lo = 0x7fffffff, u_hi = -0x7fffffff - 1;
    if (lane < T2) {
      const int tg = tok0 + static_cast<int>(lane);
      int a = 0, b = 0;
      if (tg < S) {
        a = max(__ldg(ks + tg), 0);
        b = min(__ldg(ke + tg), SKV);
        if (max_seqlen_k > 0 && b > a && b - a > max_seqlen_k) b = a + max_seqlen_k;  // b > a: no overflow
      }
      reinterpret_cast<int2*>(info + L.info_offset_ranges())[lane] = make_int2(a, b);
      if (b > a) {
        u_lo = a;
        u_hi = b;
      }
    }
    u_lo = __reduce_min_sync(0xffffffffu, u_lo);
    u_hi = __reduce_max_sync(0xffffffffu, u_hi);
    const int num_tiles = u_hi > u_lo ? (u_hi - u_lo - 1) / kBlockKV + 1 : 0;
    if (lane == 0) {
      reinterpret_cast<int*>(info)[0] = u_lo;
      reinterpret_cast<int*>(info)[1] = num_tiles;
    }
    // The block's weights, token-major; 0 for tokens >= S.
    float* winfo = reinterpret_cast<float*>(info + L.info_offset_weights());
#pragma unroll
    for (int i = lane; i < T2 * H; i += 32) {
      const int tg = tok0 + i / H;
      const int64_t wi = static_cast<int64_t>(tg) * weights_stride + (i % H);
      float wv = 0.0f;
      if (tg < S)
        wv = weights_bf16 ? __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(weights) + wi))
                          : __ldg(static_cast<const float*>(weights) + wi);
      winfo[i] = wv;
    }
    __syncwarp();
    if (lane == 0) {
      // q tiles only when there is work, and only for warpgroups with a valid token.
      uint32_t bytes = 0;
#pragma unroll
      for (int w = 0; w < L.num_math_wgs(); ++w)
        if (num_tiles > 0 && tok0 + w * T < S) bytes += kQBoxBytes;
      ptx::mbar_arrive_expect_tx(q_full(qs), bytes);
#pragma unroll
      for (int w = 0; w < L.num_math_wgs(); ++w)
        if (num_tiles > 0 && tok0 + w * T < S)
#pragma unroll
          for (int cb = 0; cb < L.col_blocks(); ++cb)
            ptx::tma_load_2d(smem + L.offset_q(qs, w) + cb * L.q_col_block_bytes(), &tmap_q, q_full(qs),
                             cb * L.box_elems(), (tok0 + w * T) * H, ptx::kCacheEvictFirst);
    } else {
      ptx::mbar_arrive(q_full(qs));
    }
    u_lo_out = u_lo;
    tiles_out = num_tiles;
  };
  // KV tile t of the current q block into ring stage kv (free).
  auto produce_kv = [&](int u_lo, int t, const ptx::PipelineState<kNumKVStages>& kv) {
    if constexpr (kStageScales) {
      // The tile's 64 k scales (rows past SKV read the last one; their logits are not stored).
      float* dst = reinterpret_cast<float*>(smem + L.offset_scales(kv.index));
      const int row0 = u_lo + t * kBlockKV;
#pragma unroll
      for (int i = 0; i < kBlockKV / 32; ++i)
        ptx::cp_async_4(dst + 32 * i + lane, k_scale + min(row0 + 32 * i + static_cast<int>(lane), SKV - 1));
      ptx::cp_async_mbar_arrive(kv_full(kv.index));
    }
    if (lane == 0) {
      ptx::mbar_arrive_expect_tx(kv_full(kv.index), kKVTileBytes);
#pragma unroll
      for (int cb = 0; cb < L.col_blocks(); ++cb)
        ptx::tma_load_2d(smem + L.offset_kv(kv.index) + cb * L.kv_col_block_bytes(), &tmap_k, kv_full(kv.index),
                         cb * L.box_elems(), u_lo + t * kBlockKV, ptx::kCacheEvictNormal);
    }
  };

  if (static_cast<int>(warp) < L.producer_warps()) {
    // ===================================================================== producer
    ptx::reg_dealloc<L.producer_regs()>();
    const int pw = static_cast<int>(warp);  // producer warp: 0 TMA, 1.. the fill
    if (pw != 0) {
      // The fill warps (clean only): -inf outside each owned token's range [a, b); the math
      // warpgroups write exactly [a, b) when it is not empty, so the two never touch the same element.
      if (clean) {
#pragma unroll 1
        for (int it = 0;; ++it) {
          const int blk = q_block(it);
          if (blk >= num_blocks) break;
#pragma unroll 1
          for (int tb = pw - 1; tb < T2; tb += kFillWarps) {
            const int tg = blk * T2 + tb;
            if (tg >= S) break;
            const int a = min(max(__ldg(ks + tg), 0), SKV);
            const int b = min(max(__ldg(ke + tg), a), SKV);
            OutT* row = logits + static_cast<int64_t>(tg) * logits_stride;
            if (max_seqlen_k > 0) {  // compressed: the row's min(b - a, M) keys, then -inf up to M
              mqa_detail::fill_neg_inf_warp(row, min(b - a, max_seqlen_k), max_seqlen_k, lane);
            } else {
              mqa_detail::fill_neg_inf_warp(row, 0, a, lane);
              mqa_detail::fill_neg_inf_warp(row, b, SKV, lane);
            }
          }
        }
      }
      return;
    }

    ptx::PipelineState<kNumKVStages> kv;
    for (int it = 0;; ++it) {
      const int blk = q_block(it);
      if (blk >= num_blocks) break;
      const int qs = it & 1;
      ptx::mbar_wait(q_empty(qs), ((it >> 1) & 1) ^ 1);
      int u_lo, num_tiles;
      produce_block(blk, qs, u_lo, num_tiles);
      for (int t = 0; t < num_tiles; ++t) {
        ptx::mbar_wait(kv_empty(kv.index), kv.phase ^ 1);
        produce_kv(u_lo, t, kv);
        kv.advance();
      }
    }
  } else {
    // ===================================================================== math
    ptx::reg_alloc<L.math_regs()>();
    const int wg = static_cast<int>(warp / 4) - 1;  // 0 .. num_math_wgs() - 1
    const int warp_in_wg = static_cast<int>(warp % 4);
    const int quad = static_cast<int>(lane & 3);
    const int row_in_tile = warp_in_wg * 16 + static_cast<int>(lane >> 2);  // + 8 * j

    // Ownership after the quad reduce-scatter (partial sums are indexed v = j + 2 * token):
    //   T >= 4: tokens 4 m + quad (m < T / 4), both rows j;   result index k = j + 2 m
    //   T == 2: token quad & 1, row j = quad >> 1
    //   T == 1: token 0, row j = quad & 1, stored by the lanes with quad < 2 only
    constexpr int kOwnTok = T >= 4 ? T / 4 : 1;
    constexpr int kOwnJ = T >= 4 ? 2 : 1;
    constexpr int kNumRes = kOwnTok * kOwnJ;
    auto own_tok = [&](int m) -> int { return T >= 4 ? 4 * m + quad : (T == 2 ? (quad & 1) : 0); };
    auto own_j = [&](int jj) -> int { return T >= 4 ? jj : (T == 2 ? (quad >> 1) : (quad & 1)); };

    float acc0[kNumAccum], acc1[kNumAccum];
#pragma unroll
    for (int i = 0; i < kNumAccum; ++i) acc0[i] = acc1[i] = 0.0f;

    ptx::PipelineState<kNumKVStages> kv_issue, kv_release;

    for (int it = 0;; ++it) {
      const int blk = q_block(it);
      if (blk >= num_blocks) break;
      const int qs = it & 1;
      const uint32_t qph = (it >> 1) & 1;
      ptx::mbar_wait(q_full(qs), qph);

      const uint8_t* info = smem + L.offset_info(qs);
      const int u_lo = reinterpret_cast<const int*>(info)[0];
      const int num_tiles = reinterpret_cast<const int*>(info)[1];

      if (num_tiles > 0) {
        // Head weights of this thread's 32 accumulator columns n = 8 g + 2 quad + c, in registers.
        // split_relu needs w relu(x) = (w / 2) |x| + (w / 2) x: the registers hold w / 2 and
        // coef = sigma / 2.
        float wreg[kNumAccum / 2];
        {
          const float* winfo = reinterpret_cast<const float*>(info + L.info_offset_weights()) + wg * 128;
#pragma unroll
          for (int g = 0; g < 16; ++g) {
            const float2 w2 = *reinterpret_cast<const float2*>(winfo + 8 * g + 2 * quad);
            wreg[2 * g] = kSplitRelu ? 0.5f * w2.x : w2.x;
            wreg[2 * g + 1] = kSplitRelu ? 0.5f * w2.y : w2.y;
          }
        }
        auto weight = [&](int g, int c) -> float { return wreg[2 * g + c]; };
        // split_relu: the linear rows, and coef[t] = sigma / 2 (see above) of the piece in this
        // quad's columns.
        float coef[kSplitRelu ? T : 1];
        if constexpr (kSplitRelu) {
          uint32_t* amax =
              reinterpret_cast<uint32_t*>(smem + L.offset_info(qs) + L.info_offset_amax()) + wg * T * kP;
          const int num_valid = min(T, S - (blk * T2 + wg * T));
          uint8_t* q_tile = smem + L.offset_q(qs, wg);
          const float* wts = reinterpret_cast<const float*>(info + L.info_offset_weights()) + wg * T * H;
          split_relu::build_pieces<H, D, T>(q_tile, q_tile + L.q_box_bytes(), wts, amax, num_valid,
                                            static_cast<int>(threadIdx.x % 128), 1 + wg);
#pragma unroll
          for (int tok = 0; tok < T; ++tok)
            coef[tok] = 0.5f * split_relu::piece_scale(amax[tok * kP + quad]);
        }
        // Ranges and output rows of the owned tokens.
        int rlo[kOwnTok], rhi[kOwnTok];
        OutT* obase[kOwnTok];  // &logits[token][u_lo + row_in_tile (+ 8 j when j is per lane)]
#pragma unroll
        for (int m = 0; m < kOwnTok; ++m) {
          const int tb = wg * T + own_tok(m);
          const int2 rg = reinterpret_cast<const int2*>(info + L.info_offset_ranges())[tb];
          const int tg = blk * T2 + tb;
          rlo[m] = rg.x;
          rhi[m] = (T == 1 && quad >= 2) ? rg.x : rg.y;  // T == 1: half the lanes hold duplicates
          // Compressed: column = key - rlo (the offset may be negative; stores need key >= rlo).
          const int col_shift = max_seqlen_k > 0 ? rg.x : 0;
          obase[m] = logits + (static_cast<int64_t>(tg < S ? tg : 0) * logits_stride + (u_lo - col_shift) +
                               row_in_tile + (kOwnJ == 1 ? 8 * own_j(0) : 0));
          // NOTES: opaque to the compiler, so that it keeps the pointer instead of rebuilding it from
          // the parameters per tile: faster for the store-heavy shapes (H <= 32, D <= 64, H = 128),
          // slower for H = 64, D = 128, which is left alone.
          if constexpr (!(H == 64 && D == 128)) asm volatile("" : "+l"(obase[m]));
        }
        // Running store state, advanced by one tile per epilogue (tiles are retired in order): the
        // pointer of tile t's first row, and that row's key minus rlo, checked against the range's
        // width by one unsigned compare (keys before rlo wrap around). NOTES: cheaper than rebuilding the
        // address and a two-sided check from t per store, which the store-bound shapes feel.
        OutT* optr[kOwnTok];
        int dist[kOwnTok];
        uint32_t width[kOwnTok];
#pragma unroll
        for (int m = 0; m < kOwnTok; ++m) {
          optr[m] = obase[m];
          dist[m] = u_lo + row_in_tile + (kOwnJ == 1 ? 8 * own_j(0) : 0) - rlo[m];
          width[m] = static_cast<uint32_t>(max(rhi[m] - rlo[m], 0));
        }

        const uint64_t desc_q = ptx::make_kmajor_desc<kSwizzle>(smem + L.offset_q(qs, wg));

        // Waits for the tile's data, takes its k scales (this thread's rows, from the stage) and issues
        // its WGMMAs into `acc`. bf16 (no k scales): 1, which the compiler folds out of the stores.
        // NOTES: from shared memory, the scales cost two LDS per tile; loading them from global memory
        // a tile ahead in the math warps puts an L2 round trip under the store stream, which is slower.
        auto issue = [&](float(&acc)[kNumAccum], float(&sc)[kOwnJ]) {
          ptx::mbar_wait(kv_full(kv_issue.index), kv_issue.phase);
          const float* stage_sc = reinterpret_cast<const float*>(smem + L.offset_scales(kv_issue.index));
#pragma unroll
          for (int jj = 0; jj < kOwnJ; ++jj) {
            sc[jj] = kStageScales ? stage_sc[row_in_tile + 8 * own_j(jj)] : 1.0f;
          }
          const uint64_t desc_k = ptx::make_kmajor_desc<kSwizzle>(smem + L.offset_kv(kv_issue.index));
          kv_issue.advance();
          ptx::wgmma_fence();
          // K step k: column block k / kStepsPerBlock, +32 B (+2 in descriptor units) per step inside it.
#pragma unroll
          for (int k = 0; k < kKSteps; ++k) {
            const int cb = k / kStepsPerBlock, in_blk = k % kStepsPerBlock;
            Mma::mma(acc, desc_k + ((cb * L.kv_col_block_bytes()) >> 4) + 2 * in_blk,
                     desc_q + ((cb * L.q_col_block_bytes()) >> 4) + 2 * in_blk, k > 0);
          }
        };

        // Retires the KV stage of the tile whose WGMMAs have completed. Every lane read the stage's k
        // scales; the warp barrier orders those reads before lane 0's release arrival, after
        // which the producer may overwrite the stage.
        auto release = [&]() {
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(kv_empty(kv_release.index));
          kv_release.advance();
        };

        // Per element: relu(x), or |x| with split_relu (a free FFMA operand modifier; the weights
        // are halved) plus, per (token, row), the linear half from the token's piece columns
        // (column 128 + 8 (t / 2) + 2 quad + t % 2 holds piece `quad` of token t).
        auto relu_part = [](float x) { return kSplitRelu ? fabsf(x) : fmaxf(x, 0.0f); };
        auto linear_part = [&](const float(&acc)[kNumAccum], int tok, int j, float s) {
          if constexpr (kSplitRelu) return fmaf(coef[tok], acc[4 * (16 + tok / 2) + 2 * j + tok % 2], s);
          return s;
        };

        // relu, head weights, head reduction, k scale, store.
        auto epilogue = [&](const float(&acc)[kNumAccum], const float(&sc)[kOwnJ], int t) {
          constexpr int V = 2 * T;
          float part[V];
#pragma unroll
          for (int tok = 0; tok < T; ++tok) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              if constexpr (V <= 4) {
                // Few partial sums: split each chain in two for ILP.
                float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
                for (int gg = 0; gg < G; ++gg) {
                  const int g = tok * G + gg;
                  const float x0 = relu_part(acc[4 * g + 2 * j]);
                  const float x1 = relu_part(acc[4 * g + 2 * j + 1]);
                  s0 = gg == 0 ? weight(g, 0) * x0 : fmaf(weight(g, 0), x0, s0);
                  s1 = gg == 0 ? weight(g, 1) * x1 : fmaf(weight(g, 1), x1, s1);
                }
                part[j + 2 * tok] = linear_part(acc, tok, j, s0 + s1);
              } else {
                float s = 0.0f;
#pragma unroll
                for (int gg = 0; gg < G; ++gg) {
                  const int g = tok * G + gg;
#pragma unroll
                  for (int c = 0; c < 2; ++c) {
                    const float x = relu_part(acc[4 * g + 2 * j + c]);
                    s = (gg == 0 && c == 0) ? weight(g, c) * x : fmaf(weight(g, c), x, s);
                  }
                }
                part[j + 2 * tok] = linear_part(acc, tok, j, s);
              }
            }
          }
          // Quad reduce-scatter.
          float res[kNumRes];
          if constexpr (T >= 4) {
            float half[V / 2];
            ptx::reduce_scatter_step<V, 1, 1>(part, half, (quad & 1) != 0);
            ptx::reduce_scatter_step<V / 2, 1, 2>(half, res, (quad & 2) != 0);
          } else if constexpr (T == 2) {
            float half[2];
            ptx::reduce_scatter_step<4, 1, 1>(part, half, (quad & 1) != 0);
            ptx::reduce_scatter_step<2, 0, 2>(half, res, (quad & 2) != 0);
          } else {
            ptx::reduce_scatter_step<2, 0, 1>(part, res, (quad & 1) != 0);
            res[0] += __shfl_xor_sync(0xffffffffu, res[0], 2);
          }
#pragma unroll
          for (int m = 0; m < kOwnTok; ++m) {
#pragma unroll
            for (int jj = 0; jj < kOwnJ; ++jj) {
              const int jo = kOwnJ == 1 ? 0 : 8 * jj;
              if (static_cast<uint32_t>(dist[m] + jo) < width[m])
                mqa_detail::store_out(optr[m] + jo, res[jj + kOwnJ * m] * sc[jj]);
            }
            optr[m] += kBlockKV;
            dist[m] += kBlockKV;
          }
        };

        // Accumulator double buffering: tile t+1's WGMMAs are in flight while tile t's epilogue
        // runs. Every commit follows its WGMMAs in the same basic block (a commit on a path without
        // WGMMAs makes ptxas add a dummy group, which turns wait_group<1> into a full wait), and
        // every epilogue read follows a wait_group whose only possibly pending group writes the
        // other accumulator set. NOTES: the steps stay written out; folding them into
        // issue/retire lambdas made nvcc 13.0 segfault (H=16, D=32).
        float sc0[kOwnJ], sc1[kOwnJ];
        if constexpr (!L.double_buffered()) {
          // One accumulator set: the other math warpgroups keep the tensor cores busy meanwhile.
          for (int t = 0; t < num_tiles; ++t) {
            issue(acc0, sc0);
            ptx::wgmma_commit();
            ptx::wgmma_wait<0>();
            ptx::fence_accum<kNumAccum>(acc0);
            release();
            epilogue(acc0, sc0, t);
          }
        } else {
        issue(acc0, sc0);
        ptx::wgmma_commit();
        int t = 0;
        // Invariant at the loop head: tile t in acc0 is the only pending group.
        while (t + 2 < num_tiles) {
          issue(acc1, sc1);
          ptx::wgmma_commit();
          ptx::wgmma_wait<1>();
          ptx::fence_accum<kNumAccum>(acc0);
          release();
          epilogue(acc0, sc0, t);
          issue(acc0, sc0);
          ptx::wgmma_commit();
          ptx::wgmma_wait<1>();
          ptx::fence_accum<kNumAccum>(acc1);
          release();
          epilogue(acc1, sc1, t + 1);
          t += 2;
        }
        if (t + 1 < num_tiles) {
          issue(acc1, sc1);
          ptx::wgmma_commit();
          ptx::wgmma_wait<1>();
          ptx::fence_accum<kNumAccum>(acc0);
          release();
          epilogue(acc0, sc0, t);
          ptx::wgmma_wait<0>();
          ptx::fence_accum<kNumAccum>(acc1);
          release();
          epilogue(acc1, sc1, t + 1);
        } else {
          ptx::wgmma_wait<0>();
          ptx::fence_accum<kNumAccum>(acc0);
          release();
          epilogue(acc0, sc0, t);
        }
        }
      }
      // Done with q stage qs (all WGMMAs retired above) and its info.
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(q_empty(qs));
    }
  }
#else
  // sm_90a only.
  asm volatile("trap;");
#endif
}

template <int kNumHeads, int kHeadDim, int kNumKVStages, typename OutT>
__global__ void __launch_bounds__(MqaLogitsLayout{kNumHeads, kHeadDim, kNumKVStages, int(sizeof(OutT))}.num_threads(), 1)
    mqa_logits_kernel(const __grid_constant__ CUtensorMap tmap_q, const __grid_constant__ CUtensorMap tmap_k,
                      const float* __restrict__ k_scale, const void* __restrict__ weights,
                      int64_t weights_stride, int weights_bf16, const int* __restrict__ ks, const int* __restrict__ ke,
                      OutT* __restrict__ logits, int64_t logits_stride, int S, int SKV, int max_seqlen_k, int clean) {
  mqa_logits_body<kNumHeads, kHeadDim, kNumKVStages, OutT, 0, false, 1>(tmap_q, tmap_k, k_scale, weights, weights_stride,
                                                                     weights_bf16, ks, ke, logits, logits_stride, S,
                                                                     SKV, max_seqlen_k, clean);
}

// Same kernel with an explicit number of math warpgroups (2, 3 or 4), epilogue form and input type
// (kInBytes 1: fp8, 2: bf16); the host must then use
// MqaLogitsLayout{H, D, stages, out_bytes, kMathWGs, kSplitRelu, kInBytes} for threads, shared memory and
// q blocks.
template <int kNumHeads, int kHeadDim, int kNumKVStages, typename OutT, int kMathWGs, bool kSplitRelu = false,
          int kInBytes = 1>
__global__ void __launch_bounds__(
    MqaLogitsLayout{kNumHeads, kHeadDim, kNumKVStages, int(sizeof(OutT)), kMathWGs, kSplitRelu, kInBytes}.num_threads(), 1)
    mqa_logits_kernel_wgs(const __grid_constant__ CUtensorMap tmap_q, const __grid_constant__ CUtensorMap tmap_k,
                          const float* __restrict__ k_scale, const void* __restrict__ weights,
                          int64_t weights_stride, int weights_bf16, const int* __restrict__ ks,
                          const int* __restrict__ ke, OutT* __restrict__ logits, int64_t logits_stride, int S, int SKV,
                          int max_seqlen_k, int clean) {
  static_assert(kMathWGs >= 2 && kMathWGs <= 4, "2, 3 or 4 math warpgroups");
  mqa_logits_body<kNumHeads, kHeadDim, kNumKVStages, OutT, kMathWGs, kSplitRelu, kInBytes>(
      tmap_q, tmap_k, k_scale, weights, weights_stride, weights_bf16, ks, ke, logits, logits_stride, S, SKV,
      max_seqlen_k, clean);
}

}  // namespace deep_indexer
