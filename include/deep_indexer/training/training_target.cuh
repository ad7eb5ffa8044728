// Training: the head-mean attention target of the warm-up KL loss (SM90, bf16 WGMMA):
//   p[t, s] = inv_heads * sum_h exp(scale * q[t, h, :] . k[s, :] - lse[t, h])
// for the rows t in [row_begin, row_end) and their keys max(ks[t], 0) <= s < min(ke[t], N); written
// to p_out[(t - row_begin) * p_stride + s] (nothing else is written), with the row statistics
// plogp[t] = sum_s p log p and mass[t] = sum_s p (when the pointers are not null; 0 for an empty row).
// H = 128 heads, one key head of dimension D; lse is the natural-log LSE per (t, h), finite (the host
// replaces -inf by 0: an empty row has no valid key anyway).
//
// Structure and shared memory: training_target_layout.hpp. Synchronisation (mbarriers, parities from
// running counters):
//   full[s]       1 arrival (producer, expect_tx) + the tile's bytes (both CTAs' halves under multicast)
//   empty[s]      lane 0 of each math warp of every CTA of the cluster (the tile is in all of them)
//   red_full[r]   lane 0 of each math warp, after storing its 64 partial column sums
//   red_empty[r]  lane 0 of each reducer warp, after reading them
// Every CTA of a cluster walks the same union tiles (the multicast needs every CTA's half); a CTA runs
// WGMMAs and the epilogue only on the tiles that meet its own range ("own" tiles), in the same order in
// every role. The two math warpgroups take turns issuing (named barriers kBarSchedule0 + w), so that one
// warpgroup's exp2 epilogue runs while the other's WGMMAs keep the tensor cores busy.
#pragma once
#include <climits>
#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>

#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/training/training_target_layout.hpp>
#include <deep_indexer/common/wgmma_bf16_rs.cuh>

namespace deep_indexer {

namespace training_detail {

// The A fragments of rows [row0, row0 + 64) of a row-major bf16 matrix with kDim columns (one warpgroup,
// WGMMA m64k16 register layout): a[kk] = {(r, 16 kk + c), (r + 8, 16 kk + c), (r, 16 kk + 8 + c),
// (r + 8, 16 kk + 8 + c)} with r = row0 + 16 warp + lane / 4, c = 2 (lane % 4) (pairs of bf16).
// Rows >= num_rows read as zeros. Rows are `row_stride` elements apart (kDim: a dense matrix).
template <int kDim>
DI_DEVICE void load_a_fragments(uint32_t (&a)[kDim / 16][4], const __nv_bfloat16* __restrict__ src, long long row0,
                                long long num_rows, int warp_in_wg, int lane, long long row_stride = kDim) {
  const long long r0 = row0 + 16 * warp_in_wg + lane / 4;
  const long long r1 = r0 + 8;
  const uint32_t* p0 = reinterpret_cast<const uint32_t*>(src + r0 * row_stride) + (lane % 4);
  const uint32_t* p1 = reinterpret_cast<const uint32_t*>(src + r1 * row_stride) + (lane % 4);
  const bool ok0 = r0 < num_rows, ok1 = r1 < num_rows;
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    a[kk][0] = ok0 ? __ldg(p0 + 8 * kk) : 0u;
    a[kk][1] = ok1 ? __ldg(p1 + 8 * kk) : 0u;
    a[kk][2] = ok0 ? __ldg(p0 + 8 * kk + 4) : 0u;
    a[kk][3] = ok1 ? __ldg(p1 + 8 * kk + 4) : 0u;
  }
}

}  // namespace training_detail

