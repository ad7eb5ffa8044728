// Training: per-row statistics of the bf16 indexer logits for the warm-up loss's forward,
//   I[t, s] = sum_h w[t, h] relu(q[t, h, :] . k[s, :])   for max(ks[t], 0) <= s < min(ke[t], N)
// (see training_logits_stats_kernel; the logits themselves come from the prefill kernel's bf16 form,
// mqa_logits.cuh).
//
// Structure (sizes: training_logits_layout.hpp): one warpgroup per CTA owns 128 rows of the [T*H, D]
// view of q (128 / H tokens), kept in shared memory, and walks the 64-key tiles covering the union
// of its tokens' ranges. Per tile: WGMMA m64n128k16 (A = k tile: 64 keys, B = the q rows, both
// K-major, 128-byte swizzle; D / 16 K steps), then on CUDA cores relu, head weights (registers),
// in-thread head sum, quad all-reduce, online row statistics. Tiles are double-buffered: the next tile is
// loaded (plain 16-byte loads, swizzled shared stores) while the tensor cores work on the current one.
// Rows past T*H and keys past N are zero-filled.
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>

#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/training/training_logits_layout.hpp>
#include <deep_indexer/common/wgmma_bf16.cuh>

namespace deep_indexer {

namespace training_detail {

// Rows [row0, row0 + kRows) of a [num_rows, D] bf16 matrix into a tile of D / 64 swizzled blocks of
// [kRows][128 B]; rows >= num_rows become zeros. All 128 threads take part.
template <int kRows, int kHeadDim>
DI_DEVICE void load_rows(uint8_t* tile, const __nv_bfloat16* __restrict__ src, long long row0, long long num_rows,
                         int tid) {
  constexpr int kChunks = kHeadDim * 2 / 16;  // 16-byte chunks per row
  constexpr int kChunksPerBlock = TrainingLogitsLayout::kSwizzleBytes / 16;
  constexpr int kBlockBytes = kRows * TrainingLogitsLayout::kSwizzleBytes;
  static_assert((kRows * kChunks) % TrainingLogitsLayout::kNumThreads == 0, "tile not divisible by the threads");
  using Swz = ptx::SwizzleMode<TrainingLogitsLayout::kSwizzleBytes>;
#pragma unroll
  for (int it = 0; it < kRows * kChunks / TrainingLogitsLayout::kNumThreads; ++it) {
    const int i = it * TrainingLogitsLayout::kNumThreads + tid;
    const int r = i / kChunks, c = i % kChunks;
    const long long row = row0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < num_rows) v = __ldg(reinterpret_cast<const uint4*>(src + row * kHeadDim) + c);
    const uint32_t off = (c / kChunksPerBlock) * kBlockBytes +
                         Swz::swizzle(static_cast<uint32_t>(r * TrainingLogitsLayout::kSwizzleBytes +
                                                            (c % kChunksPerBlock) * 16));
    *reinterpret_cast<uint4*>(tile + off) = v;
  }
}

}  // namespace training_detail

