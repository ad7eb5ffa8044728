// Training: backward of the bf16 indexer logits I[t, s] = sum_h w[t, h] relu(q_I[t, h, :] . k_I[s, :])
// (H_I = 64, D_I = 64 or 128) for dI = dL/dI, on SM90 (bf16 WGMMA, fp32 accumulation):
//   dS[t, h, s] = dI[t, s] w[t, h] [S > 0],   dq_I[t] = sum_s dS k_I[s],   dk_I[s] = sum_t,h dS q_I[t, h],
//   dw[t, h] = sum_s dI[t, s] relu(S[t, h, s])
// over each row's valid keys max(ks[t], 0) <= s < min(ke[t], N). Deterministic: every output element is
// summed by one thread in a fixed order (dk_I per row range into a partial buffer, summed by the host).
//
// training_indexer_dk_kernel<D, kLoss>: CTA (key block kb, row split) owns keys [key_begin + 128 kb, +128)
// and rows [row_begin + split * rows_per_split, +rows_per_split) ∩ [.., row_end). dI comes from
//   kLoss = false: dI[t, s] = vals[(t - vals_row0) * vals_stride + s] (the incoming gradient);
//   kLoss = true:  the warm-up loss, dI = g[t] (mass[t] exp(I[t, s] - lse_i[t]) - p[t, s]) with
//                  p = vals[...], I recomputed here (the head sum of the accumulator rows); dI is written
//                  to di_out[(t - vals_row0) * di_stride + s] for the dq kernel.
// Writes dk_part[(split * part_rows + s - key_begin) * D + d] for every key of its block below N; with kMask
// also the signs of S of every (row, 64-key tile) it computes: mask_out[(t - mask_row0) * mask_stride +
// 128 tile + word] (training_indexer_bwd_layout.hpp).
// training_indexer_dq_kernel<D>: CTA owns rows row_begin + 2 pair + {0, 1}; dI[t, s] =
// di[(t - di_row0) * di_stride + s]; writes dq_out[t] (fp32 [64, D]) and dw_out[t] (fp32 [64]) of its rows.
// training_indexer_dq_masked_kernel<D, kBf16Out>: CTA owns rows row_begin + 4 quad + {0..3}, keys clamped to
// the dk call's [mask_key0, mask_key1); the signs from `mask`, G' = sum_s bf16(dI) [S > 0] k_I[s] per row
// (fp32), then dq_out[t] = w[t, h] G'[h] (fp32 or bf16) and dw_out[t, h] = q_I[t, h] . G'[h]
// (= sum_s dI relu(S) up to dI's bf16 rounding).
//
// Structure and shared memory: training_indexer_bwd_layout.hpp. The producer streams items (a row's q_I
// tile, or a 64-key tile of k_I) through a ring of stages; the dk kernel ends its stream with an item
// whose header says -1. Layouts: S's accumulator acc[4 g + 2 i + c] is (row 16 warp + lane / 4 + 8 i,
// column 8 g + 2 quad + c); the dS fragments for the second WGMMA are pairs of consecutive accumulators
// (the A-fragment layout of m64k16 over S's columns).
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <cuda.h>
#include <cuda_bf16.h>

#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/training/training_indexer_bwd_layout.hpp>
#include <deep_indexer/training/training_target.cuh>
#include <deep_indexer/common/wgmma_bf16_rs.cuh>

namespace deep_indexer {

namespace training_detail {

struct BwdInfoHeader {
  int item;  // row t (dk kernel; -1 ends the stream) or the tile's first key (dq kernel)
  int lo, hi;
  float g, mass, lse;
  int pad[2];
};
static_assert(sizeof(BwdInfoHeader) == TrainingIndexerBwdLayout::kInfoHeaderBytes, "info header size");

// Both backward kernels' shared memory: the dynamic buffer aligned to kAlign, the stages' barriers
// and row / tile information (a header, then floats).
template <int kHeadDim>
struct BwdSmem {
  using L = TrainingIndexerBwdLayout;
  static constexpr L lay() { return L{kHeadDim}; }
  uint8_t* base;
  DI_DEVICE explicit BwdSmem(uint8_t* raw)
      : base(raw + ((L::kAlign - (ptx::smem_addr(raw) & (L::kAlign - 1))) & (L::kAlign - 1))) {}
  DI_DEVICE uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + lay().offset_full(s)); }
  DI_DEVICE uint64_t* empty(int s) const { return reinterpret_cast<uint64_t*>(base + lay().offset_empty(s)); }
  DI_DEVICE BwdInfoHeader* info(int s) const { return reinterpret_cast<BwdInfoHeader*>(base + lay().offset_info(s)); }
  DI_DEVICE float* info_f(int s) const {
    return reinterpret_cast<float*>(base + lay().offset_info(s) + L::kInfoHeaderBytes);
  }
  DI_DEVICE const uint8_t* tile(int n) const { return base + lay().offset_tile(n % lay().num_stages()); }

