// Host launcher for the reference implementation's SM90 prefill logits kernel (DeepGEMM's
// sm90_fp8_mqa_logits + smxx_clean_logits), for side-by-side timing only (tools/deepgemm_ref.py).
// The kernels come from DeepGEMM's headers, which are not part of this repository: point
// DG_INCLUDE at a `deep_gemm/include` directory (e.g. from an sgl-kernel wheel) and build with
//   nvcc -gencode arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr -shared -Xcompiler -fPIC \
//        -I$DG_INCLUDE tools/deepgemm_ref.cu -o .whl/deepgemm_ref.so
// NOTES: the launch configuration is the reference's SM90 one: 128 query-head rows per block
// (BLOCK_Q = 128 / H), BLOCK_KV = 256 with 512 math threads + 128 TMA threads, 3 Q and 3 KV
// stages, one persistent CTA per SM; logits rows need a stride of at least SKV + 256 (the kernel
// stores whole KV blocks) and S rounded up to BLOCK_Q rows.
#include <cuda.h>
#include <cuda_runtime.h>

#include <deep_gemm/impls/sm90_fp8_mqa_logits.cuh>
// NOTES: both headers declare an `extern __shared__ smem_buffer` of different types in one
// namespace; the clean kernel goes in its own (its includes were all seen above).
namespace dg_clean {
#include <deep_gemm/impls/smxx_clean_logits.cuh>
}

namespace {

constexpr uint32_t kBlockQH = 128, kBlockKV = 256, kStages = 3, kTmaThreads = 128, kMathThreads = 512;

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeFn encode_fn() {
  static EncodeFn fn = nullptr;
  if (fn == nullptr) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeFn>(p);
  }
  return fn;
}

// A 2-D row-major tensor [outer, inner] with a row stride in elements, box [box_outer, box_inner].
int make_desc(CUtensorMap* m, CUtensorMapDataType dt, uint32_t elem, void* ptr, uint64_t inner, uint64_t outer,
              uint64_t stride, uint32_t box_inner, uint32_t box_outer, uint32_t swizzle_bytes) {
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {stride * elem};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t estr[2] = {1, 1};
  const CUtensorMapSwizzle sw = swizzle_bytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                : swizzle_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                : swizzle_bytes == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                      : CU_TENSOR_MAP_SWIZZLE_NONE;
  EncodeFn fn = encode_fn();
  if (fn == nullptr) return -1;
  return fn(m, dt, 2, ptr, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS
             ? 0
             : -2;
}

template <uint32_t H, uint32_t D>
int launch(uint32_t S, uint32_t SKV, uint64_t stride, void* q, void* kv, void* kv_scales, void* weights, uint32_t* ks,
           uint32_t* ke, float* logits, int num_sms, cudaStream_t stream) {
  constexpr uint32_t kBlockQ = kBlockQH / H;
  auto kernel = &deep_gemm::sm90_fp8_mqa_logits<H, D, false, kBlockQ, kBlockKV, kStages, kStages, kTmaThreads,
                                                kMathThreads>;
  CUtensorMap tq, tkv, tsc, tw;
  int rc = make_desc(&tq, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, q, D, uint64_t(S) * H, D, D, kBlockQH, D);
  rc = rc ? rc : make_desc(&tkv, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, kv, D, SKV, D, D, kBlockKV, D);
  const uint64_t sc_inner = (SKV + 3) / 4 * 4;
  rc = rc ? rc : make_desc(&tsc, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, kv_scales, sc_inner, 1, sc_inner, kBlockKV, 1, 0);
  rc = rc ? rc : make_desc(&tw, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, weights, H, S, H, H, kBlockQ, 0);
  if (rc) return rc;
  constexpr uint32_t smem = kStages * (kBlockQ * H * D + kBlockQ * H * 4) + kStages * (kBlockKV * D + kBlockKV * 4) +
                            (kStages * 4) * 8;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return -3;
  kernel<<<num_sms, kTmaThreads + kMathThreads, smem, stream>>>(S, SKV, 0, stride, ks, ke, logits, tq, tkv, tsc, tw);
  return cudaGetLastError() == cudaSuccess ? 0 : -4;
}

}  // namespace

extern "C" {

// q fp8 [S, H, D], kv fp8 [SKV, D], kv_scales fp32 [SKV], weights fp32 [S, H], ks/ke int32 [S],
// logits fp32 [>= round_up(S, 128 / H), stride]. Returns 0, or < 0 on a launch error, 1 for an
// unsupported H / D.
int dg_mqa_logits(uint32_t H, uint32_t D, uint32_t S, uint32_t SKV, uint64_t stride, void* q, void* kv,
                  void* kv_scales, void* weights, void* ks, void* ke, void* logits, int num_sms, void* stream) {
  auto* s = static_cast<cudaStream_t>(stream);
  auto* a = static_cast<uint32_t*>(ks);
  auto* b = static_cast<uint32_t*>(ke);
  auto* l = static_cast<float*>(logits);
#define DG_CASE(h, d) \
  if (H == h && D == d) return launch<h, d>(S, SKV, stride, q, kv, kv_scales, weights, a, b, l, num_sms, s);
  DG_CASE(32, 64) DG_CASE(32, 128) DG_CASE(64, 64) DG_CASE(64, 128)
#undef DG_CASE
  return 1;
}

// -inf outside [ks, ke) of each row's first SKV columns (the reference's clean_logits=True pass).
int dg_clean_logits(uint32_t S, uint32_t SKV, uint64_t stride, void* ks, void* ke, void* logits, int num_sms,
                    void* stream) {
  constexpr uint32_t kCleanBlock = 8192, kWarps = 8;
  auto kernel = &dg_clean::deep_gemm::smxx_clean_logits<1, kCleanBlock, kWarps>;
  constexpr uint32_t smem = kCleanBlock * 4;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return -3;
  kernel<<<num_sms, kWarps * 32, smem, static_cast<cudaStream_t>(stream)>>>(
      S, SKV, stride, static_cast<uint32_t*>(ks), static_cast<uint32_t*>(ke), static_cast<float*>(logits));
  return cudaGetLastError() == cudaSuccess ? 0 : -4;
}

}  // extern "C"
