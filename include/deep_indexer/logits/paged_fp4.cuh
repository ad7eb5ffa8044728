// FP4 operands of the decode kernel (paged_mqa_logits.cuh): a KV tile's e2m1 codes folded into e4m3
// WGMMA A fragments in registers, and the order of head_dim that q's rows take in the q slot to match.
// The fold is fp4_fold.cuh's (docs/fp4.md): per row, base = the largest exponent of a group holding a
// nonzero code (else of any group) - 6; group g's values become e2m1 * 2^(e_g - base) in e4m3 (exact
// while that is an e4m3 normal); the row's scale is 2^(base - 127).
//
// NOTES: head_dim order. Thread `quad` (lane % 4) of a row reads one contiguous run of the row's codes,
// kHeadDim / 8 bytes at quad * kHeadDim / 8 (one 16- or 8-byte load; a quarter-warp reads 128
// contiguous bytes), and k-step ks takes its code word ks: values 0-3 fill the fragment's columns
// 4 quad + 0..3 and values 4-7 the columns 16 + 4 quad + 0..3 (the register A layout of
// wgmma_fp8_rs.cuh). Column p of k-step ks therefore holds
//   d = quad * kHeadDim / 4 + 8 ks + 4 (p / 16) + p % 4,  quad = (p % 16) / 4,
// and q rows are written in that order (slot_word_source), which leaves every dot product unchanged.
#pragma once
#include <cstdint>

#include <deep_indexer/common/ptx.cuh>
#include <deep_indexer/logits/fp4_fold.cuh>

namespace deep_indexer::paged_fp4 {

// The natural 4-byte word of a q row (values 4 i .. 4 i + 3) that word w of its slot row holds.
template <int kHeadDim>
__host__ __device__ constexpr int slot_word_source(int w) {
  return (w % 4) * (kHeadDim / 16) + 2 * (w / 8) + (w % 8) / 4;
}

// The e4m3 words of code word w's values 0-3 and 4-7, magnitudes from the table (lo, hi) of
// fp4_fold_detail::magnitude_table, the sign (bit 3 of each code) moved to bit 7 of its byte.
// NOTES: 8 integer instructions per word (one mask, one shift, four byte permutes, two merges) plus
// w << 4 on the multiply pipe; the byte permutes are asm so that the mask is shared by both halves.
__device__ __forceinline__ void fold_word(uint32_t w, uint32_t lo, uint32_t hi, uint32_t& v03, uint32_t& v47) {
  const uint32_t m = w & 0x77777777u;
  const uint32_t w4 = w << 4;  // codes 0, 2, 4, 6 have their sign at bit 7 of a byte of w4, 1, 3, 5, 7 of w
  v03 = ptx::prmt(lo, hi, m) | (ptx::prmt(w, w4, 0x1504u) & 0x80808080u);
  v47 = ptx::prmt(lo, hi, m >> 16) | (ptx::prmt(w, w4, 0x3726u) & 0x80808080u);
}

// A row's base: the maximum of its threads' fp4_fold_detail::lane_key (each over the codes it holds and
// its group's exponent), through fp4_fold_detail::base_of_key.
using fp4_fold_detail::base_of_key;
using fp4_fold_detail::lane_key;

// fp4_fold_detail::magnitude_table of a group's shift s = e_g - base (clamped here, as the fold does) for
// the math warps: the common case (every magnitude an e4m3 normal) inline, the subnormal one (s < -5, a
// group far below the row's largest) by the hardware conversion (round to nearest even, as the fold
// defines it) in one uniform branch.
__device__ __forceinline__ void magnitude_table(int s, uint32_t& lo, uint32_t& hi) {
  s = fp4_fold_detail::clamp_shift(s);
  fp4_fold_detail::normal_magnitude_table(s, lo, hi);
  if (s < -5) {
    const float p = __int_as_float((s + 127) << 23);  // 2^s, s >= -30
    auto pair = [](float a, float b) {                 // e4m3(a) << 8 | e4m3(b)
      uint16_t r;
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(a), "f"(b));
      return static_cast<uint32_t>(r);
    };
    lo = pair(0.5f * p, 0.0f) | pair(1.5f * p, p) << 16;
    hi = pair(3.0f * p, 2.0f * p) | pair(6.0f * p, 4.0f * p) << 16;
  }
}

// 2^(base - 127) as a float (fp4_fold_detail::exp2_bits; subnormal below base = 1).
__device__ __forceinline__ float pow2_biased(int base) { return __uint_as_float(fp4_fold_detail::exp2_bits(base)); }