  // The stage ring: full[s] takes the producer warp's 32 arrivals + the tile's bytes, empty[s] one arrival
  // per math warp; item n uses stage n % stages in phase (n / stages) & 1. Ends with __syncthreads().
  DI_DEVICE void init(const CUtensorMap* tmap) const {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < lay().num_stages(); ++s) {
        ptx::mbar_init(full(s), 32);
        ptx::mbar_init(empty(s), L::kMathWarps);
      }
      ptx::fence_mbar_init();
      ptx::prefetch_tensor_map(tmap);
    }
    __syncthreads();
  }
  DI_DEVICE void wait_full(int n) const {
    ptx::mbar_wait(full(n % lay().num_stages()), static_cast<uint32_t>(n / lay().num_stages()) & 1u);
  }
  DI_DEVICE void wait_empty(int n) const {
    ptx::mbar_wait(empty(n % lay().num_stages()), (static_cast<uint32_t>(n / lay().num_stages()) & 1u) ^ 1u);
  }
  // A math warp is done with item n's stage.
  DI_DEVICE void release(int n, uint32_t lane) const {
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(empty(n % lay().num_stages()));
  }
};

// Rows t_first + r (r < kRows) below row_end: each row's keys [max(ks, key_lo), min(ke, key_hi)) (0, 0 for a
// row past row_end) and their union [u_lo, u_hi) (u_lo >= u_hi when no row has a key).
template <int kRows>
DI_DEVICE void row_bounds(const int* __restrict__ ks, const int* __restrict__ ke, int t_first, int row_end, int key_lo,
                          int key_hi, int (&lo)[kRows], int (&hi)[kRows], int& u_lo, int& u_hi) {
  u_lo = INT_MAX, u_hi = INT_MIN;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int t = t_first + r;
    lo[r] = t < row_end ? max(__ldg(ks + t), key_lo) : 0;
    hi[r] = t < row_end ? min(__ldg(ke + t), key_hi) : 0;
    if (lo[r] < hi[r]) u_lo = min(u_lo, lo[r]), u_hi = max(u_hi, hi[r]);
  }
}

// S = a x tile^T: tile rows are S's columns (K-major, 128-byte swizzle, D / 64 blocks).
template <int kDim>
DI_DEVICE void mma_s(float (&acc)[32], const uint32_t (&a)[kDim / 16][4], const uint8_t* tile) {
  using Mma = ptx::WgmmaBf16RS<64, false>;
  constexpr TrainingIndexerBwdLayout L{kDim};
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    const uint64_t desc =
        ptx::make_kmajor_desc<TrainingIndexerBwdLayout::kSwizzleBytes>(tile + (kk / 4) * L.mn_block_bytes()) + 2 * (kk % 4);
    Mma::mma(acc, a[kk], desc, kk > 0);
  }
  ptx::wgmma_commit();
}

// G += ds x tile: ds [64 x 64 tile rows] (4 K steps), tile rows are K, its D columns N (MN-major).
template <int kDim>
DI_DEVICE void mma_g(float (&g)[kDim / 2], const uint32_t (&ds)[4][4], const uint8_t* tile) {
  using Mma = ptx::WgmmaBf16RS<kDim, true>;
  constexpr TrainingIndexerBwdLayout L{kDim};
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t desc = ptx::make_mn_major_desc_sw128(tile + kk * 2048, L.mn_block_bytes());
    Mma::mma(g, ds[kk], desc, true);
  }
  ptx::wgmma_commit();
}

// Stores G (64 rows x D, fp32) of one warpgroup: row 16 warp + lane / 4 + 8 i of `dst` (rows `row_stride` apart).
template <int kDim>
DI_DEVICE void store_g(float* dst, const float (&g)[kDim / 2], int warp_in_wg, int lane, int valid_rows,
                       int64_t row_stride = kDim) {
  const int quad = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = 16 * warp_in_wg + lane / 4 + 8 * i;
    if (row >= valid_rows) continue;
#pragma unroll
    for (int gg = 0; gg < kDim / 8; ++gg)
      *reinterpret_cast<float2*>(dst + static_cast<int64_t>(row) * row_stride + 8 * gg + 2 * quad) =
          make_float2(g[4 * gg + 2 * i], g[4 * gg + 2 * i + 1]);
  }
}

// 0xffff in each half whose value (x0 low, x1 high) is > 0 (compared after rounding to bf16).
DI_DEVICE uint32_t positive_halves(float x0, float x1) {
  const uint32_t x = ptx::pack_bf16x2(x0, x1);
  return __hgt2_mask(*reinterpret_cast<const __nv_bfloat162*>(&x), __nv_bfloat162(__float2bfloat16(0.0f), __float2bfloat16(0.0f)));
}

// NOTES: the sign mask's bit layout. The dk thread's S element acc[4 g + 2 i + c] (key row 16 warp + lane / 4
// + 8 i, head 8 g + 2 quad + c) is bit 16 c + 8 (g % 2) + 2 (g / 2) + i of its word. The masked dq thread
// (warp w, lane l) needs, from a word, the heads 16 w + l / 4 + 8 r (r = 0, 1; so g = 2 w + r, c = (l / 4) % 2)
// for both i: bits p + 8 r with p = 16 c + 2 w + i, which one rotation brings to bits 7 and 15 (the sign
// bits of bytes 0 and 1, expanded by PRMT). The dk side takes the pair (c = 0, 1) of each (g, i) with one AND.
DI_DEVICE constexpr uint32_t mask_bits(int g, int i) {
  return (1u << (8 * (g % 2) + 2 * (g / 2) + i)) | (1u << (16 + 8 * (g % 2) + 2 * (g / 2) + i));
}

}  // namespace training_detail

