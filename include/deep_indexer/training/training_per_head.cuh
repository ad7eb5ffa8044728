// Training: the `per_head` target of the warm-up KL loss on SM90 (bf16 WGMMA, fp32 accumulation). Per
// (row t, head h) over the row's keys lo[t] <= s < hi[t] (log2 units: x2 = x log2 e):
//   P[s]   = exp2(scale_log2 q[t, h] . k[s, h / heads_per_kv] - lse2[t, h])        (the attention's softmax)
//   I2[s]  = wl[t, h] relu(q_I[t, h] . k_I[s])                                      (wl = w log2 e)
//   forward:  kl = ln2 (sum P a2 - sum P I2 + mass lseI2), lse_I = ln2 lseI2 (lseI2 = log2 sum exp2 I2, an
//             online max / sum), mass = sum P                                         (a2: P's exponent)
//   backward: dI = gm exp2(I2 - lseI2) - gq P   (gq = g[t] / total_heads, gm = gq mass[t, h]),
//             dw[t, h] = sum_s dI relu(S), dS = dI w [S > 0] (bf16), dq_I[t, h] = sum_s dS k_I[s],
//             dk_I[s] = sum_(t, h) dS q_I[t, h]
// The row-major kernel reads the rows' bounds and values from the caller's tensors and reduces its row tiles'
// key hulls itself; its backward form also writes them (RowInfo [H, t_pad], zeros past T; the tiles' hulls; per
// key block the hull of the row tiles meeting it) for the key-major kernel that runs next. No float atomics:
// every output element is written by one thread (dk_I per head group into a partial buffer summed in a fixed
// order); the key-block hulls are integer atomicMin / atomicMax (order-independent).
//
// Structure, shared memory, registers: training_per_head_layout.hpp. Accumulator layout (m64n64):
// acc[4 gg + 2 i + c] is (row 16 warp + lane / 4 + 8 i, column 8 gg + 2 quad + c).
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>
#include <type_traits>

#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/training/training_indexer_bwd.cuh>
#include <deep_indexer/training/training_per_head_layout.hpp>
#include <deep_indexer/common/wgmma_bf16.cuh>

namespace deep_indexer {

namespace per_head_detail {

constexpr float kLn2 = 0.6931471805599453f;

struct DkHeader {
  int head_slot;  // head index within the group (-1 ends the stream)
  int row_tile;
  int full;       // every (key, row) pair of the item is valid: no masks
  int pad;
};
static_assert(sizeof(DkHeader) == TrainingPerHeadLayout::kHeaderBytes, "header size");

// acc = A (64 x kDim, shared memory, K-major) x tile^T (tile rows = acc's columns, K-major).
template <int kDim>
DI_DEVICE void mma_ss(float (&acc)[32], const uint8_t* a_tile, const uint8_t* b_tile) {
  constexpr int kBlock = TrainingPerHeadLayout::kTileRows * TrainingPerHeadLayout::kSwizzleBytes;
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    const uint64_t da = ptx::make_kmajor_desc<TrainingPerHeadLayout::kSwizzleBytes>(a_tile + (kk / 4) * kBlock) + 2 * (kk % 4);
    const uint64_t db = ptx::make_kmajor_desc<TrainingPerHeadLayout::kSwizzleBytes>(b_tile + (kk / 4) * kBlock) + 2 * (kk % 4);
    ptx::WgmmaBf16<64>::mma(acc, da, db, kk > 0);
  }
  ptx::wgmma_commit();
}

// acc += dS x tile, dS the per-element values `x` (acc's layout) rounded to bf16 as the A fragments (K = x's
// columns = the tile's rows, MN-major); waits for the WGMMA.
template <int kDim>
DI_DEVICE void mma_ds(float (&acc)[kDim / 2], const float (&x)[32], const uint8_t* tile) {
  uint32_t ds[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int gg = 2 * kk + j / 2, i = j % 2;
      ds[kk][j] = ptx::pack_bf16x2(x[4 * gg + 2 * i], x[4 * gg + 2 * i + 1]);
    }
  training_detail::mma_g<kDim>(acc, ds, tile);
  ptx::wgmma_wait<0>();
  ptx::fence_accum<kDim / 2>(acc);
}

}  // namespace per_head_detail

