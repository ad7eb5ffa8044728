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
#include <cstdint>

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

// The e4m3 bytes of magnitudes 0..7 times 2^s (byte m; magnitude 0 -> 0): lo = m 0..3, hi = m 4..7.
__host__ __device__ __forceinline__ void magnitude_table(int s, uint32_t& lo, uint32_t& hi) {
  if (s >= -5) {  // every nonzero magnitude is a normal: the exponent field moves by s (no carries)
    const uint32_t add = static_cast<uint32_t>(s + 5) << 3;
    lo = 0x14100800u + add * 0x01010100u;  // s = -5: 2^-6 (0x08), 2^-5, 1.5 * 2^-5
    hi = 0x24201C18u + add * 0x01010101u;  // 2^-4, 1.5 * 2^-4, 2^-3, 1.5 * 2^-3
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
    const int e = static_cast<int>((sf >> (8 * g)) & 0xFF);
    all = e > all ? e : all;
    if ((any[g] & 0x77777777u) != 0 && e > top) top = e;
  }
  return (top < 0 ? all : top) - 6;
}

// Folds one 16-byte group (4 code words) into 8 e4m3 words with the group's shift s.
__host__ __device__ __forceinline__ void fold_group(const uint32_t (&in)[4], int s, uint32_t (&out)[8]) {
  s = s < -30 ? -30 : (s > 6 ? 6 : s);
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
    fold_group(in, static_cast<int>((sf >> (8 * g)) & 0xFF) - base, o);
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

}  // namespace deep_indexer