template <int kHeadDim, bool kLoss, bool kMask>
__global__ void __launch_bounds__(TrainingIndexerBwdLayout::kThreads, 1)
    training_indexer_dk_kernel(const __grid_constant__ CUtensorMap tmap_q, const __nv_bfloat16* __restrict__ k_i,
                               const float* __restrict__ w, const int* __restrict__ ks, const int* __restrict__ ke,
                               const float* __restrict__ vals, int64_t vals_stride, int vals_row0,
                               const float* __restrict__ g_in, const float* __restrict__ mass_in,
                               const float* __restrict__ lse_in, float* __restrict__ di_out, int64_t di_stride,
                               float* __restrict__ dk_part, int64_t part_rows, uint32_t* __restrict__ mask_out,
                               int64_t mask_stride, int mask_row0, int row_begin, int row_end, int rows_per_split,
                               int key_begin, int num_kblocks, int num_keys) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = TrainingIndexerBwdLayout;
  constexpr L lay{kHeadDim};
  static_assert(lay.valid(), "unsupported training_indexer_bwd configuration");
  constexpr int kStages = lay.num_stages();
  constexpr int H = L::kNumHeads;
  using Info = training_detail::BwdInfoHeader;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const training_detail::BwdSmem<kHeadDim> sm{smem_raw};
  uint8_t* smem = sm.base;

  const uint32_t warp = ptx::warp_idx();
  const uint32_t lane = ptx::lane_idx();
  const int kb = static_cast<int>(blockIdx.x) % num_kblocks;
  // NOTES: the last row range first: under causal bounds its CTAs carry the most rows (largest first
  // shortens the tail of the dynamic CTA schedule).
  const int split = static_cast<int>(gridDim.x) / num_kblocks - 1 - static_cast<int>(blockIdx.x) / num_kblocks;
  const int s0 = key_begin + L::kKeysPerCta * kb;
  const int r_begin = row_begin + split * rows_per_split;
  const int r_end = min(row_end, r_begin + rows_per_split);

  sm.init(&tmap_q);

  if (warp < 4) {
    // ===================================================================== producer
    ptx::reg_dealloc<L::kProducerRegs>();
    // NOTES: the 4 producer warps take the items round-robin (item n: warp n % 4), so up to 4 items'
    // loads (weights, values, TMA) are in flight; one warp alone took an L2 round trip per item, longer
    // than the math warpgroups' work on it. Every warp scans every row (32 rows' bounds per load, a ballot
    // of those that meet the CTA's keys) to number the items alike.
    const int pw = static_cast<int>(warp);
    int n = 0;
    for (int r0 = r_begin; r0 < r_end; r0 += 32) {
      const int tl = r0 + static_cast<int>(lane);
      int lo_l = 0, hi_l = 0;
      if (tl < r_end) lo_l = max(__ldg(ks + tl), 0), hi_l = min(__ldg(ke + tl), num_keys);
      uint32_t mask = __ballot_sync(0xffffffffu, lo_l < hi_l && lo_l < s0 + L::kKeysPerCta && hi_l > s0);
      while (mask != 0u) {  // warp-uniform
        const int b = __ffs(mask) - 1;
        mask &= mask - 1u;
        const int lo = __shfl_sync(0xffffffffu, lo_l, b), hi = __shfl_sync(0xffffffffu, hi_l, b);
        if (n % L::kProducerWarps == pw) {
          const int t = r0 + b;
          const int s = n % kStages;
          sm.wait_empty(n);
          float* f = sm.info_f(s);
          const float2 wv = __ldg(reinterpret_cast<const float2*>(w + static_cast<int64_t>(t) * H) + lane);
          reinterpret_cast<float2*>(f)[lane] = wv;
          const float* vrow = vals + static_cast<int64_t>(t - vals_row0) * vals_stride;
#pragma unroll
          for (int c4 = 0; c4 < 4; ++c4) {
            const int c = 32 * c4 + static_cast<int>(lane);
            const int key = s0 + c;
            f[64 + c] = key >= lo && key < hi ? __ldg(vrow + key) : 0.0f;
          }
          if (lane == 0) {
            Info* hd = sm.info(s);
            hd->item = t;
            hd->lo = lo;
            hd->hi = hi;
            if constexpr (kLoss) {
              hd->g = __ldg(g_in + t);
              hd->mass = __ldg(mass_in + t);
              hd->lse = __ldg(lse_in + t);
            }
            ptx::mbar_arrive_expect_tx(sm.full(s), lay.tile_bytes());
#pragma unroll
            for (int kb2 = 0; kb2 < lay.num_kblocks(); ++kb2)
              ptx::tma_load_2d(smem + lay.offset_tile(s) + kb2 * lay.mn_block_bytes(), &tmap_q, sm.full(s), 64 * kb2,
                               t * H);
          } else {
            ptx::mbar_arrive(sm.full(s));
          }
        }
        ++n;
      }
    }
    if (n % L::kProducerWarps == pw) {  // the end of the stream
      const int s = n % kStages;
      sm.wait_empty(n);
      if (lane == 0) sm.info(s)->item = -1;
      ptx::mbar_arrive(sm.full(s));
    }
  } else {
    // ===================================================================== math
    ptx::reg_alloc<L::kMathRegs>();
    const int wg = static_cast<int>(warp / 4) - 1;  // keys [s0 + 64 wg, +64)
    const int wi = static_cast<int>(warp % 4);
    const int quad = static_cast<int>(lane & 3);
    const int key_base = s0 + 64 * wg;
    uint32_t a[kHeadDim / 16][4];
    training_detail::load_a_fragments<kHeadDim>(a, k_i, key_base, num_keys, wi, static_cast<int>(lane));
    const int row0 = 16 * wi + static_cast<int>(lane / 4);  // + 8 i: key key_base + row
    float g[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) g[i] = 0.0f;

    // Item n's stage: its header (item -1 ends the stream).
    auto wait_item = [&](int n, Info& hd) {
      sm.wait_full(n);
      hd = *sm.info(n % kStages);
    };
    auto tile_of = [&](int n) { return sm.tile(n); };
    auto release = [&](int n) { sm.release(n, lane); };
    // The signs of S for the masked dq kernel (kMask): word 32 wi + lane of the tile, stored after item n's
    // G WGMMAs are issued (off the path from S to G).
    uint32_t bits = 0u;
    auto store_mask = [&](const Info& hd) {
      if constexpr (kMask)
        mask_out[static_cast<int64_t>(hd.item - mask_row0) * mask_stride +
                 (key_base - key_begin) / L::kTileRows * L::kMaskWordsPerTile + 32 * wi + static_cast<int>(lane)] = bits;
    };
    // dS (bf16 A fragments) of item n from its S accumulator (and, with kMask, its sign bits).
    auto make_ds = [&](const float(&acc)[32], const Info& hd, int n, uint32_t(&ds)[4][4]) {
      const float* f = sm.info_f(n % kStages);
      // The row's weights of this thread's columns (heads 8 gg + 2 quad + c).
      float wv[16];
#pragma unroll
      for (int gg = 0; gg < 8; ++gg) {
        const float2 x = reinterpret_cast<const float2*>(f)[4 * gg + quad];
        wv[2 * gg] = x.x;
        wv[2 * gg + 1] = x.y;
      }
      float di[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int key = key_base + row0 + 8 * i;
        const bool valid = key >= hd.lo && key < hd.hi;
        const float v = f[64 + 64 * wg + row0 + 8 * i];
        if constexpr (kLoss) {
          float x = 0.0f;
#pragma unroll
          for (int gg = 0; gg < 8; ++gg)
#pragma unroll
            for (int c = 0; c < 2; ++c) x = fmaf(wv[2 * gg + c], fmaxf(acc[4 * gg + 2 * i + c], 0.0f), x);
          x += __shfl_xor_sync(0xffffffffu, x, 1);
          x += __shfl_xor_sync(0xffffffffu, x, 2);
          di[i] = valid ? hd.g * (hd.mass * expf(x - hd.lse) - v) : 0.0f;
          if (valid && quad == 0) di_out[static_cast<int64_t>(hd.item - vals_row0) * di_stride + key] = di[i];
        } else {
          di[i] = valid ? v : 0.0f;
        }
      }
      bits = 0u;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int gg = 2 * kk + j / 2, i = j % 2;
          // [S > 0] of the pair as 0xffff halves (the sign test on S rounded to bf16: the same for every
          // S except fp32 values below bf16's smallest denormal)
          const uint32_t keep = training_detail::positive_halves(acc[4 * gg + 2 * i], acc[4 * gg + 2 * i + 1]);
          ds[kk][j] = ptx::pack_bf16x2(di[i] * wv[2 * gg], di[i] * wv[2 * gg + 1]) & keep;
          if constexpr (kMask) bits |= keep & training_detail::mask_bits(gg, i);
        }
      }
    };

    // NOTES: software-pipelined over items with two S accumulators: item n + 1's S WGMMAs are issued
    // before item n's dS epilogue, so the tensor cores always hold queued work. wgmma groups retire in
    // order: after committing S(n + 1), wait_group<1> retires S(n) and G(n - 1), which frees item n - 1's
    // stage and the dS registers (the A operand of G(n - 1)).
    float acc0[32], acc1[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc0[i] = acc1[i] = 0.0f;
    uint32_t ds[4][4];
    Info h0, h1;
    // Item n (S pending in `cur`, header hc): issues item n + 1's S into `next` (header hn), then item n's
    // dS and G. Returns true after the last item.
    auto step = [&](float(&cur)[32], float(&next)[32], const Info& hc, Info& hn, int n) -> bool {
      wait_item(n + 1, hn);
      if (hn.item >= 0) {
        training_detail::mma_s<kHeadDim>(next, a, tile_of(n + 1));
        ptx::wgmma_wait<1>();
      } else {
        ptx::wgmma_wait<0>();
      }
      ptx::fence_accum<32>(cur);
      if (n > 0) release(n - 1);
      make_ds(cur, hc, n, ds);
      training_detail::mma_g<kHeadDim>(g, ds, tile_of(n));
      store_mask(hc);
      if (hn.item >= 0) return false;
      ptx::wgmma_wait<0>();
      release(n);
      return true;
    };
    wait_item(0, h0);
    if (h0.item >= 0) {
      training_detail::mma_s<kHeadDim>(acc0, a, tile_of(0));
      for (int n = 0;; n += 2)
        if (step(acc0, acc1, h0, h1, n) || step(acc1, acc0, h1, h0, n + 1)) break;
      ptx::fence_accum<kHeadDim / 2>(g);
    }
    const int valid_rows = min(64, num_keys - key_base);
    if (valid_rows > 0)
      training_detail::store_g<kHeadDim>(dk_part + (static_cast<int64_t>(split) * part_rows + (key_base - key_begin)) * kHeadDim,
                                         g, wi, static_cast<int>(lane), valid_rows);
  }