// A fragments of one 64-key tile (codes: 64 rows of kHeadDim / 2 bytes; sf: 64 scale words) for the
// calling thread's rows r0 = 16 * (warp % 4) + lane / 4 and r0 + 8: a[ks] feeds k-step ks of
// WgmmaFp8RS. Returns the two rows' bases. Warp-collective (the quad shares the rows' group maxima).
template <int kHeadDim>
__device__ __forceinline__ void tile_fragments(const uint8_t* codes, const uint32_t* sf, int r0, uint32_t quad,
                                               uint32_t (&a)[kHeadDim / 32][4], int (&base)[2]) {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  constexpr int kSteps = kHeadDim / 32;   // k-steps = code words per thread and row
  constexpr int kGroups = kHeadDim / 32;  // scale groups of a row
  uint32_t w[2][kSteps];
  uint32_t s[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint8_t* row = codes + (r0 + 8 * j) * (kHeadDim / 2) + quad * (kHeadDim / 8);
    if constexpr (kHeadDim == 128) {
      const uint4 v = *reinterpret_cast<const uint4*>(row);
      w[j][0] = v.x, w[j][1] = v.y, w[j][2] = v.z, w[j][3] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(row);
      w[j][0] = v.x, w[j][1] = v.y;
    }
    s[j] = sf[r0 + 8 * j];
  }
  // This thread's group (D = 64: two threads per group); the quad covers all groups of the row, so
  // the maximum of its base keys (both rows at once, 16 bits each) gives the rows' bases.
  static_assert(kGroups == 4 || kGroups == 2, "groups");
  const uint32_t byte_sel = 0x4440u | (kHeadDim == 128 ? quad : quad / 2);  // byte g of a word, zero-extended
  uint32_t e[2], key = 0;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    e[j] = ptx::prmt(s[j], 0u, byte_sel);
    uint32_t c1 = 0;
    if constexpr (kSteps == 4) c1 = w[j][2] | w[j][3];
    key |= static_cast<uint32_t>(lane_key(w[j][0] | w[j][1], c1, static_cast<int>(e[j]))) << (16 * j);
  }
  key = __vmaxu2(key, __shfl_xor_sync(0xffffffffu, key, 1));
  key = __vmaxu2(key, __shfl_xor_sync(0xffffffffu, key, 2));
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    base[j] = base_of_key(static_cast<int>(key >> (16 * j)));
    uint32_t lo, hi;
    magnitude_table(static_cast<int>(e[j]) - base[j], lo, hi);
#pragma unroll
    for (int k = 0; k < kSteps; ++k) fold_word(w[j][k], lo, hi, a[k][j], a[k][2 + j]);
  }
}

// Slot word of the natural word i of a q row (the inverse of slot_word_source).
template <int kHeadDim>
__host__ __device__ constexpr int slot_word_of(int i) {
  return 8 * ((i % (kHeadDim / 16)) / 2) + 4 * (i % 2) + i / (kHeadDim / 16);
}

template <int kHeadDim>
constexpr bool slot_order_is_a_permutation() {
  for (int w = 0; w < kHeadDim / 4; ++w)
    if (slot_word_of<kHeadDim>(slot_word_source<kHeadDim>(w)) != w) return false;
  return true;
}
static_assert(slot_order_is_a_permutation<64>() && slot_order_is_a_permutation<128>(), "slot word order");

// Stores natural words i0 .. i0 + 7 of row `row` of the slot `dst` (swizzled like TMA with kHeadDim-byte
// rows): two 16-byte stores, or with kPermute eight 4-byte stores to their slot words.
// NOTES: within a row the swizzle XORs the byte column's 16-byte chunk bits with a per-row constant
// (`chunk_xor`), so with i0 known at compile time each store is the row base plus a per-chunk offset and an
// immediate.
template <int kHeadDim>
__host__ __device__ constexpr uint32_t chunk_xor(int row) {
  return (static_cast<uint32_t>(row * kHeadDim) >> 3) & ptx::SwizzleMode<kHeadDim>::kChunkMask;
}
// Where byte column `col` of a row with chunk_xor `x` lies within the row.
template <int kHeadDim>
__host__ __device__ constexpr uint32_t swizzled_col(uint32_t x, uint32_t col) {
  constexpr uint32_t kMask = ptx::SwizzleMode<kHeadDim>::kChunkMask;
  return ((col & kMask) ^ x) | (col & ~kMask);
}
// Every byte of a row, so addressed, is where ptx::SwizzleMode::swizzle puts it.
template <int kHeadDim>
constexpr bool chunk_xor_matches_swizzle() {
  for (int row = 0; row < 16; ++row)
    for (uint32_t col = 0; col < static_cast<uint32_t>(kHeadDim); col += 4) {
      const uint32_t row_off = static_cast<uint32_t>(row * kHeadDim);
      if (row_off + swizzled_col<kHeadDim>(chunk_xor<kHeadDim>(row), col) !=
          ptx::SwizzleMode<kHeadDim>::swizzle(row_off + col))
        return false;
    }
  return true;
}
static_assert(chunk_xor_matches_swizzle<64>() && chunk_xor_matches_swizzle<128>(), "q slot store addresses");
template <int kHeadDim, bool kPermute>
__device__ __forceinline__ void store_q_words(uint8_t* dst, int row, int i0, const uint32_t (&v)[8]) {
  uint8_t* row_ptr = dst + row * kHeadDim;
  const uint32_t x = chunk_xor<kHeadDim>(row);
  auto at = [&](uint32_t col) { return row_ptr + swizzled_col<kHeadDim>(x, col); };
  if constexpr (kPermute) {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      *reinterpret_cast<uint32_t*>(at(static_cast<uint32_t>(4 * slot_word_of<kHeadDim>(i0 + k)))) = v[k];
  } else {
#pragma unroll
    for (int k = 0; k < 2; ++k)
      *reinterpret_cast<uint4*>(at(static_cast<uint32_t>(4 * (i0 + 4 * k)))) =
          make_uint4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  }
}

