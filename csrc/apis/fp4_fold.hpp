// API entry of fp4_fold: FP4 rows -> (e4m3 values, base exponent) (docs/fp4.md; the torch form is
// deep_indexer.quant.fold_fp4_to_e4m3, which calls this on CUDA tensors).
#pragma once
#include <algorithm>
#include <optional>
#include <tuple>

#include "../impls/fp4_fold.hpp"
#include "../utils/checks.hpp"
#include "device.hpp"

namespace deep_indexer {

// codes uint8/int8 [rows, D / 2] (contiguous, 16-byte aligned start), sf int32 [rows] (contiguous)
// -> (vals float8_e4m3fn [rows, D], base int32 [rows]), freshly allocated. D in {32, 64, 96, 128}.
inline std::tuple<at::Tensor, at::Tensor> fp4_fold(const at::Tensor& codes, const at::Tensor& sf) {
  constexpr const char* op = "deep_indexer.fp4_fold";
  TensorCheck(op, codes, "codes").dtype_in({at::kByte, at::kChar}).ndim(2).contiguous();
  const int64_t rows = codes.size(0);
  const int64_t d = 2 * codes.size(1);
  DI_CHECK_ARG(d == 32 || d == 64 || d == 96 || d == 128,
               "{}: codes must be [rows, D / 2] with D in 32/64/96/128 (two e2m1 codes per byte), got shape {}", op,
               shape_str(codes.sizes()));
  TensorCheck(op, sf, "sf").dtype(at::kInt).shape({rows}).contiguous();
  TensorCheck(op, codes, "codes").aligned(16);
  TensorCheck(op, codes, "codes").cuda();
  TensorCheck(op, sf, "sf").on(codes.device());
  at::Tensor vals = at::empty({rows, d}, codes.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor base = at::empty({rows}, sf.options());
  if (rows == 0) return {vals, base};

  const OpDevice dev = op_device(codes);
  Fp4FoldRuntime::launch({static_cast<const uint8_t*>(codes.data_ptr()), sf.data_ptr<int>(),
                          static_cast<uint8_t*>(vals.data_ptr()), base.data_ptr<int>(), rows, static_cast<int>(d)},
                         dev.device, dev.stream);
  return {vals, base};
}

namespace fp4_detail {

// A validated FP4 operand: codes [*lead, D / 2] uint8 / int8 (copied when not contiguous or not 16-byte
// aligned), sf int32 [*lead] (contiguous), D in {32, 64, 128}.
struct Fp4Operand {
  at::Tensor codes, sf;
  int64_t rows;
  int head_dim;
};

inline Fp4Operand fp4_operand(const char* op, const at::Tensor& codes, const at::Tensor& sf, int64_t ndim,
                              const char* codes_name, const char* sf_name) {
  TensorCheck(op, codes, codes_name).dtype_in({at::kByte, at::kChar}).ndim(ndim);
  const int64_t d = 2 * codes.size(-1);
  DI_CHECK_ARG(Fp4FoldLayout::supported(static_cast<int>(d)),
               "{}: {} must have D / 2 bytes per row with D in 32/64/128 (two e2m1 codes per byte), got shape {}", op,
               codes_name, shape_str(codes.sizes()));
  TensorCheck(op, sf, sf_name).dtype(at::kInt);
  DI_CHECK_ARG(sf.sizes() == codes.sizes().slice(0, ndim - 1), "{}: {} must have shape {} (one scale word per row), got {}",
               op, sf_name, shape_str(codes.sizes().slice(0, ndim - 1)), shape_str(sf.sizes()));
  TensorCheck(op, codes, codes_name).cuda();
  TensorCheck(op, sf, sf_name).on(codes.device());
  const bool direct = codes.is_contiguous() && reinterpret_cast<uintptr_t>(codes.data_ptr()) % 16 == 0;
  return {direct ? codes : codes.clone(at::MemoryFormat::Contiguous), sf.contiguous(), codes.numel() / codes.size(-1),
          static_cast<int>(d)};
}

// `out` if given (checked: dtype, contiguous, device, aligned to `align` bytes, shape), else a fresh tensor.
inline at::Tensor fold_output(const char* op, const std::optional<at::Tensor>& out, const char* name,
                              at::IntArrayRef shape, at::ScalarType dtype, int64_t align, const at::Tensor& like) {
  if (!out.has_value()) return at::empty(shape, like.options().dtype(dtype));
  TensorCheck(op, *out, name).dtype(dtype).contiguous().on(like.device()).aligned(align);
  DI_CHECK_ARG(out->sizes() == shape, "{}: {} must have shape {}, got {}", op, name, shape_str(shape),
               shape_str(out->sizes()));
  return *out;
}

}  // namespace fp4_detail

// FP4 prefill operands -> the FP8 prefill kernel's inputs (deep_indexer.ops._prefill_inputs), both in one
// launch when their D match:
//   q: q_codes uint8/int8 [S, H, D / 2], q_sf int32 [S, H], weights float32/bfloat16/float16 [S, H] (any
//      strides) -> q e4m3 [S, H, D] and weights float32 [S, H] = weights * 2^(base - 127);
//   k: k_codes [SKV, D / 2], k_sf [SKV] -> k e4m3 [SKV, D] and k_scale float32 [SKV] = 2^(base - 127);
// base, the values and the products as quant.fold_fp4_to_e4m3 and weights.float() * exp2_int(base), bit for
// bit. An absent operand (codes None) gives None outputs. The *_out tensors (optional) receive the outputs.
using OptTensor = std::optional<at::Tensor>;
inline std::tuple<OptTensor, OptTensor, OptTensor, OptTensor> fp4_prefill_fold(
    const OptTensor& q_codes, const OptTensor& q_sf, const OptTensor& weights, const OptTensor& k_codes,
    const OptTensor& k_sf, const OptTensor& q_out, const OptTensor& weights_out, const OptTensor& k_out,
    const OptTensor& k_scale_out) {
  constexpr const char* op = "deep_indexer.fp4_prefill_fold";
  DI_CHECK_ARG(q_codes.has_value() == q_sf.has_value() && k_codes.has_value() == k_sf.has_value(),
               "{}: pass both codes and scale words of an operand, or neither", op);
  OptTensor q8, w8, k8, ks8;
  Fp4FoldOperand qa{}, ka{};
  int q_dim = 0, k_dim = 0;
  std::optional<at::Tensor> like;
  if (q_codes.has_value()) {
    const fp4_detail::Fp4Operand q = fp4_detail::fp4_operand(op, *q_codes, *q_sf, 3, "q_codes", "q_sf");
    DI_CHECK_ARG(weights.has_value(), "{}: an FP4 q needs its weights", op);
    const int64_t S = q_codes->size(0), H = q_codes->size(1);
    TensorCheck(op, *weights, "weights").dtype_in({at::kFloat, at::kBFloat16, at::kHalf}).shape({S, H});
    TensorCheck(op, *weights, "weights").on(q.codes.device());
    q8 = fp4_detail::fold_output(op, q_out, "q_out", {S, H, q.head_dim}, at::kFloat8_e4m3fn, 16, q.codes);
    w8 = fp4_detail::fold_output(op, weights_out, "weights_out", {S, H}, at::kFloat, 4, q.codes);
    const at::ScalarType wt = weights->scalar_type();
    qa = {static_cast<const uint8_t*>(q.codes.data_ptr()), q.sf.data_ptr<int>(), static_cast<uint8_t*>(q8->data_ptr()),
          w8->data_ptr<float>(), weights->data_ptr(), weights->stride(0), weights->stride(1), q.rows,
          static_cast<int>(std::max<int64_t>(H, 1)), wt == at::kFloat ? 0 : (wt == at::kBFloat16 ? 1 : 2), 0};
    q_dim = q.head_dim;
    like = q.codes;
  }
  if (k_codes.has_value()) {
    const fp4_detail::Fp4Operand k = fp4_detail::fp4_operand(op, *k_codes, *k_sf, 2, "k_codes", "k_sf");
    if (like.has_value()) TensorCheck(op, k.codes, "k_codes").on(like->device());
    k8 = fp4_detail::fold_output(op, k_out, "k_out", {k.rows, k.head_dim}, at::kFloat8_e4m3fn, 16, k.codes);
    ks8 = fp4_detail::fold_output(op, k_scale_out, "k_scale_out", {k.rows}, at::kFloat, 4, k.codes);
    ka = {static_cast<const uint8_t*>(k.codes.data_ptr()), k.sf.data_ptr<int>(), static_cast<uint8_t*>(k8->data_ptr()),
          ks8->data_ptr<float>(), nullptr, 0, 0, k.rows, 1, 0, 0};
    k_dim = k.head_dim;
    if (!like.has_value()) like = k.codes;
  }
  if (qa.rows + ka.rows == 0) return {q8, w8, k8, ks8};
  const OpDevice dev = op_device(*like);
  if (q_dim == k_dim || qa.rows == 0 || ka.rows == 0) {  // one launch
    Fp4PrefillFoldRuntime::launch(qa, ka, qa.rows > 0 ? q_dim : k_dim, dev.device, dev.stream);
  } else {  // (the prefill kernel then rejects the mismatch)
    Fp4PrefillFoldRuntime::launch(qa, Fp4FoldOperand{}, q_dim, dev.device, dev.stream);
    Fp4PrefillFoldRuntime::launch(Fp4FoldOperand{}, ka, k_dim, dev.device, dev.stream);
  }
  return {q8, w8, k8, ks8};
}

}  // namespace deep_indexer
