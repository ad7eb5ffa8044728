// fp4_fold: FP4 rows (DeepGEMM format) -> e4m3 values and a per-row base exponent, exactly as
// deep_indexer.quant.fp4_to_e4m3_folded / fold_fp4_to_e4m3 define it (docs/fp4.md), in one pass.
//
// A row has kHeadDim / 32 groups; group g is 16 code bytes (element 2i in the low nibble of byte i,
// 2i + 1 in the high one; bit 3 = sign, bits 0..2 = e2m1 magnitude index) and the exponent byte
// e_g = byte g of the row's int32 scale word. The row's base is
//   base = (largest e_g among the groups holding a code with a nonzero magnitude, or the largest e_g of
//           all groups when none does) - 6,
// and element x of group g becomes the e4m3 byte of e2m1(x) * 2^s, s = e_g - base (<= 6 for every
// group with a nonzero code): exact where the result is an e4m3 normal, rounded to nearest even among
// the subnormals (k * 2^-9) below, signed zeros kept (code 8 -> 0x80, a tiny negative value -> 0x80).
// s is clamped to [-30, 6]: above 6 a group holds only zero magnitudes, below -30 every value rounds
// to zero exactly as at -30 (the torch fold's table range).
//
// One thread per row: 16-byte loads (one per group; the codes start 16-byte aligned, checked on the
// host, and a row is kHeadDim / 2 = 16 * groups bytes) and two 16-byte stores per group.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <deep_indexer/logits/fp4_fold_layout.hpp>

namespace deep_indexer {
namespace fp4_fold_detail {

// __byte_perm(x, y, s) for selectors without the sign-replicate bit (bit 3 of each nibble clear).
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, s);
#else
  const uint64_t xy = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((xy >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}

// Exponent byte e_g of group g of a row's scale word.
__host__ __device__ __forceinline__ int group_exponent(uint32_t sf, int g) {
  return static_cast<int>((sf >> (8 * g)) & 0xFFu);
}

// A group's shift s = e_g - base clamped to [-30, 6] (see the top of the file).
__host__ __device__ __forceinline__ int clamp_shift(int s) {
  s = s < -30 ? -30 : s;
  return s > 6 ? 6 : s;
}

// The e4m3 byte of e2m1 magnitude index m (1..7: 0.5, 1, 1.5, 2, 3, 4, 6) times 2^s, s in [-30, 6].
__host__ __device__ __forceinline__ uint32_t e2m1_times_pow2_e4m3(int m, int s) {
  const int e = m >= 2 ? (m >> 1) - 1 : -1;  // value = (1 + h / 2) * 2^e
  const int h = m >= 2 ? (m & 1) : 0;
  const int t = e + s;
  if (t >= -6) return static_cast<uint32_t>(((t + 7) << 3) | (h << 2));  // normal (t <= 8: at most 384)
  // subnormal k * 2^-9: the value is (2 + h) * 2^(t + 8) units of 2^-9
  const int x = 2 + h;
  const int r = -(t + 8);  // right shift (>= -1)
  if (r <= 0) return static_cast<uint32_t>(x << -r);
  if (r >= 3) return 0;  // below half of 2^-9
  const int q = x >> r, rem = x & ((1 << r) - 1), half = 1 << (r - 1);
  return static_cast<uint32_t>(q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0));
}

// magnitude_table for s >= -5, where every nonzero magnitude is a normal: the exponent field moves by s
// (no carries).
__host__ __device__ __forceinline__ void normal_magnitude_table(int s, uint32_t& lo, uint32_t& hi) {
  const uint32_t add = static_cast<uint32_t>(s + 5) << 3;
  lo = 0x14100800u + add * 0x01010100u;  // s = -5: 2^-6 (0x08), 2^-5, 1.5 * 2^-5
  hi = 0x24201C18u + add * 0x01010101u;  // 2^-4, 1.5 * 2^-4, 2^-3, 1.5 * 2^-3
}

// The e4m3 bytes of magnitudes 0..7 times 2^s, s clamped to [-30, 6] (byte m; magnitude 0 -> 0): lo = m 0..3,
// hi = m 4..7.
__host__ __device__ __forceinline__ void magnitude_table(int s, uint32_t& lo, uint32_t& hi) {
  s = clamp_shift(s);
  if (s >= -5) {
    normal_magnitude_table(s, lo, hi);
  } else {
    lo = 0;
    hi = 0;
    for (int m = 1; m < 4; ++m) lo |= e2m1_times_pow2_e4m3(m, s) << (8 * m);
    for (int m = 4; m < 8; ++m) hi |= e2m1_times_pow2_e4m3(m, s) << (8 * (m - 4));
  }
}

// The 4 e4m3 bytes of the two code bytes in the low 16 bits of w (low nibble first).
__host__ __device__ __forceinline__ uint32_t fold_half(uint32_t w, uint32_t lo, uint32_t hi) {
  const uint32_t t = byte_perm(w, 0, 0x1100);  // bytes b0, b0, b1, b1
  const uint32_t sign = ((t << 4) & 0x00800080u) | (t & 0x80008000u);  // bit 3 of nibble j -> bit 7 of byte j
  return byte_perm(lo, hi, w & 0x7777u) | sign;
}

// The row's base exponent (see the top of the file) from its groups' code words and scale word.
template <int kGroups>
__host__ __device__ __forceinline__ int row_base(const uint32_t (&any)[kGroups], uint32_t sf) {
  int top = -1, all = 0;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int e = group_exponent(sf, g);
    all = e > all ? e : all;
    if ((any[g] & 0x77777777u) != 0 && e > top) top = e;
  }
  return (top < 0 ? all : top) - 6;
}