namespace per_head_detail {

DI_DEVICE RowInfo row_info(const PerHeadRowsArgs& a, int t, int h, int num_rows, int num_heads, int num_keys,
                           bool bwd) {
  constexpr float kLog2e = 1.4426950408889634f;
  RowInfo r{0.0f, 0.0f, 0.0f, 0.0f, 0, 0, 0.0f, 0.0f};
  if (t >= num_rows) return r;
  const int lo = min(max(__ldg(a.ks + t), 0), num_keys), hi = min(max(__ldg(a.ke + t), 0), num_keys);
  if (lo < hi) r.lo = lo, r.hi = hi;
  const int64_t o = static_cast<int64_t>(t) * num_heads + h;
  const float lse = __ldg(a.lse + o), w = __ldg(a.w + o);
  r.lse2 = isfinite(lse) ? lse * kLog2e : 0.0f;
  r.wl = w * kLog2e;
  if (bwd) {
    const float li = __ldg(a.lse_i + o), mass = __ldg(a.mass + o);
    r.lsei2 = (isfinite(li) ? li * kLog2e : 0.0f) - (mass > 0.0f ? log2f(mass) : -INFINITY);
    r.gq = __ldg(a.g + t);
    r.gqw = r.gq * w;
  }
  return r;
}

}  // namespace per_head_detail

// Row-major: CTA (row pair rp, head h) with rp counted from the last (the longest rows under causal bounds).
// kBwd = false: out_a = kl [T, H], out_b = lse_I [T, H], out_c = mass [T, H].
// kBwd = true:  out_a = dq_I [T, H, D_I] (fp32), out_b = dw [T, H]; and `bo` (PerHeadBwdOut).
template <int kQkDim, int kHeadDim, bool kBwd>
__global__ void __launch_bounds__(TrainingPerHeadLayout::kThreads, 1)
    training_per_head_rows_kernel(const __grid_constant__ CUtensorMap tmap_k, const __grid_constant__ CUtensorMap tmap_ki,
                                  const PerHeadRowsArgs args, const PerHeadBwdOut bo, float* __restrict__ out_a,
                                  float* __restrict__ out_b, float* __restrict__ out_c, int num_rows, int num_heads,
                                  int heads_per_kv, int num_keys, int t_pad, float scale_log2) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = TrainingPerHeadLayout;
  constexpr L lay{kQkDim, kHeadDim};
  static_assert(lay.valid(), "unsupported training_per_head configuration");
  constexpr int kStages = lay.rows_stages();
  constexpr int kTile = L::kTileRows;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((L::kAlign - (ptx::smem_addr(smem_raw) & (L::kAlign - 1))) & (L::kAlign - 1));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + lay.rows_offset_barriers());
  uint64_t* empty = full + kStages;
  int* hull = reinterpret_cast<int*>(empty + kStages);  // [4 warps][lo, hi]

  const uint32_t warp = ptx::warp_idx();
  const uint32_t lane = ptx::lane_idx();
  const int h = static_cast<int>(blockIdx.x) % num_heads;
  const int rp = t_pad / L::kRowsPerCta - 1 - static_cast<int>(blockIdx.x) / num_heads;

  // The two row tiles' hulls: warps 0..3 reduce 32 rows each (an empty row counts as [INT_MAX, INT_MIN)).
  if (warp < 4) {
    const int t = L::kRowsPerCta * rp + static_cast<int>(threadIdx.x);
    int lo = INT_MAX, hi = INT_MIN;
    if (t < num_rows) {
      const int a = min(max(__ldg(args.ks + t), 0), num_keys), b = min(max(__ldg(args.ke + t), 0), num_keys);
      if (a < b) lo = a, hi = b;
    }
    const int lo_min = __reduce_min_sync(0xffffffffu, lo), hi_max = __reduce_max_sync(0xffffffffu, hi);
    const int lo_max = __reduce_max_sync(0xffffffffu, lo), hi_min = __reduce_min_sync(0xffffffffu, hi);
    if (lane == 0) hull[4 * warp] = lo_min, hull[4 * warp + 1] = hi_max, hull[4 * warp + 2] = lo_max, hull[4 * warp + 3] = hi_min;
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full + s, 1);
      ptx::mbar_init(empty + s, L::kMathWarps);
    }
    ptx::fence_mbar_init();
  }
  if (warp == 0 && lane == 0) {
    ptx::prefetch_tensor_map(&tmap_k);
    ptx::prefetch_tensor_map(&tmap_ki);
  }
  __syncthreads();
  int lo_w[2], hi_w[2], u_lo = INT_MAX, u_hi = INT_MIN;
