// API entry of fp8_mqa_logits (docs/api.md).
#pragma once
#include <ATen/ops/empty_strided.h>

#include <climits>
#include <optional>

#include "../impls/clean_logits.hpp"
#include "../impls/mqa_logits.hpp"
#include "../utils/checks.hpp"
#include "device.hpp"

namespace deep_indexer {

// The prefill kernel and, with `clean`, the -inf outside each row's range: written by the kernel's idle
// producer warps when every SM gets a q block (sm90::mqa_logits_fused_clean), else by the clean kernel
// afterwards. `cols`: the logits' width (SKV, or max_seqlen_k when compressed). a.clean is set here.
inline void launch_mqa_logits(MqaLogitsRuntime::Args a, bool clean, int64_t cols, const OpDevice& dev) {
  a.clean = clean && sm90::mqa_logits_fused_clean(a.params.layout(), a.seq_len, dev.num_sms);
  MqaLogitsRuntime::launch(a, dev.device, dev.num_sms, dev.stream);
  if (clean && !a.clean)
    CleanLogitsRuntime::launch({a.logits, a.params.elem_bytes, a.logits_stride, a.seq_len, static_cast<int>(cols), 1,
                                a.ks, a.ke, a.max_seqlen_k > 0 ? a.seq_len_kv : 0},
                               dev.device, dev.stream);
}

inline at::ScalarType logits_scalar_type(int elem_bytes) { return elem_bytes == 4 ? at::kFloat : at::kBFloat16; }

inline void check_out(const char* op, const std::optional<at::Tensor>& out, int64_t rows, int64_t cols,
                      int elem_bytes) {
  if (out.has_value())
    TensorCheck(op, *out, "out").dtype(logits_scalar_type(elem_bytes)).shape({rows, cols}).row_major_2d();
}

// `out` if given (checked by check_out before), else a fresh [rows, cols] tensor with a padded row stride.
inline at::Tensor logits_output(const char* op, const std::optional<at::Tensor>& out, int64_t rows, int64_t cols,
                                int elem_bytes, const at::Tensor& like) {
  const at::ScalarType dtype = logits_scalar_type(elem_bytes);
  if (out.has_value()) {
    TensorCheck(op, *out, "out").on(like.device());
    return *out;
  }
  return at::empty_strided({rows, cols}, {sm90::padded_row_stride(cols, elem_bytes), 1}, like.options().dtype(dtype));
}

// max_seqlen_k = 0: logits [S, SKV], column j = key j. max_seqlen_k = M > 0 (compressed): logits
// [S, M], column j of row i = key max(ks[i], 0) + j for j < min(min(ke[i], SKV) - max(ks[i], 0), M);
// a longer row keeps its first M keys, and with clean_logits the columns past its length are -inf.
// weights: float32 or bfloat16 [S, H] (unit inner stride), read natively by the kernel.
inline at::Tensor fp8_mqa_logits(const at::Tensor& q, const at::Tensor& k, const at::Tensor& k_scale,
                                 const at::Tensor& weights, const at::Tensor& ks, const at::Tensor& ke,
                                 bool clean_logits, int64_t elem_bytes, const std::optional<at::Tensor>& out,
                                 int64_t max_seqlen_k = 0) {
  constexpr const char* op = "deep_indexer.fp8_mqa_logits";
  TensorCheck(op, q, "q").dtype(at::kFloat8_e4m3fn).ndim(3).contiguous();
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  DI_CHECK_ARG(MqaLogitsLayout::supported_shape(static_cast<int>(H), static_cast<int>(D)),
               "{}: q has {} heads of dim {}; supported: heads 16/32/64/128, dims 32/64/128", op, H, D);
  TensorCheck(op, k, "kv[0] (k)").dtype(at::kFloat8_e4m3fn).shape({TensorCheck::kAny, D}).contiguous();
  const int64_t SKV = k.size(0);
  DI_CHECK_ARG(SKV >= 1 && SKV < INT_MAX - 64, "{}: kv[0] (k) must have 1 <= SKV < 2^31 - 64 rows, got {}", op, SKV);
  DI_CHECK_ARG(S < INT_MAX / 128, "{}: q has {} tokens; at most {} are supported", op, S, INT_MAX / 128 - 1);
  TensorCheck(op, k_scale, "kv[1] (k_scale)").dtype(at::kFloat).shape({SKV}).contiguous();
  TensorCheck(op, weights, "weights").dtype_in({at::kFloat, at::kBFloat16}).shape({S, H}).row_major_2d();
  TensorCheck(op, ks, "cu_seq_len_k_start").dtype(at::kInt).shape({S}).contiguous();
  TensorCheck(op, ke, "cu_seq_len_k_end").dtype(at::kInt).shape({S}).contiguous();
  DI_CHECK_ARG(elem_bytes == 4 || elem_bytes == 2, "{}: logits_dtype must be float32 or bfloat16", op);
  DI_CHECK_ARG(max_seqlen_k >= 0 && max_seqlen_k < INT_MAX - 64,
               "{}: max_seqlen_k must be 0 (full-width logits) or in 1..{}, got {}", op, INT_MAX - 65, max_seqlen_k);
  const int64_t cols = max_seqlen_k > 0 ? max_seqlen_k : SKV;
  check_out(op, out, S, cols, static_cast<int>(elem_bytes));
  TensorCheck(op, q, "q").cuda();
  for (auto [t, name] : {std::pair{&k, "kv[0] (k)"}, {&k_scale, "kv[1] (k_scale)"}, {&weights, "weights"},
                         {&ks, "cu_seq_len_k_start"}, {&ke, "cu_seq_len_k_end"}})
    TensorCheck(op, *t, name).on(q.device());
  if (S > 0) {
    TensorCheck(op, q, "q").aligned(16);
    TensorCheck(op, k, "kv[0] (k)").aligned(16);
  }
  at::Tensor logits = logits_output(op, out, S, cols, static_cast<int>(elem_bytes), q);
  if (S == 0) return logits;

  const OpDevice dev = op_device(q);
  const MqaLogitsRuntime::Params params{static_cast<int>(H), static_cast<int>(D), static_cast<int>(elem_bytes)};
  launch_mqa_logits({params, q.data_ptr(), k.data_ptr(), k_scale.data_ptr<float>(), weights.data_ptr(),
                     weights.stride(0), weights.scalar_type() == at::kBFloat16, ks.data_ptr<int>(), ke.data_ptr<int>(),
                     logits.data_ptr(), logits.stride(0), static_cast<int>(S), static_cast<int>(SKV),
                     static_cast<int>(max_seqlen_k), false},
                    clean_logits, cols, dev);
  return logits;
}

}  // namespace deep_indexer