// Folds one 16-byte group (4 code words) into 8 e4m3 words with the group's shift s.
__host__ __device__ __forceinline__ void fold_group(const uint32_t (&in)[4], int s, uint32_t (&out)[8]) {
  uint32_t lo, hi;
  magnitude_table(s, lo, hi);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = fold_half(in[k] & 0xFFFFu, lo, hi);
    out[2 * k + 1] = fold_half(in[k] >> 16, lo, hi);
  }
}

// One row on the host or the device: codes [kHeadDim / 2] bytes as words, out [kHeadDim] bytes as words.
template <int kHeadDim>
__host__ __device__ __forceinline__ int fold_row(const uint32_t (&codes)[kHeadDim / 8], uint32_t sf,
                                                 uint32_t (&out)[kHeadDim / 4]) {
  constexpr int kGroups = kHeadDim / 32;
  uint32_t any[kGroups];
#pragma unroll
  for (int g = 0; g < kGroups; ++g) any[g] = codes[4 * g] | codes[4 * g + 1] | codes[4 * g + 2] | codes[4 * g + 3];
  const int base = row_base<kGroups>(any, sf);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const uint32_t in[4] = {codes[4 * g], codes[4 * g + 1], codes[4 * g + 2], codes[4 * g + 3]};
    uint32_t o[8];
    fold_group(in, group_exponent(sf, g) - base, o);
#pragma unroll
    for (int k = 0; k < 8; ++k) out[8 * g + k] = o[k];
  }
  return base;
}

}  // namespace fp4_fold_detail

// codes uint8 [num_rows, kHeadDim / 2] (16-byte aligned), sf int32 [num_rows] -> vals e4m3 bytes
// [num_rows, kHeadDim] (16-byte aligned), base int32 [num_rows]. One thread per row (grid-stride).
template <int kHeadDim, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads) fp4_fold_kernel(const uint8_t* __restrict__ codes,
                                                               const int* __restrict__ sf,
                                                               uint8_t* __restrict__ vals, int* __restrict__ base,
                                                               int64_t num_rows) {
  static_assert(kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "D in 32/64/96/128");
  constexpr int kGroups = kHeadDim / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kNumThreads;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kNumThreads + threadIdx.x; r < num_rows; r += stride) {
    const uint4* src = reinterpret_cast<const uint4*>(codes + r * (kHeadDim / 2));
    uint32_t in[kHeadDim / 8];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const uint4 v = __ldg(src + g);
      in[4 * g] = v.x;
      in[4 * g + 1] = v.y;
      in[4 * g + 2] = v.z;
      in[4 * g + 3] = v.w;
    }
    const uint32_t word = static_cast<uint32_t>(__ldg(sf + r));
    uint32_t out[kHeadDim / 4];
    const int b = fp4_fold_detail::fold_row<kHeadDim>(in, word, out);
    uint4* dst = reinterpret_cast<uint4*>(vals + r * kHeadDim);
#pragma unroll
    for (int k = 0; k < kHeadDim / 16; ++k) dst[k] = make_uint4(out[4 * k], out[4 * k + 1], out[4 * k + 2], out[4 * k + 3]);
    base[r] = b;
  }
}