// The base key (lane_key) of group g of a staged FP4 q row `src` with scale word `sf`.
__device__ __forceinline__ int q_group_key(const uint8_t* src, uint32_t sf, int g) {
  const uint4 c = reinterpret_cast<const uint4*>(src)[g];
  return lane_key(c.x | c.y, c.z | c.w, fp4_fold_detail::group_exponent(sf, g));
}

// Natural words 8 g .. 8 g + 7 (values 32 g .. 32 g + 31) of a staged q row `src` as e4m3 words: FP4 codes
// folded at the row's base (scale word `sf`), FP8 bytes as they are.
template <int kHeadDim, bool kQFp4>
__device__ __forceinline__ void q_group_words(const uint8_t* src, uint32_t sf, int g, int base, uint32_t (&v)[8]) {
  const uint4* in = reinterpret_cast<const uint4*>(src);
  if constexpr (kQFp4) {
    const uint4 c = in[g];
    const uint32_t codes[4] = {c.x, c.y, c.z, c.w};
    uint32_t lo, hi;
    magnitude_table(fp4_fold_detail::group_exponent(sf, g) - base, lo, hi);
#pragma unroll
    for (int k = 0; k < 4; ++k) fold_word(codes[k], lo, hi, v[2 * k], v[2 * k + 1]);
  } else {
    const uint4 a = in[2 * g], b = in[2 * g + 1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
}

// One q row for the q slot: `src` is the row in the staging buffer (FP4: kHeadDim / 2 code bytes with
// its scale word `sf`; FP8: kHeadDim e4m3 bytes); writes it to row `row` of the slot `dst`, in the
// K-fragment order when kPermute. Returns the row's base (FP4; 127, a factor of 1, for FP8).
// NOTES: unrolled over the row's groups (stores at compile-time offsets), each group's codes read again for
// its fold (the q producer's registers are few).
template <int kHeadDim, bool kQFp4, bool kPermute>
__device__ __forceinline__ int stage_q_row(const uint8_t* src, uint32_t sf, uint8_t* dst, int row) {
  constexpr int kGroups = kHeadDim / 32;
  int base = 127;
  if constexpr (kQFp4) {
    int key = 0;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) key = max(key, q_group_key(src, sf, g));
    base = base_of_key(key);
  }
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    uint32_t v[8];
    q_group_words<kHeadDim, kQFp4>(src, sf, g, base, v);
    store_q_words<kHeadDim, kPermute>(dst, row, 8 * g, v);
  }
  return base;
}

// Group g of a q row for the q slot, as stage_q_row, one thread per (row, group): warp-collective, the
// kHeadDim / 32 groups of a row on consecutive lanes (lane % groups == g), every lane calling. Returns the
// row's base.
template <int kHeadDim, bool kQFp4, bool kPermute>
__device__ __forceinline__ int stage_q_group(const uint8_t* src, uint32_t sf, uint8_t* dst, int row, int g) {
  constexpr int kGroups = kHeadDim / 32;
  int base = 127;
  if constexpr (kQFp4) {
    int key = q_group_key(src, sf, g);
#pragma unroll
    for (int m = 1; m < kGroups; m <<= 1) key = max(key, __shfl_xor_sync(0xffffffffu, key, m));
    base = base_of_key(key);
  }
  uint32_t v[8];
  q_group_words<kHeadDim, kQFp4>(src, sf, g, base, v);
  store_q_words<kHeadDim, kPermute>(dst, row, 8 * g, v);
  return base;
}

}  // namespace deep_indexer::paged_fp4