#pragma unroll
  for (int w = 0; w < 2; ++w) {  // tile w = warps 2 w, 2 w + 1
    lo_w[w] = min(hull[8 * w], hull[8 * w + 4]);
    hi_w[w] = max(hull[8 * w + 1], hull[8 * w + 5]);
    if (lo_w[w] < hi_w[w]) u_lo = min(u_lo, lo_w[w]), u_hi = max(u_hi, hi_w[w]);
  }
  const int num_tiles = u_lo < u_hi ? (u_hi - u_lo + kTile - 1) / kTile : 0;

  if (warp < 4) {
    // ===================================================================== producer
    ptx::reg_dealloc<L::kProducerRegs>();
    if constexpr (kBwd) {
      // Head 0's CTAs publish their row tiles' hulls: the tiles (thread 0) and the key blocks they meet (warps
      // 1, 2: one tile each, lanes over the blocks).
      if (h == 0) {
        if (threadIdx.x == 0)
#pragma unroll
          for (int w = 0; w < 2; ++w) {
            bo.tile_lo[2 * rp + w] = lo_w[w];
            bo.tile_hi[2 * rp + w] = hi_w[w];
            bo.tile_lo_max[2 * rp + w] = max(hull[8 * w + 2], hull[8 * w + 6]);
            bo.tile_hi_min[2 * rp + w] = min(hull[8 * w + 3], hull[8 * w + 7]);
          }
        if (warp == 1 || warp == 2) {
          const int w = static_cast<int>(warp) - 1;
          const int lo = w == 0 ? lo_w[0] : lo_w[1], hi = w == 0 ? hi_w[0] : hi_w[1];
          if (lo < hi)
            for (int kb = lo / L::kKeysPerCta + static_cast<int>(lane); kb <= (hi - 1) / L::kKeysPerCta; kb += 32) {
              atomicMin(bo.kb_first + kb, 2 * rp + w);
              atomicMax(bo.kb_last + kb, 2 * rp + w);
            }
        }
      }
    }
    if (warp == 0 && lane == 0) {
      const int kvh = h / heads_per_kv;
      for (int j = 0; j < num_tiles; ++j) {
        const int s = j % kStages;
        ptx::mbar_wait(empty + s, (static_cast<uint32_t>(j / kStages) & 1u) ^ 1u);
        const int key0 = u_lo + j * kTile;
        uint8_t* st = smem + s * lay.rows_stage_bytes();
        ptx::mbar_arrive_expect_tx(full + s, lay.rows_stage_bytes());
#pragma unroll
        for (int b = 0; b < kQkDim / 64; ++b) ptx::tma_load_3d(st + b * lay.block_bytes(), &tmap_k, full + s, 64 * b, kvh, key0);
#pragma unroll
        for (int b = 0; b < kHeadDim / 64; ++b)
          ptx::tma_load_2d(st + lay.qk_tile_bytes() + b * lay.block_bytes(), &tmap_ki, full + s, 64 * b, key0);
      }
    }
  } else {
    // ===================================================================== math
    ptx::reg_alloc<L::kMathRegs>();
    const int wg = static_cast<int>(warp / 4) - 1;
    const int wi = static_cast<int>(warp % 4);
    const int quad = static_cast<int>(lane & 3);
    const int t_base = kTile * (2 * rp + wg);
    const int my_lo = wg == 0 ? lo_w[0] : lo_w[1], my_hi = wg == 0 ? hi_w[0] : hi_w[1];  // no dynamic indexing
    const bool has_rows = my_lo < my_hi;
    const int own_first = has_rows ? (my_lo - u_lo) / kTile : 0;
    const int own_end = has_rows ? (my_hi - 1 - u_lo) / kTile + 1 : 0;
    const int row0 = 16 * wi + static_cast<int>(lane / 4);  // + 8 i
    uint32_t qa[kQkDim / 16][4], qia[kHeadDim / 16][4];
    RowInfo ri[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int t = t_base + row0 + 8 * i;
      ri[i] = per_head_detail::row_info(args, t, h, num_rows, num_heads, num_keys, kBwd);
      if constexpr (kBwd) {
        if (quad == 0) {
          bo.info[static_cast<int64_t>(h) * t_pad + t] = ri[i];
        }
      }
    }
    if (has_rows) {
      training_detail::load_a_fragments<kQkDim>(qa, static_cast<const __nv_bfloat16*>(args.q) + static_cast<int64_t>(h) * kQkDim, t_base, num_rows, wi,
                                                static_cast<int>(lane), static_cast<long long>(num_heads) * kQkDim);
      training_detail::load_a_fragments<kHeadDim>(qia, static_cast<const __nv_bfloat16*>(args.q_i) + static_cast<int64_t>(h) * kHeadDim, t_base, num_rows,
                                                  wi, static_cast<int>(lane), static_cast<long long>(num_heads) * kHeadDim);
    }
    float sa[32], si[32];
    // forward: online max / sum of I2, sum P a2, sum P I2, sum P; backward: dq_I, dw.
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, spa[2] = {0.0f, 0.0f}, spx[2] = {0.0f, 0.0f},
          sp[2] = {0.0f, 0.0f};
    float dq[kBwd ? kHeadDim / 2 : 1];
#pragma unroll
    for (int i = 0; i < (kBwd ? kHeadDim / 2 : 1); ++i) dq[i] = 0.0f;

    for (int j = 0; j < num_tiles; ++j) {
      const int s = j % kStages;
      ptx::mbar_wait(full + s, static_cast<uint32_t>(j / kStages) & 1u);
      const bool own = j >= own_first && j < own_end;
      const uint8_t* st = smem + s * lay.rows_stage_bytes();
      const uint8_t* ki_tile = st + lay.qk_tile_bytes();
      if (own) {
        training_detail::mma_s<kQkDim>(sa, qa, st);
        training_detail::mma_s<kHeadDim>(si, qia, ki_tile);
        ptx::wgmma_wait<0>();
        ptx::fence_accum<32>(sa);
        ptx::fence_accum<32>(si);
        const int key0 = u_lo + j * kTile + 2 * quad;
        // The epilogue, without masks when the tile lies inside both of this thread's rows' ranges.
        auto epilogue = [&](auto masked_tag) {
          constexpr bool kMasked = decltype(masked_tag)::value;
          if constexpr (!kBwd) {
            float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int gg = 0; gg < 8; ++gg)
#pragma unroll
              for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                  const int idx = 4 * gg + 2 * i + c, key = key0 + 8 * gg + c;
                  const bool valid = !kMasked || (key >= ri[i].lo && key < ri[i].hi);
                  const float a2 = fmaf(sa[idx], scale_log2, -ri[i].lse2);
                  const float p = valid ? ptx::ex2_approx(a2) : 0.0f;
                  const float x2 = fmaxf(si[idx], 0.0f) * ri[i].wl;
                  spa[i] = fmaf(p, a2, spa[i]);
                  spx[i] = fmaf(p, x2, spx[i]);
                  sp[i] += p;
                  si[idx] = valid ? x2 : -INFINITY;
                  mt[i] = fmaxf(mt[i], si[idx]);
                }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const float mn = fmaxf(m[i], mt[i]);
              if (mn != -INFINITY) {
                l[i] *= ptx::ex2_approx(m[i] - mn);
                m[i] = mn;
              }
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const float mu = m[i] == -INFINITY ? 0.0f : m[i];
#pragma unroll
              for (int gg = 0; gg < 8; ++gg)
#pragma unroll
                for (int c = 0; c < 2; ++c) l[i] += ptx::ex2_approx(si[4 * gg + 2 * i + c] - mu);
            }
          } else {
#pragma unroll
            for (int gg = 0; gg < 8; ++gg)
#pragma unroll
              for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                  const int idx = 4 * gg + 2 * i + c, key = key0 + 8 * gg + c;
                  const float p = ptx::ex2_approx(fmaf(sa[idx], scale_log2, -ri[i].lse2));
                  const float r = fmaxf(si[idx], 0.0f);
                  float d = ptx::ex2_approx(fmaf(r, ri[i].wl, -ri[i].lsei2)) - p;  // dI / gq
                  if constexpr (kMasked) d = key >= ri[i].lo && key < ri[i].hi ? d : 0.0f;
                  spx[i] = fmaf(d, r, spx[i]);  // dw / gq
                  si[idx] = si[idx] > 0.0f ? d * ri[i].gqw : 0.0f;
                }
          }
        };
        const int k_first = u_lo + j * kTile;
        if (k_first >= ri[0].lo && k_first + kTile <= ri[0].hi && k_first >= ri[1].lo && k_first + kTile <= ri[1].hi)
          epilogue(std::false_type{});
        else
          epilogue(std::true_type{});
        if constexpr (kBwd) per_head_detail::mma_ds<kHeadDim>(dq, si, ki_tile);
      }
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(empty + s);
    }

    // Quad reductions (a row's 64 columns are spread over the 4 threads of a quad).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        spx[i] += __shfl_xor_sync(0xffffffffu, spx[i], o);
        if constexpr (!kBwd) {
          spa[i] += __shfl_xor_sync(0xffffffffu, spa[i], o);
          sp[i] += __shfl_xor_sync(0xffffffffu, sp[i], o);
        }
      }
      if constexpr (!kBwd) {
        float mm = m[i];
        mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, 1));
        mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, 2));
        float ll = mm == -INFINITY ? 0.0f : l[i] * ptx::ex2_approx(m[i] - mm);
        ll += __shfl_xor_sync(0xffffffffu, ll, 1);
        ll += __shfl_xor_sync(0xffffffffu, ll, 2);
        m[i] = mm;
        l[i] = ll;
      }
    }
    if constexpr (kBwd) {
      if (t_base < num_rows)
        training_detail::store_g<kHeadDim>(out_a + (static_cast<int64_t>(t_base) * num_heads + h) * kHeadDim, dq, wi,
                                           static_cast<int>(lane), min(kTile, num_rows - t_base),
                                           static_cast<int64_t>(num_heads) * kHeadDim);
    }
    if (quad == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int t = t_base + row0 + 8 * i;
        if (t >= num_rows) continue;
        const int64_t o = static_cast<int64_t>(t) * num_heads + h;
        if constexpr (kBwd) {
          out_b[o] = spx[i] * ri[i].gq;
        } else {
          const bool any = l[i] > 0.0f;
          const float lsei2 = any ? m[i] + log2f(l[i]) : -INFINITY;
          out_a[o] = per_head_detail::kLn2 * (spa[i] - spx[i] + (any ? sp[i] * lsei2 : 0.0f));
          out_b[o] = any ? per_head_detail::kLn2 * lsei2 : -INFINITY;
          out_c[o] = sp[i];
        }
      }
    }
  }