// The forward statistics of the warm-up loss (training_target.cuh computes p): for each row t in
// [row_begin, row_end) with a non-empty range the row's statistics
//   lse_out[t] = log sum_s exp(I[t, s]),   pi_out[t] = sum_s p[t, s] I[t, s]
// over its valid keys, with p[t, s] = p_in[(t - row_begin) * p_stride + s] (read only there); an empty
// row gets lse -inf and pi 0. Each lane owns the (token, key row) pairs p = 2 j + i with p % 4 == quad:
// an online max / sum of exp per owned token, reduced over the CTA at the end.
template <int kNumHeads, int kHeadDim>
__global__ void __launch_bounds__(TrainingLogitsLayout::kNumThreads, 1)
    training_logits_stats_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                                 const float* __restrict__ weights, int64_t weights_stride, const int* __restrict__ ks,
                                 const int* __restrict__ ke, const float* __restrict__ p_in, int64_t p_stride,
                                 float* __restrict__ lse_out, float* __restrict__ pi_out, int row_begin, int row_end,
                                 int num_keys) {
  constexpr TrainingLogitsLayout L{kNumHeads, kHeadDim};
  static_assert(L.valid(), "unsupported training_logits layout");
  constexpr int kTokens = L.tokens_per_cta();
  constexpr int kBlockKV = L.block_kv();
  constexpr int kN = L.q_rows();                  // WGMMA N
  constexpr int kGroups = kN / 8;                 // 8-column groups of the accumulator
  constexpr int kGroupsPerToken = kNumHeads / 8;  // a token's heads span whole groups
  constexpr int kKSteps = kHeadDim / 16;
  constexpr int kStepsPerBlock = TrainingLogitsLayout::kSwizzleElems / 16;
  using Mma = ptx::WgmmaBf16<kN>;
  constexpr int kNumAccum = Mma::kNumAccum;
  static_assert(kNumAccum == 4 * kGroups, "accumulator layout: 4 floats per 8-column group");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + L.kAlign - 1) &
                                             ~static_cast<uintptr_t>(L.kAlign - 1));
  __shared__ int s_range[2];
  __shared__ float s_stats[4 * kTokens * 3];  // [warp][token][m, l, pi]

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32, quad = lane & 3;
  const long long t0 = static_cast<long long>(row_begin) + static_cast<long long>(blockIdx.x) * kTokens;

  // This thread's tokens' ranges (clamped into [0, N]) and the union over the CTA.
  int tlo[kTokens], thi[kTokens];
#pragma unroll
  for (int j = 0; j < kTokens; ++j) {
    const long long t = t0 + j;
    tlo[j] = t < row_end ? max(__ldg(ks + t), 0) : 0;
    thi[j] = t < row_end ? min(__ldg(ke + t), num_keys) : 0;
  }
  if (warp == 0) {
    int lo = INT_MAX, hi = INT_MIN;
#pragma unroll
    for (int j = 0; j < kTokens; ++j)
      if (tlo[j] < thi[j]) lo = min(lo, tlo[j]), hi = max(hi, thi[j]);
    if (lane == 0) s_range[0] = lo, s_range[1] = hi;
  }

  // Head weights of this thread's accumulator columns n = 8 g + 2 quad + c (token n / H, head n % H).
  float wreg[2 * kGroups];
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int n = 8 * g + 2 * quad + c;
      const long long t = t0 + n / kNumHeads;
      wreg[2 * g + c] = t < row_end ? __ldg(weights + t * weights_stride + n % kNumHeads) : 0.0f;
    }
  }

  // Per owned token: running max, sum of exp(I - max), sum of p I.
  float st_m[kTokens], st_l[kTokens], st_pi[kTokens];
