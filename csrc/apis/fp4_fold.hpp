// API entry of fp4_fold: FP4 rows -> (e4m3 values, base exponent) (docs/fp4.md; the torch form is
// deep_indexer.quant.fold_fp4_to_e4m3, which calls this on CUDA tensors).
#pragma once
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

}  // namespace deep_indexer