// kLse: the attention's own log-sum-exp instead (when the caller has none): lse_out[t, h] = log sum_s
// exp(scale q[t, h] . k[s]) over the row's valid keys (-inf for an empty row), an online max / sum per
// (row, head) over the tiles; `lse`, p and the statistics are not used, the reducer warps idle.
template <int kHeadDim, int kCluster, bool kLse = false>
__global__ void __launch_bounds__(TrainingTargetLayout::kThreads, 1)
    training_target_kernel(const __grid_constant__ CUtensorMap tmap_k, const __nv_bfloat16* __restrict__ q,
                           const float* __restrict__ lse, const int* __restrict__ ks, const int* __restrict__ ke,
                           float* __restrict__ p_out, int64_t p_stride, float* __restrict__ plogp_out,
                           float* __restrict__ mass_out, int row_begin, int row_end, int num_keys, float scale_log2,
                           float inv_heads, float* __restrict__ lse_out) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = TrainingTargetLayout;
  constexpr L lay{kHeadDim, kCluster};
  static_assert(lay.valid(), "unsupported training_target configuration");
  constexpr int kStages = lay.num_stages();
  constexpr int kKSteps = lay.k_steps();
  constexpr int kBlockKV = L::kBlockKV;
  constexpr uint32_t kStageBytes = lay.stage_bytes();
  constexpr int kBoxRows = lay.box_rows();
  using Mma = ptx::WgmmaBf16RS<kBlockKV, false>;
  static_assert(Mma::kNumAccum == 32, "m64n64: 32 accumulators per thread");

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((L::kAlign - (ptx::smem_addr(smem_raw) & (L::kAlign - 1))) & (L::kAlign - 1));
  auto full = [&](int s) { return reinterpret_cast<uint64_t*>(smem + lay.offset_full(s)); };
  auto empty = [&](int s) { return reinterpret_cast<uint64_t*>(smem + lay.offset_empty(s)); };
  auto red_full = [&](int r) { return reinterpret_cast<uint64_t*>(smem + lay.offset_red_full(r)); };
  auto red_empty = [&](int r) { return reinterpret_cast<uint64_t*>(smem + lay.offset_red_empty(r)); };
  auto red = [&](int r) { return reinterpret_cast<float*>(smem + lay.offset_red(r)); };

  const uint32_t warp = ptx::warp_idx();
  const uint32_t lane = ptx::lane_idx();
  const int rank = kCluster > 1 ? static_cast<int>(ptx::cluster_ctarank()) : 0;

  // This cluster's tokens: groups of kCluster consecutive rows, the last (longest under causal bounds) first.
  const int num_groups = (row_end - row_begin + kCluster - 1) / kCluster;
  const int group = num_groups - 1 - static_cast<int>(blockIdx.x) / kCluster;
  const int t = row_begin + group * kCluster + rank;
  int lo = 0, hi = 0, u_lo = INT_MAX, u_hi = INT_MIN;
#pragma unroll
  for (int r = 0; r < kCluster; ++r) {
    const int tr = row_begin + group * kCluster + r;
    int a = 0, b = 0;
    if (tr < row_end) {
      a = max(__ldg(ks + tr), 0);
      b = min(__ldg(ke + tr), num_keys);
    }
    if (a < b) u_lo = min(u_lo, a), u_hi = max(u_hi, b);
    if (r == rank) lo = a, hi = b;
  }
  const int num_tiles = u_lo < u_hi ? (u_hi - u_lo + kBlockKV - 1) / kBlockKV : 0;
  const bool has_own = lo < hi;
  const int own_first = has_own ? (lo - u_lo) / kBlockKV : 0;
  const int own_end = has_own ? (hi - 1 - u_lo) / kBlockKV + 1 : 0;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full(s), 1);
      ptx::mbar_init(empty(s), L::kMathWarps * kCluster);
    }