#pragma unroll
  for (int j = 0; j < kTokens; ++j) st_m[j] = -INFINITY, st_l[j] = 0.0f, st_pi[j] = 0.0f;

  training_detail::load_rows<kN, kHeadDim>(smem + L.offset_q(), q, t0 * kNumHeads,
                                           static_cast<long long>(row_end) * kNumHeads, tid);
  __syncthreads();
  const int lo = s_range[0], hi = s_range[1];
  if (lo < hi) {  // uniform: else no token of this CTA has a valid key
    const int num_tiles = (hi - lo + kBlockKV - 1) / kBlockKV;

    training_detail::load_rows<kBlockKV, kHeadDim>(smem + L.offset_k(0), k, lo, num_keys, tid);
    ptx::fence_proxy_async();  // generic-proxy shared stores -> visible to the WGMMA (async proxy)
    __syncthreads();

    const int row_in_tile = warp * 16 + lane / 4;  // + 8 i
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int stage = tile & 1;
      const int key0 = lo + tile * kBlockKV;
      float acc[kNumAccum];
      ptx::wgmma_fence();
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) {
        // K step s: column block s / 4, +32 B per step inside it (+2 in descriptor units)
        const int blk = s / kStepsPerBlock, in_blk = s % kStepsPerBlock;
        const uint64_t desc_k =
            ptx::make_kmajor_desc<TrainingLogitsLayout::kSwizzleBytes>(smem + L.offset_k(stage) + blk * L.k_block_bytes()) +
            2 * in_blk;
        const uint64_t desc_q =
            ptx::make_kmajor_desc<TrainingLogitsLayout::kSwizzleBytes>(smem + L.offset_q() + blk * L.q_block_bytes()) +
            2 * in_blk;
        Mma::mma(acc, desc_k, desc_q, s > 0);
      }
      ptx::wgmma_commit();
      // The next tile goes into the other stage while the tensor cores work (that stage's last reader,
      // tile - 1's WGMMA, retired before the barrier that ended the previous iteration).
      if (tile + 1 < num_tiles)
        training_detail::load_rows<kBlockKV, kHeadDim>(smem + L.offset_k(stage ^ 1), k, key0 + kBlockKV, num_keys, tid);
      ptx::wgmma_wait<0>();
      ptx::fence_accum<kNumAccum>(acc);

      // part[j][i]: token j, key row row_in_tile + 8 i; in-thread sum over this thread's heads.
      float part[kTokens][2];
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float s = 0.0f;
#pragma unroll
          for (int gg = 0; gg < kGroupsPerToken; ++gg) {
            const int g = j * kGroupsPerToken + gg;
#pragma unroll
            for (int c = 0; c < 2; ++c) s = fmaf(wreg[2 * g + c], fmaxf(acc[4 * g + 2 * i + c], 0.0f), s);
          }
          s += __shfl_xor_sync(0xffffffffu, s, 1);
          s += __shfl_xor_sync(0xffffffffu, s, 2);
          part[j][i] = s;
        }
      }
      // Every lane of the quad holds the totals; lane `quad` handles the pairs p = 2 j + i with p % 4 == quad.
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int key = key0 + row_in_tile + 8 * i;
          if ((2 * j + i) % 4 == quad && key >= tlo[j] && key < thi[j]) {
            const float x = part[j][i];
            const float m = fmaxf(st_m[j], x);
            st_l[j] = st_l[j] * expf(st_m[j] - m) + expf(x - m);
            st_m[j] = m;
            st_pi[j] = fmaf(__ldg(p_in + (t0 + j - row_begin) * p_stride + key), x, st_pi[j]);
          }
        }
      }
      ptx::fence_proxy_async();
      __syncthreads();
    }
  }
  // Combine (max, sum, pi) over the lanes of each warp, then over the 4 warps.
  auto combine = [](float& m, float& l, float& pi, float m2, float l2, float pi2) {
    const float mm = fmaxf(m, m2);
    l = mm == -INFINITY ? 0.0f : l * expf(m - mm) + l2 * expf(m2 - mm);
    m = mm;
    pi += pi2;
  };
#pragma unroll
  for (int j = 0; j < kTokens; ++j) {
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, st_m[j], off);
      const float l2 = __shfl_xor_sync(0xffffffffu, st_l[j], off);
      const float pi2 = __shfl_xor_sync(0xffffffffu, st_pi[j], off);
      combine(st_m[j], st_l[j], st_pi[j], m2, l2, pi2);
    }
    if (lane == 0) {
      s_stats[(warp * kTokens + j) * 3 + 0] = st_m[j];
      s_stats[(warp * kTokens + j) * 3 + 1] = st_l[j];
      s_stats[(warp * kTokens + j) * 3 + 2] = st_pi[j];
    }
  }
  __syncthreads();
  if (tid < kTokens && t0 + tid < row_end) {
    float m = -INFINITY, l = 0.0f, pi = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w)
      combine(m, l, pi, s_stats[(w * kTokens + tid) * 3 + 0], s_stats[(w * kTokens + tid) * 3 + 1],
              s_stats[(w * kTokens + tid) * 3 + 2]);
    lse_out[t0 + tid] = l > 0.0f ? m + logf(l) : -INFINITY;
    pi_out[t0 + tid] = pi;
  }
}

}  // namespace deep_indexer