#else
  asm volatile("trap;");
#endif
}

template <int kHeadDim>
__global__ void __launch_bounds__(TrainingIndexerBwdLayout::kThreads, 1)
    training_indexer_dq_kernel(const __grid_constant__ CUtensorMap tmap_k, const __nv_bfloat16* __restrict__ q_i,
                               const float* __restrict__ w, const int* __restrict__ ks, const int* __restrict__ ke,
                               const float* __restrict__ di, int64_t di_stride, int di_row0, float* __restrict__ dq_out,
                               float* __restrict__ dw_out, int row_begin, int row_end, int num_keys) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = TrainingIndexerBwdLayout;
  constexpr L lay{kHeadDim};
  static_assert(lay.valid(), "unsupported training_indexer_bwd configuration");
  constexpr int kStages = lay.num_stages();
  constexpr int H = L::kNumHeads;
  constexpr int kTileKeys = L::kTileRows;
  using Info = training_detail::BwdInfoHeader;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const training_detail::BwdSmem<kHeadDim> sm{smem_raw};
  uint8_t* smem = sm.base;

  const uint32_t warp = ptx::warp_idx();
  const uint32_t lane = ptx::lane_idx();
  // Row pairs, the last (longest under causal bounds) first.
  const int num_pairs = (row_end - row_begin + 1) / 2;
  const int t_first = row_begin + 2 * (num_pairs - 1 - static_cast<int>(blockIdx.x));
  int lo_r[2], hi_r[2], u_lo, u_hi;
  training_detail::row_bounds<2>(ks, ke, t_first, row_end, 0, num_keys, lo_r, hi_r, u_lo, u_hi);
  const int num_tiles = u_lo < u_hi ? (u_hi - u_lo + kTileKeys - 1) / kTileKeys : 0;

  sm.init(&tmap_k);

  if (warp < 4) {
    // ===================================================================== producer
    ptx::reg_dealloc<L::kProducerRegs>();
    // Tile j: producer warp j % 4 (as in the dk kernel, to keep several tiles' loads in flight).
    for (int j = static_cast<int>(warp); j < num_tiles; j += L::kProducerWarps) {
      const int s = j % kStages;
      sm.wait_empty(j);
      const int key0 = u_lo + j * kTileKeys;
      float* f = sm.info_f(s);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float* drow = di + static_cast<int64_t>(t_first + r - di_row0) * di_stride;
#pragma unroll
        for (int c2 = 0; c2 < 2; ++c2) {
          const int c = 32 * c2 + static_cast<int>(lane);
          const int key = key0 + c;
          f[64 * r + c] = key >= lo_r[r] && key < hi_r[r] ? __ldg(drow + key) : 0.0f;
        }
      }
      if (lane == 0) {
        sm.info(s)->item = key0;
        ptx::mbar_arrive_expect_tx(sm.full(s), lay.tile_bytes());
#pragma unroll
        for (int b = 0; b < lay.num_kblocks(); ++b)
          ptx::tma_load_2d(smem + lay.offset_tile(s) + b * lay.mn_block_bytes(), &tmap_k, sm.full(s), 64 * b, key0);
      } else {
        ptx::mbar_arrive(sm.full(s));
      }
    }
  } else {
    // ===================================================================== math
    ptx::reg_alloc<L::kMathRegs>();
    const int wg = static_cast<int>(warp / 4) - 1;  // row t_first + wg
    const int wi = static_cast<int>(warp % 4);
    const int quad = static_cast<int>(lane & 3);
    const int t = t_first + wg;
    const int my_lo = wg == 0 ? lo_r[0] : lo_r[1], my_hi = wg == 0 ? hi_r[0] : hi_r[1];  // no dynamic indexing
    const bool has_row = t < row_end && my_lo < my_hi;
    const int own_first = has_row ? (my_lo - u_lo) / kTileKeys : 0;
    const int own_end = has_row ? (my_hi - 1 - u_lo) / kTileKeys + 1 : 0;
    uint32_t a[kHeadDim / 16][4];
    float wr[2] = {0.0f, 0.0f};
    const int row0 = 16 * wi + static_cast<int>(lane / 4);  // + 8 i: head
    if (has_row) {
      training_detail::load_a_fragments<kHeadDim>(a, q_i, static_cast<long long>(t) * H,
                                                  static_cast<long long>(t) * H + H, wi, static_cast<int>(lane));
      wr[0] = __ldg(w + static_cast<int64_t>(t) * H + row0);
      wr[1] = __ldg(w + static_cast<int64_t>(t) * H + row0 + 8);
    }
    float g[kHeadDim / 2], dw[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) g[i] = 0.0f;

    auto wait_tile = [&](int j) { sm.wait_full(j); };
    auto tile_of = [&](int j) { return sm.tile(j); };
    auto release = [&](int j) { sm.release(j, lane); };
    // dw and dS (bf16 A fragments) of tile j from its S accumulator.
    auto make_ds = [&](const float(&acc)[32], int j, uint32_t(&ds)[4][4]) {
      // dI of this thread's columns (keys key0 + 8 gg + 2 quad + c), 0 outside the row's range.
      const float* f = sm.info_f(j % kStages) + 64 * wg;
      float dv[16];
#pragma unroll
      for (int gg = 0; gg < 8; ++gg) {
        const float2 x = reinterpret_cast<const float2*>(f)[4 * gg + quad];
        dv[2 * gg] = x.x;
        dv[2 * gg + 1] = x.y;
      }
#pragma unroll
      for (int gg = 0; gg < 8; ++gg)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int c = 0; c < 2; ++c) dw[i] = fmaf(dv[2 * gg + c], fmaxf(acc[4 * gg + 2 * i + c], 0.0f), dw[i]);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int gg = 2 * kk + jj / 2, i = jj % 2;
          const float x0 = acc[4 * gg + 2 * i], x1 = acc[4 * gg + 2 * i + 1];
          const float d0 = x0 > 0.0f ? dv[2 * gg] * wr[i] : 0.0f;
          const float d1 = x1 > 0.0f ? dv[2 * gg + 1] * wr[i] : 0.0f;
          ds[kk][jj] = ptx::pack_bf16x2(d0, d1);
        }
      }
    };

    // Tiles outside the row's own range [own_first, own_end) are only released; inside it the same
    // software pipeline as the dk kernel (S of tile j + 1 issued before tile j's epilogue).
    for (int j = 0; j < own_first; ++j) {
      wait_tile(j);
      release(j);
    }
    if (own_first < own_end) {
      float acc0[32], acc1[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) acc0[i] = acc1[i] = 0.0f;
      uint32_t ds[4][4];
      // Tile j (S pending in `cur`): issues tile j + 1's S into `next`, then tile j's dS and G. Returns
      // true after the row's last tile.
      auto step = [&](float(&cur)[32], float(&next)[32], int j) -> bool {
        const bool more = j + 1 < own_end;
        if (more) {
          wait_tile(j + 1);
          training_detail::mma_s<kHeadDim>(next, a, tile_of(j + 1));
          ptx::wgmma_wait<1>();
        } else {
          ptx::wgmma_wait<0>();
        }
        ptx::fence_accum<32>(cur);
        if (j > own_first) release(j - 1);
        make_ds(cur, j, ds);
        training_detail::mma_g<kHeadDim>(g, ds, tile_of(j));
        if (more) return false;
        ptx::wgmma_wait<0>();
        release(j);
        return true;
      };
      wait_tile(own_first);
      training_detail::mma_s<kHeadDim>(acc0, a, tile_of(own_first));
      for (int j = own_first;; j += 2)
        if (step(acc0, acc1, j) || step(acc1, acc0, j + 1)) break;
      ptx::fence_accum<kHeadDim / 2>(g);
    }
    for (int j = own_end > own_first ? own_end : own_first; j < num_tiles; ++j) {
      wait_tile(j);
      release(j);
    }
    if (t < row_end) {
      training_detail::store_g<kHeadDim>(dq_out + static_cast<int64_t>(t) * H * kHeadDim, g, wi, static_cast<int>(lane), H);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        dw[i] += __shfl_xor_sync(0xffffffffu, dw[i], 1);
        dw[i] += __shfl_xor_sync(0xffffffffu, dw[i], 2);
      }
      if (quad == 0) {
        dw_out[static_cast<int64_t>(t) * H + row0] = dw[0];
        dw_out[static_cast<int64_t>(t) * H + row0 + 8] = dw[1];
      }
    }
  }