#pragma unroll
    for (int r = 0; r < L::kRedStages; ++r) {
      ptx::mbar_init(red_full(r), L::kMathWarps);
      ptx::mbar_init(red_empty(r), L::kReducerThreads / 32);
    }
    ptx::fence_mbar_init();
  }
  if (warp == 0 && lane == 0) ptx::prefetch_tensor_map(&tmap_k);
  // Every CTA's barriers are initialised before any CTA of the cluster signals them.
  if constexpr (kCluster > 1) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }

  if (warp < 4) {
    // ===================================================================== producer / reducer
    ptx::reg_dealloc<L::kProducerRegs>();
    if (warp == 0) {
      if (lane == 0) {
        for (int j = 0; j < num_tiles; ++j) {
          const int s = j % kStages;
          const uint32_t ph = static_cast<uint32_t>(j / kStages) & 1u;
          if constexpr (kCluster > 1) {
            ptx::mbar_wait_cluster(empty(s), ph ^ 1u);
          } else {
            ptx::mbar_wait(empty(s), ph ^ 1u);
          }
          ptx::mbar_arrive_expect_tx(full(s), kStageBytes);
          const int key0 = u_lo + j * kBlockKV + rank * kBoxRows;
          uint8_t* dst = smem + lay.offset_stage(s) + rank * kBoxRows * L::kSwizzleBytes;
#pragma unroll
          for (int b = 0; b < lay.num_kblocks(); ++b) {
            if constexpr (kCluster > 1) {
              ptx::tma_load_2d_multicast(dst + b * lay.block_bytes(), &tmap_k, full(s), b * 64, key0,
                                         static_cast<uint16_t>((1u << kCluster) - 1u));
            } else {
              ptx::tma_load_2d(dst + b * lay.block_bytes(), &tmap_k, full(s), b * 64, key0);
            }
          }
        }
      }
    } else if (warp <= 2 && !kLse) {
      // Reducer: key column c of every own tile.
      const int c = static_cast<int>(threadIdx.x) - 32;
      float plogp = 0.0f, mass = 0.0f;
      float* prow = p_out + static_cast<int64_t>(t - row_begin) * p_stride;
      for (int j = own_first, n = 0; j < own_end; ++j, ++n) {
        const int r = n % L::kRedStages;
        ptx::mbar_wait(red_full(r), static_cast<uint32_t>(n / L::kRedStages) & 1u);
        const float* part = red(r);
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < L::kMathWarps; ++w) sum += part[w * kBlockKV + c];
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(red_empty(r));
        const int key = u_lo + j * kBlockKV + c;
        if (key >= lo && key < hi) {
          const float p = sum * inv_heads;
          prow[key] = p;
          if (p > 0.0f) plogp = fmaf(p, logf(p), plogp);
          mass += p;
        }
      }
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) {
        plogp += __shfl_xor_sync(0xffffffffu, plogp, m);
        mass += __shfl_xor_sync(0xffffffffu, mass, m);
      }
      float2* scratch = reinterpret_cast<float2*>(smem + lay.offset_scratch());
      if (warp == 2 && lane == 0) scratch[0] = make_float2(plogp, mass);
      ptx::named_barrier_sync(L::kBarReducer, L::kReducerThreads);
      if (warp == 1 && lane == 0 && t < row_end) {
        if (plogp_out != nullptr) plogp_out[t] = plogp + scratch[0].x;
        if (mass_out != nullptr) mass_out[t] = mass + scratch[0].y;
      }
    }
    __syncwarp();
    if constexpr (kCluster > 1) ptx::cluster_sync();  // the peer may still signal this CTA's barriers
  } else {
    // ===================================================================== math
    ptx::reg_alloc<L::kMathRegs>();
    const int wg = static_cast<int>(warp / 4) - 1;  // heads [64 wg, 64 wg + 64)
    const int wi = static_cast<int>(warp % 4);
    constexpr float kLog2e = 1.4426950408889634f;

    uint32_t a[kKSteps][4];
    float lse2[2] = {0.0f, 0.0f};
    if (has_own) {
      const long long head0 = static_cast<long long>(t) * L::kNumHeads + 64 * wg;
      training_detail::load_a_fragments<kHeadDim>(a, q, head0, head0 + 64, wi, static_cast<int>(lane));
      const int h = 64 * wg + 16 * wi + static_cast<int>(lane / 4);
      if constexpr (!kLse) {
        lse2[0] = __ldg(lse + static_cast<long long>(t) * L::kNumHeads + h) * kLog2e;
        lse2[1] = __ldg(lse + static_cast<long long>(t) * L::kNumHeads + h + 8) * kLog2e;
      }
      // Warpgroup 0 issues first.
      if (wg == 1) ptx::named_barrier_arrive(L::kBarSchedule0, 256);
    }
    const uint32_t peer = static_cast<uint32_t>(rank ^ 1);
    float acc[Mma::kNumAccum];
#pragma unroll
    for (int i = 0; i < Mma::kNumAccum; ++i) acc[i] = 0.0f;
    float run_m[2] = {-INFINITY, -INFINITY}, run_l[2] = {0.0f, 0.0f};  // kLse: log2-domain max, sum of exp2
    const int quad = static_cast<int>(lane & 3);
    for (int j = 0, n = 0; j < num_tiles; ++j) {
      const int s = j % kStages;
      ptx::mbar_wait(full(s), static_cast<uint32_t>(j / kStages) & 1u);
      const bool own = j >= own_first && j < own_end;
      if (own) {
        ptx::named_barrier_sync(L::kBarSchedule0 + wg, 256);
        ptx::wgmma_fence();
        const uint8_t* stage = smem + lay.offset_stage(s);
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
          // K step kk: column block kk / 4, + 32 B per step inside it (+2 in descriptor units)
          const uint64_t desc =
              ptx::make_kmajor_desc<L::kSwizzleBytes>(stage + (kk / 4) * lay.block_bytes()) + 2 * (kk % 4);
          Mma::mma(acc, a[kk], desc, kk > 0);
        }
        ptx::wgmma_commit();
        ptx::named_barrier_arrive(L::kBarSchedule0 + (wg ^ 1), 256);
        ptx::wgmma_wait<0>();
        ptx::fence_accum<Mma::kNumAccum>(acc);
      }
      // The tile is in every CTA of the cluster: release it everywhere.
      __syncwarp();
      if (lane == 0) {
        if constexpr (kCluster > 1) {
          ptx::mbar_arrive_cluster(empty(s), static_cast<uint32_t>(rank));
          ptx::mbar_arrive_cluster(empty(s), peer);
        } else {
          ptx::mbar_arrive(empty(s));
        }
      }
      if (kLse && own) {
        // Online log-sum-exp of the rows 16 wi + lane / 4 + 8 i over the tile's valid keys (the quad's lanes hold
        // all 64 columns, so the quad's max is the tile's).
        const int key_base = u_lo + j * kBlockKV + 2 * quad;
#pragma unroll
        for (int g = 0; g < 8; ++g)
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int key = key_base + 8 * g + c;
              acc[4 * g + 2 * i + c] = key >= lo && key < hi ? acc[4 * g + 2 * i + c] * scale_log2 : -INFINITY;
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float mx = -INFINITY;
#pragma unroll
          for (int g = 0; g < 8; ++g) mx = fmaxf(mx, fmaxf(acc[4 * g + 2 * i], acc[4 * g + 2 * i + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(run_m[i], mx);  // finite: an own tile has a valid key
          float sum = 0.0f;
#pragma unroll
          for (int g = 0; g < 8; ++g)
            sum += ptx::ex2_approx(acc[4 * g + 2 * i] - m_new) + ptx::ex2_approx(acc[4 * g + 2 * i + 1] - m_new);
          run_l[i] = run_l[i] * ptx::ex2_approx(run_m[i] - m_new) + sum;
          run_m[i] = m_new;
        }
      } else if (own) {
        // acc[4 g + 2 i + c]: head row 16 wi + lane / 4 + 8 i, key column 8 g + 2 quad + c.
        float v[16];
#pragma unroll
        for (int g = 0; g < 8; ++g) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float e0 = ptx::ex2_approx(fmaf(acc[4 * g + c], scale_log2, -lse2[0]));
            const float e1 = ptx::ex2_approx(fmaf(acc[4 * g + 2 + c], scale_log2, -lse2[1]));
            v[2 * g + c] = e0 + e1;
          }
        }
        // Sum over the warp's 8 row groups (lane bits 2..4): lane l ends with columns 2 l, 2 l + 1.
        float v8[8], v4[4], v2[2];
        ptx::reduce_scatter_step<16, 3, 16>(v, v8, (lane & 16) != 0);
        ptx::reduce_scatter_step<8, 2, 8>(v8, v4, (lane & 8) != 0);
        ptx::reduce_scatter_step<4, 1, 4>(v4, v2, (lane & 4) != 0);
        const int r = n % L::kRedStages;
        ptx::mbar_wait(red_empty(r), (static_cast<uint32_t>(n / L::kRedStages) & 1u) ^ 1u);
        reinterpret_cast<float2*>(red(r) + (4 * wg + wi) * kBlockKV)[lane] = make_float2(v2[0], v2[1]);
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(red_full(r));
        ++n;
      }
    }
    // Balance the schedule barrier: warpgroup 1's last arrival on warpgroup 0's barrier.
    if (has_own && wg == 0) ptx::named_barrier_sync(L::kBarSchedule0, 256);
    if constexpr (kLse) {
      constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        run_l[i] += __shfl_xor_sync(0xffffffffu, run_l[i], 1);
        run_l[i] += __shfl_xor_sync(0xffffffffu, run_l[i], 2);
      }
      if (quad == 0 && t < row_end) {
        const long long h = static_cast<long long>(t) * L::kNumHeads + 64 * wg + 16 * wi + lane / 4;
#pragma unroll
        for (int i = 0; i < 2; ++i) lse_out[h + 8 * i] = has_own ? (run_m[i] + log2f(run_l[i])) * kLn2 : -INFINITY;
      }
    }
    __syncwarp();
    if constexpr (kCluster > 1) ptx::cluster_sync();
  }
#else
  asm volatile("trap;");
#endif
}

}  // namespace deep_indexer