// ------------------------------------------------------------------------------------------------
// fp4_prefill_fold: the FP8 prefill kernel's inputs from FP4 q and / or k in one launch
// (deep_indexer.ops._prefill_inputs). Per row it writes the e4m3 values of fold_row and, instead of
// the base, scale = w * 2^(base - 127) in float32: for q w = weights[t, h] (float32 / bfloat16 /
// float16, row = t * H + h), so scale is the q row's scaled weight; for k w = 1, so scale is k_scale.
// The product is one round-to-nearest float32 multiply without flush to zero, as torch's
// weights.float() * exp2_int(base) (exact unless it leaves float32's range).
//
// Lane mapping: kHeadDim / 16 consecutive lanes share a row, lane j folding code bytes [8 j, 8 j + 8)
// (group j / 2) into output bytes [16 j, 16 j + 16): 8-byte loads and 16-byte stores, contiguous
// across the warp. The row's base comes from one max over its lanes of
//   key = e_g + 256 (lane holds a nonzero magnitude) or e_g (it does not):
// the max is 256 + the largest e_g of a nonzero group when there is one, else the largest e_g.
// Grid: the q operand's CTAs, then the k operand's; each thread folds kUnits rows (loads first).
namespace fp4_fold_detail {

// 2^(e - 127) as float32 bits for e in [-22, 254] (subnormal below e = 1), as quant.exp2_int.
__host__ __device__ __forceinline__ uint32_t exp2_bits(int e) {
  if (e >= 1) return static_cast<uint32_t>(e < 254 ? e : 254) << 23;
  return 1u << ((e > -22 ? e : -22) + 22);
}

// One lane's base key (see above) from its 8 code bytes (two words) and its group's exponent byte.
__host__ __device__ __forceinline__ int lane_key(uint32_t c0, uint32_t c1, int e) {
  return ((c0 | c1) & 0x77777777u) != 0 ? e + 256 : e;
}
// The row's base from the maximum of its lanes' keys.
__host__ __device__ __forceinline__ int base_of_key(int key) { return (key & 0xFF) - 6; }

// One lane's 16 e4m3 bytes (four words) from its 8 code bytes at shift s = e_g - base.
__host__ __device__ __forceinline__ void fold_lane(uint32_t c0, uint32_t c1, int s, uint32_t (&out)[4]) {
  uint32_t lo, hi;
  magnitude_table(s, lo, hi);
  out[0] = fold_half(c0 & 0xFFFFu, lo, hi);
  out[1] = fold_half(c0 >> 16, lo, hi);
  out[2] = fold_half(c1 & 0xFFFFu, lo, hi);
  out[3] = fold_half(c1 >> 16, lo, hi);
}

}  // namespace fp4_fold_detail

template <int kHeadDim>
__global__ void __launch_bounds__(Fp4FoldLayout::kNumThreads) fp4_prefill_fold_kernel(const Fp4FoldOperand q,
                                                                                      const Fp4FoldOperand k) {
  static_assert(Fp4FoldLayout::supported(kHeadDim), "D in 32/64/128");
  constexpr int kLanes = Fp4FoldLayout::lanes_per_row(kHeadDim);
  constexpr int kRowsPerPass = Fp4FoldLayout::rows_per_pass(kHeadDim);
  constexpr int kUnits = Fp4FoldLayout::kUnits;
  static_assert(32 % kLanes == 0, "a row's lanes within one warp");
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  // NOTES: the next kernel (the prefill, launched with PDL) may take SMs as this grid drains; its
  // griddepcontrol.wait still waits for this grid's completion and writes.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const bool is_q = static_cast<int>(blockIdx.x) < q.blocks;
  const Fp4FoldOperand op = is_q ? q : k;
  const int cta = is_q ? static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x) - q.blocks;
  const int j = static_cast<int>(threadIdx.x) % kLanes;
  const int e_shift = 8 * (j / 2);
  const int64_t row0 = static_cast<int64_t>(cta) * Fp4FoldLayout::rows_per_cta(kHeadDim) + threadIdx.x / kLanes;

  uint2 c[kUnits];
  uint32_t sf[kUnits];
  float w[kUnits];
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const int64_t r = row0 + u * kRowsPerPass;
    c[u] = make_uint2(0, 0);
    sf[u] = 0;
    w[u] = 1.0f;
    if (r < op.rows) {
      c[u] = __ldg(reinterpret_cast<const uint2*>(op.codes + r * (kHeadDim / 2)) + j);
      sf[u] = static_cast<uint32_t>(__ldg(op.sf + r));
      if (j == 0 && op.weights != nullptr) {
        const uint32_t ri = static_cast<uint32_t>(r), h = static_cast<uint32_t>(op.heads);  // rows < 2^31
        const int64_t wi = static_cast<int64_t>(ri / h) * op.w_stride0 + static_cast<int64_t>(ri % h) * op.w_stride1;
        w[u] = op.w_kind == 0   ? __ldg(static_cast<const float*>(op.weights) + wi)
               : op.w_kind == 1 ? __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(op.weights) + wi))
                                : __half2float(__ldg(static_cast<const __half*>(op.weights) + wi));
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const int e = static_cast<int>((sf[u] >> e_shift) & 0xFF);
    int key = fp4_fold_detail::lane_key(c[u].x, c[u].y, e);
#pragma unroll
    for (int m = 1; m < kLanes; m <<= 1) key = max(key, __shfl_xor_sync(0xffffffffu, key, m));
    const int base = fp4_fold_detail::base_of_key(key);
    const int64_t r = row0 + u * kRowsPerPass;
    if (r < op.rows) {
      uint32_t o[4];
      fp4_fold_detail::fold_lane(c[u].x, c[u].y, e - base, o);
      reinterpret_cast<uint4*>(op.vals + r * kHeadDim)[j] = make_uint4(o[0], o[1], o[2], o[3]);
      if (j == 0) op.scale[r] = __fmul_rn(w[u], __uint_as_float(fp4_fold_detail::exp2_bits(base)));
    }
  }
}

}  // namespace deep_indexer