#else
  asm volatile("trap;");
#endif
}

// Key-major: CTA (key block kb of 128 keys, head group grp): heads [grp heads_per_group, +heads_per_group),
// row tiles rt in [kb_first[kb], kb_last[kb]] whose hull meets the block. dk_part[grp][key - 0][D_I].
template <int kQkDim, int kHeadDim>
__global__ void __launch_bounds__(TrainingPerHeadLayout::kThreads, 1)
    training_per_head_dk_kernel(const __grid_constant__ CUtensorMap tmap_k, const __grid_constant__ CUtensorMap tmap_q,
                                const __grid_constant__ CUtensorMap tmap_qi, const __nv_bfloat16* __restrict__ k_i,
                                const RowInfo* __restrict__ info, const int* __restrict__ tile_lo,
                                const int* __restrict__ tile_hi, const int* __restrict__ tile_lo_max,
                                const int* __restrict__ tile_hi_min, const int* __restrict__ kb_first,
                                const int* __restrict__ kb_last, float* __restrict__ dk_part, int64_t part_rows,
                                int num_kblocks, int heads_per_group, int num_heads, int heads_per_kv, int num_keys,
                                int t_pad, float scale_log2) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = TrainingPerHeadLayout;
  constexpr L lay{kQkDim, kHeadDim};
  static_assert(lay.valid(), "unsupported training_per_head configuration");
  constexpr int kStages = lay.dk_stages();
  constexpr int kTile = L::kTileRows;
  using Header = per_head_detail::DkHeader;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((L::kAlign - (ptx::smem_addr(smem_raw) & (L::kAlign - 1))) & (L::kAlign - 1));
  Header* headers = reinterpret_cast<Header*>(smem + lay.dk_offset_headers());
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + lay.dk_offset_barriers());
  uint64_t* empty = full + kStages;
  uint64_t* head_full = empty + kStages;  // [2]
  uint64_t* head_empty = head_full + 2;   // [2]

  const uint32_t warp = ptx::warp_idx();
  const uint32_t lane = ptx::lane_idx();
  const int kb = static_cast<int>(blockIdx.x) % num_kblocks;
  const int grp = static_cast<int>(blockIdx.x) / num_kblocks;
  const int s0 = L::kKeysPerCta * kb;
  const int h0 = grp * heads_per_group;
  const int num_group_heads = min(heads_per_group, num_heads - h0);

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full + s, 1);
      ptx::mbar_init(empty + s, L::kMathWarps);
    }
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      ptx::mbar_init(head_full + b, 1);
      ptx::mbar_init(head_empty + b, L::kMathWarps);
    }
    ptx::fence_mbar_init();
  }
  if (warp == 0 && lane == 0) {
    ptx::prefetch_tensor_map(&tmap_k);
    ptx::prefetch_tensor_map(&tmap_q);
    ptx::prefetch_tensor_map(&tmap_qi);
  }
  __syncthreads();

  if (warp < 4) {
    // ===================================================================== producer
    ptx::reg_dealloc<L::kProducerRegs>();
    if (warp == 0 && lane == 0) {
      const int first = __ldg(kb_first + kb), last = __ldg(kb_last + kb);
      int n = 0;
      // NOTES: first and last meet the block (the host's hull), so every head gets >= 1 item and the math
      // warpgroups release each head buffer before the producer needs it again.
      if (first <= last) {
        for (int jh = 0; jh < num_group_heads; ++jh) {
          const int h = h0 + jh, slot = jh & 1;
          ptx::mbar_wait(head_empty + slot, (static_cast<uint32_t>(jh / 2) & 1u) ^ 1u);
          uint8_t* hb = smem + slot * lay.head_buf_bytes();
          ptx::mbar_arrive_expect_tx(head_full + slot, lay.head_buf_bytes());
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int b = 0; b < kQkDim / 64; ++b)
              ptx::tma_load_3d(hb + half * lay.qk_tile_bytes() + b * lay.block_bytes(), &tmap_k, head_full + slot, 64 * b,
                               h / heads_per_kv, s0 + kTile * half);
          for (int rt = first; rt <= last; ++rt) {
            const int tlo = __ldg(tile_lo + rt), thi = __ldg(tile_hi + rt);
            if (!(tlo < thi && tlo < s0 + L::kKeysPerCta && thi > s0)) continue;
            const int s = n % kStages;
            ptx::mbar_wait(empty + s, (static_cast<uint32_t>(n / kStages) & 1u) ^ 1u);
            ++n;
            uint8_t* st = smem + lay.dk_offset_stage(s);
            headers[s].head_slot = jh;
            headers[s].row_tile = rt;
            headers[s].full = __ldg(tile_lo_max + rt) <= s0 && __ldg(tile_hi_min + rt) >= s0 + L::kKeysPerCta;
            ptx::mbar_arrive_expect_tx(full + s, lay.dk_stage_bytes());
#pragma unroll
            for (int b = 0; b < kQkDim / 64; ++b)
              ptx::tma_load_3d(st + b * lay.block_bytes(), &tmap_q, full + s, 64 * b, h, kTile * rt);
#pragma unroll
            for (int b = 0; b < kHeadDim / 64; ++b)
              ptx::tma_load_3d(st + lay.qk_tile_bytes() + b * lay.block_bytes(), &tmap_qi, full + s, 64 * b, h, kTile * rt);
            ptx::bulk_load(st + lay.qk_tile_bytes() + lay.idx_tile_bytes(),
                           info + static_cast<int64_t>(h) * t_pad + static_cast<int64_t>(kTile) * rt, lay.info_bytes(),
                           full + s);
          }
        }
      }
      const int s = n % kStages;
      ptx::mbar_wait(empty + s, (static_cast<uint32_t>(n / kStages) & 1u) ^ 1u);
      headers[s].head_slot = -1;
      ptx::mbar_arrive(full + s);
    }
  } else {
    // ===================================================================== math
    ptx::reg_alloc<L::kMathRegs>();
    const int wg = static_cast<int>(warp / 4) - 1;  // keys [s0 + 64 wg, +64)
    const int wi = static_cast<int>(warp % 4);
    const int quad = static_cast<int>(lane & 3);
    const int key_base = s0 + kTile * wg;
    uint32_t kia[kHeadDim / 16][4];
    training_detail::load_a_fragments<kHeadDim>(kia, k_i, key_base, num_keys, wi, static_cast<int>(lane));
    int key[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) key[i] = key_base + 16 * wi + static_cast<int>(lane / 4) + 8 * i;
    float sa[32], si[32], g[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) g[i] = 0.0f;
    int cur = -1;
    for (int n = 0;; ++n) {
      const int s = n % kStages;
      ptx::mbar_wait(full + s, static_cast<uint32_t>(n / kStages) & 1u);
      const int jh = headers[s].head_slot;
      if (jh < 0) break;
      if (jh != cur) {
        if (cur >= 0) {
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(head_empty + (cur & 1));
        }
        cur = jh;
        ptx::mbar_wait(head_full + (cur & 1), static_cast<uint32_t>(cur / 2) & 1u);
      }
      const uint8_t* st = smem + lay.dk_offset_stage(s);
      const uint8_t* qi_tile = st + lay.qk_tile_bytes();
      const RowInfo* cols = reinterpret_cast<const RowInfo*>(qi_tile + lay.idx_tile_bytes());
      per_head_detail::mma_ss<kQkDim>(sa, smem + (cur & 1) * lay.head_buf_bytes() + wg * lay.qk_tile_bytes(), st);
      training_detail::mma_s<kHeadDim>(si, kia, qi_tile);
      ptx::wgmma_wait<0>();
      ptx::fence_accum<32>(sa);
      ptx::fence_accum<32>(si);
      // The rows' values of this thread's 16 columns (one 16-byte load each; the ranges only on masked items).
      auto epilogue = [&](auto masked_tag) {
        constexpr bool kMasked = decltype(masked_tag)::value;
#pragma unroll
        for (int gg = 0; gg < 8; ++gg)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const RowInfo* col = cols + 8 * gg + 2 * quad + c;
            const float4 v = *reinterpret_cast<const float4*>(col);  // lse2, lsei2, wl, gqw
            int2 range = make_int2(0, 0);
            if constexpr (kMasked) range = *reinterpret_cast<const int2*>(&col->lo);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int idx = 4 * gg + 2 * i + c;
              const float p = ptx::ex2_approx(fmaf(sa[idx], scale_log2, -v.x));
              const float r = fmaxf(si[idx], 0.0f);
              float d = ptx::ex2_approx(fmaf(r, v.z, -v.y)) - p;
              if constexpr (kMasked) d = key[i] >= range.x && key[i] < range.y ? d : 0.0f;
              si[idx] = si[idx] > 0.0f ? d * v.w : 0.0f;
            }
          }
      };
      if (headers[s].full)
        epilogue(std::false_type{});
      else
        epilogue(std::true_type{});
      per_head_detail::mma_ds<kHeadDim>(g, si, qi_tile);
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(empty + s);
    }
    const int valid_rows = min(kTile, num_keys - key_base);
    if (valid_rows > 0)
      training_detail::store_g<kHeadDim>(dk_part + (static_cast<int64_t>(grp) * part_rows + key_base) * kHeadDim, g, wi,
                                         static_cast<int>(lane), valid_rows);
  }
#else
  asm volatile("trap;");
#endif
}

}  // namespace deep_indexer