#else
  asm volatile("trap;");
#endif
}

template <int kHeadDim, bool kBf16Out>
__global__ void __launch_bounds__(TrainingIndexerBwdLayout::kThreads, 1)
    training_indexer_dq_masked_kernel(const __grid_constant__ CUtensorMap tmap_k, const __nv_bfloat16* __restrict__ q_i,
                                      const float* __restrict__ w, const int* __restrict__ ks,
                                      const int* __restrict__ ke, const float* __restrict__ di, int64_t di_stride,
                                      int di_row0, const uint32_t* __restrict__ mask, int64_t mask_stride,
                                      int mask_row0, int mask_key0, void* __restrict__ dq_out,
                                      float* __restrict__ dw_out, int row_begin, int row_end, int mask_key1) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = TrainingIndexerBwdLayout;
  constexpr L lay{kHeadDim};
  static_assert(lay.valid(), "unsupported training_indexer_bwd configuration");
  constexpr int kStages = lay.num_stages();
  constexpr int H = L::kNumHeads;
  constexpr int kTileKeys = L::kTileRows;
  constexpr int kRows = L::kMaskedRowsPerCta;
  constexpr int kWords = L::kMaskWordsPerTile;
  static_assert(kRows == 4 && kTileKeys == 64 && kWords == 128, "the producer's loads assume 4 rows of 64-key tiles");
  static_assert(32 * kRows + kRows * kWords <= L::kInfoFloats, "info too small");
  using OutT = std::conditional_t<kBf16Out, __nv_bfloat16, float>;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const training_detail::BwdSmem<kHeadDim> sm{smem_raw};
  uint8_t* smem = sm.base;

  const uint32_t warp = ptx::warp_idx();
  const uint32_t lane = ptx::lane_idx();
  // Row quads, the last (longest under causal bounds) first.
  const int num_quads = (row_end - row_begin + kRows - 1) / kRows;
  const int t_first = row_begin + kRows * (num_quads - 1 - static_cast<int>(blockIdx.x));
  int lo_r[kRows], hi_r[kRows], u_lo, u_hi;  // keys clamped to those the dk call covered
  training_detail::row_bounds<kRows>(ks, ke, t_first, row_end, mask_key0, mask_key1, lo_r, hi_r, u_lo, u_hi);
  // NOTES: tiles on the dk kernel's 64-key grid (keys mask_key0 + 64 b), whose mask words they read.
  const int base = u_lo < u_hi ? mask_key0 + (u_lo - mask_key0) / kTileKeys * kTileKeys : 0;
  const int num_tiles = u_lo < u_hi ? (u_hi - base + kTileKeys - 1) / kTileKeys : 0;

  sm.init(&tmap_k);

  if (warp < 4) {
    // ===================================================================== producer
    ptx::reg_dealloc<L::kProducerRegs>();
    for (int j = static_cast<int>(warp); j < num_tiles; j += L::kProducerWarps) {
      const int s = j % kStages;
      sm.wait_empty(j);
      const int key0 = base + j * kTileKeys;
      uint32_t* f = reinterpret_cast<uint32_t*>(sm.info_f(s));
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        // dI of keys key0 + 2 lane, +1 as a bf16 pair (0 outside the row's range); the row's mask words
        // only where the tile meets its range (elsewhere dI is 0 and the bits are not used).
        const float* drow = di + static_cast<int64_t>(t_first + r - di_row0) * di_stride;
        const int key = key0 + 2 * static_cast<int>(lane);
        const float d0 = key >= lo_r[r] && key < hi_r[r] ? __ldg(drow + key) : 0.0f;
        const float d1 = key + 1 >= lo_r[r] && key + 1 < hi_r[r] ? __ldg(drow + key + 1) : 0.0f;
        f[32 * r + lane] = ptx::pack_bf16x2(d0, d1);
        if (lo_r[r] < hi_r[r] && lo_r[r] < key0 + kTileKeys && hi_r[r] > key0) {
          const uint4 m = __ldg(reinterpret_cast<const uint4*>(
                                    mask + static_cast<int64_t>(t_first + r - mask_row0) * mask_stride +
                                    static_cast<int64_t>((key0 - mask_key0) / kTileKeys) * kWords) +
                                lane);
          reinterpret_cast<uint4*>(f + 32 * kRows + kWords * r)[lane] = m;
        }
      }
      if (lane == 0) {
        ptx::mbar_arrive_expect_tx(sm.full(s), lay.tile_bytes());
#pragma unroll
        for (int b = 0; b < lay.num_kblocks(); ++b)
          ptx::tma_load_2d(smem + lay.offset_tile(s) + b * lay.mn_block_bytes(), &tmap_k, sm.full(s), 64 * b, key0);
      } else {
        ptx::mbar_arrive(sm.full(s));
      }
    }
  } else {
    // ===================================================================== math
    ptx::reg_alloc<L::kMathRegs>();
    const int wg = static_cast<int>(warp / 4) - 1;  // rows t_first + 2 wg + {0, 1}
    const int wi = static_cast<int>(warp % 4);
    const int quad = static_cast<int>(lane & 3);
    // no dynamic indexing of lo_r / hi_r
    const int lo0 = wg == 0 ? lo_r[0] : lo_r[2], hi0 = wg == 0 ? hi_r[0] : hi_r[2];
    const int lo1 = wg == 0 ? lo_r[1] : lo_r[3], hi1 = wg == 0 ? hi_r[1] : hi_r[3];
    const int first0 = lo0 < hi0 ? (lo0 - base) / kTileKeys : num_tiles, end0 = lo0 < hi0 ? (hi0 - 1 - base) / kTileKeys + 1 : 0;
    const int first1 = lo1 < hi1 ? (lo1 - base) / kTileKeys : num_tiles, end1 = lo1 < hi1 ? (hi1 - 1 - base) / kTileKeys + 1 : 0;
    float g0[kHeadDim / 2], g1[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) g0[i] = g1[i] = 0.0f;
    uint32_t ds0[4][4], ds1[4][4];

    auto wait_tile = [&](int j) { sm.wait_full(j); };
    auto tile_of = [&](int j) { return sm.tile(j); };
    auto release = [&](int j) { sm.release(j, lane); };
    // dS' = bf16(dI) [S > 0] of row r (of the CTA) at tile j as A fragments (columns = keys 8 gg + 2 quad + c):
    // this thread's (head 16 wi + lane / 4 + 8 i, key 8 gg + 2 quad + c) is in the word of dk thread
    // 32 (gg / 2) + 8 quad + 4 c + lane / 8 (training_detail::mask_bits for the bit).
    const int rot0 = 16 * static_cast<int>((lane >> 2) & 1u) + 2 * wi;
    auto make_ds = [&](int r, int j, uint32_t(&ds)[4][4]) {
      const uint32_t* f = reinterpret_cast<const uint32_t*>(sm.info_f(j % kStages));
      const uint32_t* words = f + 32 * kRows + kWords * r + 8 * quad + static_cast<int>(lane / 8);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t w0 = words[32 * kk], w1 = words[32 * kk + 4];  // keys c = 0, 1
#pragma unroll
        for (int ip = 0; ip < 2; ++ip) {  // gg = 2 kk + ip: the dk thread's i
          const int rot = (7 - rot0 - ip) & 31;  // bits p, p + 8 -> 7, 15
          const uint32_t x0 = __funnelshift_l(w0, w0, rot), x1 = __funnelshift_l(w1, w1, rot);
          const uint32_t pair = f[32 * r + 4 * (2 * kk + ip) + quad];
#pragma unroll
          for (int i = 0; i < 2; ++i)  // jj = 2 ip + i
            ds[kk][2 * ip + i] = pair & ptx::prmt(x0, x1, i == 0 ? 0xCC88u : 0xDD99u);
        }
      }
    };

    // NOTES: two dS' buffers per row (tiles alternate): tile j's two G' groups are issued while tile j - 1's
    // may still run, and wait_group<(groups of tile j)> then retires tile j - 1's (groups retire in order),
    // which frees its stage and the buffers that tile j + 1 fills.
    const int w_first = min(first0, first1), w_end = max(end0, end1);
    for (int j = 0; j < min(w_first, num_tiles); ++j) {
      wait_tile(j);
      release(j);
    }
    auto step = [&](uint32_t(&d0)[4][4], uint32_t(&d1)[4][4], int j) {
      wait_tile(j);
      const bool on0 = j >= first0 && j < end0, on1 = j >= first1 && j < end1;
      if (on0) {
        make_ds(2 * wg, j, d0);
        training_detail::mma_g<kHeadDim>(g0, d0, tile_of(j));
      }
      if (on1) {
        make_ds(2 * wg + 1, j, d1);
        training_detail::mma_g<kHeadDim>(g1, d1, tile_of(j));
      }
      if (on0 && on1)
        ptx::wgmma_wait<2>();
      else if (on0 || on1)
        ptx::wgmma_wait<1>();
      else
        ptx::wgmma_wait<0>();
      if (j > w_first) release(j - 1);
    };
    uint32_t ds0b[4][4], ds1b[4][4];
    for (int j = w_first; j < w_end; j += 2) {
      step(ds0, ds1, j);
      if (j + 1 < w_end) step(ds0b, ds1b, j + 1);
    }
    ptx::wgmma_wait<0>();
    ptx::fence_accum<kHeadDim / 2>(g0);
    ptx::fence_accum<kHeadDim / 2>(g1);
    if (w_first < w_end) release(w_end - 1);
    for (int j = max(w_end, w_first); j < num_tiles; ++j) {
      wait_tile(j);
      release(j);
    }
    // dq_I = w G', dw = q_I . G' (the row's heads 16 wi + lane / 4 + 8 i).
    const int row0 = 16 * wi + static_cast<int>(lane / 4);
    auto finish = [&](int t, const float(&gr)[kHeadDim / 2]) {
      if (t >= row_end) return;
      uint32_t a[kHeadDim / 16][4];
      training_detail::load_a_fragments<kHeadDim>(a, q_i, static_cast<long long>(t) * H, static_cast<long long>(t) * H + H,
                                                  wi, static_cast<int>(lane));
      float dw[2] = {0.0f, 0.0f};
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {  // a[kk][jj]: head row0 + 8 (jj % 2), dims 16 kk + 8 (jj / 2) + 2 quad + {0, 1}
          const int gg = 2 * kk + jj / 2, i = jj % 2;
          const float2 qv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a[kk][jj]));
          dw[i] = fmaf(qv.x, gr[4 * gg + 2 * i], fmaf(qv.y, gr[4 * gg + 2 * i + 1], dw[i]));
        }
      const float wr[2] = {__ldg(w + static_cast<int64_t>(t) * H + row0), __ldg(w + static_cast<int64_t>(t) * H + row0 + 8)};
      OutT* dst = reinterpret_cast<OutT*>(dq_out) + static_cast<int64_t>(t) * H * kHeadDim;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = row0 + 8 * i;
#pragma unroll
        for (int gg = 0; gg < kHeadDim / 8; ++gg) {
          const float x0 = wr[i] * gr[4 * gg + 2 * i], x1 = wr[i] * gr[4 * gg + 2 * i + 1];
          if constexpr (kBf16Out)
            *reinterpret_cast<uint32_t*>(dst + row * kHeadDim + 8 * gg + 2 * quad) = ptx::pack_bf16x2(x0, x1);
          else
            *reinterpret_cast<float2*>(dst + row * kHeadDim + 8 * gg + 2 * quad) = make_float2(x0, x1);
        }
        dw[i] += __shfl_xor_sync(0xffffffffu, dw[i], 1);
        dw[i] += __shfl_xor_sync(0xffffffffu, dw[i], 2);
        if (quad == 0) dw_out[static_cast<int64_t>(t) * H + row] = dw[i];
      }
    };
    finish(t_first + 2 * wg, g0);
    finish(t_first + 2 * wg + 1, g1);
  }
#else
  asm volatile("trap;");
#endif
}

}  // namespace deep_indexer
