// relu(x) = (x + |x|) / 2 with the linear half on the tensor cores (prefill and decode kernels).
//
//   sum_h w_h relu(q_h . k) = (sum_h w_h |q_h . k| + q~ . k) / 2,   q~ = sum_h w_h q_h
//
// The CUDA cores then need one FFMA per (key, head) (|x| is a free operand modifier) instead of
// max + FFMA. q~ (fp32) enters the WGMMA as kPieces fp8 (e4m3) rows per token: piece p =
// e4m3(r_p / sigma_p), r_0 = q~, r_{p+1} = r_p - sigma_p piece_p, sigma_p = max_d |r_p[d]| / 448, so
// q~ = sum_p sigma_p piece_p up to ~2^-16 of max |q~| (each piece keeps ~4 bits of what is left).
//
// Placement: the pieces of T tokens (those that share one WGMMA) fill 8 * ceil(T / 2) rows after
// their q rows; piece p of token t is row 8 (t / 2) + 2 p + t % 2 of them, so that in the m64nN
// accumulator (column 8 g + 2 quad + c per thread) the token of a pieces column depends on the
// register only (t = 2 g + c) and the piece on the lane only (p = quad).
#pragma once
#include <cstdint>

#include <deep_indexer/common/host_device.hpp>
#include <deep_indexer/common/ptx.cuh>

namespace deep_indexer::split_relu {

constexpr int kPieces = 4;  // = lanes per quad
constexpr float kE4M3Max = 448.0f;

DI_DEVICE float piece_scale(uint32_t amax_bits) { return __uint_as_float(amax_bits) * (1.0f / kE4M3Max); }
// Lanes that share one (token, word) column when there are fewer columns than the 128 threads: the
// largest power of two that keeps cols * lanes <= 128.
DI_HOST_DEVICE constexpr int lanes_per_column(int cols) {
  int l = 1;
  while (cols * 2 * l <= 128) l *= 2;
  return l;
}

// Builds the pieces of the T tokens whose q rows (token-major, [T * H rows][D bytes], swizzled like
// TMA with D-byte rows) start at `q` and whose weights are w[T][H], into `pieces` (same swizzle,
// 1024-byte aligned), and leaves amax[T][kPieces] = max |r_p| as float bits (sigma_p = piece_scale).
// Tokens >= num_valid get zero pieces (their q rows may never have been loaded). Called by all 128
// threads (tid 0..127) of one warpgroup, with a named barrier id of its own; ends with the pieces
// visible to the async proxy and amax to the warpgroup.
template <int H, int D, int T>
DI_DEVICE void build_pieces(const uint8_t* q, uint8_t* pieces, const float* w, uint32_t* amax, int num_valid,
                            int tid, uint32_t barrier_id) {
  constexpr int kWords = D / 4;  // 32-bit words (4 fp8) per q row
  constexpr int kCols = T * kWords;  // (token, word) columns; threads past them only join the barriers
  constexpr int kColsPerThread = (kCols + 127) / 128;
  constexpr int kSplit = lanes_per_column(kCols);  // lanes sharing a column's head sum
  constexpr int kHeads = H / kSplit;
  static_assert(kSplit <= 32 && kHeads * kSplit == H, "bad split");
  using Sw = ptx::SwizzleMode<D>;

  float r[kColsPerThread][4];
  int tok[kColsPerThread], word[kColsPerThread];
  bool active[kColsPerThread];
#pragma unroll
  for (int cc = 0; cc < kColsPerThread; ++cc) {
    const int col = kSplit == 1 ? tid + 128 * cc : tid / kSplit;
    active[cc] = col < kCols;
    tok[cc] = active[cc] ? col / kWords : 0;
    word[cc] = col % kWords;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (active[cc] && tok[cc] < num_valid) {
      const int h0 = (tid % kSplit) * kHeads;
#pragma unroll 8
      for (int hh = 0; hh < kHeads; ++hh) {
        const int row = tok[cc] * H + h0 + hh;
        const uint32_t bits = *reinterpret_cast<const uint32_t*>(q + Sw::swizzle(row * D + 4 * word[cc]));
        const float wt = w[tok[cc] * H + h0 + hh];
        const float4 f = ptx::e4m3x4_to_float4(bits);
        v.x = fmaf(wt, f.x, v.x);
        v.y = fmaf(wt, f.y, v.y);
        v.z = fmaf(wt, f.z, v.z);
        v.w = fmaf(wt, f.w, v.w);
      }
    }
#pragma unroll
    for (int m = 1; m < kSplit; m <<= 1) {
      v.x += __shfl_xor_sync(0xffffffffu, v.x, m);
      v.y += __shfl_xor_sync(0xffffffffu, v.y, m);
      v.z += __shfl_xor_sync(0xffffffffu, v.z, m);
      v.w += __shfl_xor_sync(0xffffffffu, v.w, m);
    }
    r[cc][0] = v.x;
    r[cc][1] = v.y;
    r[cc][2] = v.z;
    r[cc][3] = v.w;
  }
  const bool writer = kSplit == 1 || tid % kSplit == 0;
  if (tid < T * kPieces) amax[tid] = 0u;
  ptx::named_barrier_sync(barrier_id, 128);
#pragma unroll
  for (int p = 0; p < kPieces; ++p) {
#pragma unroll
    for (int cc = 0; cc < kColsPerThread; ++cc) {
      const float m = fmaxf(fmaxf(fabsf(r[cc][0]), fabsf(r[cc][1])), fmaxf(fabsf(r[cc][2]), fabsf(r[cc][3])));
      if (writer && active[cc] && m > 0.0f)  // non-negative floats: the bits order like the values
        atomicMax(amax + tok[cc] * kPieces + p, __float_as_uint(m));
    }
    ptx::named_barrier_sync(barrier_id, 128);
#pragma unroll
    for (int cc = 0; cc < kColsPerThread; ++cc) {
      const float m = __uint_as_float(amax[tok[cc] * kPieces + p]);
      const float inv = m > 0.0f ? kE4M3Max / m : 0.0f;
      const float sigma = piece_scale(amax[tok[cc] * kPieces + p]);
      const uint32_t bits =
          ptx::float4_to_e4m3x4(make_float4(r[cc][0] * inv, r[cc][1] * inv, r[cc][2] * inv, r[cc][3] * inv));
      const float4 back = ptx::e4m3x4_to_float4(bits);
      r[cc][0] = fmaf(-sigma, back.x, r[cc][0]);
      r[cc][1] = fmaf(-sigma, back.y, r[cc][1]);
      r[cc][2] = fmaf(-sigma, back.z, r[cc][2]);
      r[cc][3] = fmaf(-sigma, back.w, r[cc][3]);
      const int row = 8 * (tok[cc] / 2) + 2 * p + tok[cc] % 2;
      if (writer && active[cc]) *reinterpret_cast<uint32_t*>(pieces + Sw::swizzle(row * D + 4 * word[cc])) = bits;
    }
  }
  ptx::fence_proxy_async();
  ptx::named_barrier_sync(barrier_id, 128);
}

}  // namespace deep_indexer::split_relu
