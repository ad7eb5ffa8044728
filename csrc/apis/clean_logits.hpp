// API entry of clean_logits (docs/api.md).
#pragma once
#include <climits>
#include <optional>

#include "../impls/clean_logits.hpp"
#include "../utils/checks.hpp"
#include "device.hpp"

namespace deep_indexer {

inline at::Tensor clean_logits(const at::Tensor& logits, const std::optional<at::Tensor>& ks, const at::Tensor& ke,
                               int64_t next_n) {
  constexpr const char* op = "deep_indexer.clean_logits";
  TensorCheck(op, logits, "logits").dtype_in({at::kFloat, at::kBFloat16}).ndim(2).row_major_2d();
  DI_CHECK_ARG(next_n >= 1, "{}: next_n must be >= 1, got {}", op, next_n);
  DI_CHECK_ARG(logits.size(0) % next_n == 0, "{}: logits has {} rows, not a multiple of next_n = {}", op,
               logits.size(0), next_n);
  DI_CHECK_ARG(logits.size(1) < INT_MAX, "{}: logits has {} columns; at most {} are supported", op, logits.size(1),
               INT_MAX - 1);
  const int64_t groups = logits.size(0) / next_n;
  TensorCheck(op, ke, "cu_seq_len_k_end").dtype(at::kInt).shape({groups}).contiguous();
  if (ks.has_value()) TensorCheck(op, *ks, "cu_seq_len_k_start").dtype(at::kInt).shape({groups}).contiguous();
  TensorCheck(op, logits, "logits").cuda();
  TensorCheck(op, ke, "cu_seq_len_k_end").on(logits.device());
  if (ks.has_value()) TensorCheck(op, *ks, "cu_seq_len_k_start").on(logits.device());
  if (logits.numel() == 0) return logits;

  const OpDevice d = op_device(logits);
  CleanLogitsRuntime::launch({logits.data_ptr(), static_cast<int>(logits.element_size()), logits.stride(0),
                              logits.size(0), static_cast<int>(logits.size(1)), static_cast<int>(next_n),
                              ks.has_value() ? ks->data_ptr<int>() : nullptr, ke.data_ptr<int>()},
                             d.device, d.stream);
  return logits;
}

}  // namespace deep_indexer
