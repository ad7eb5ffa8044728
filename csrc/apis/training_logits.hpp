// API entry of the training kernels: bf16 indexer logits forward (deep_indexer.training, backend="sm90").
#pragma once
#include <climits>

#include "../impls/training_logits.hpp"
#include "../utils/checks.hpp"
#include "device.hpp"

namespace deep_indexer {

// Writes logits[t, s] for max(ks[t], 0) <= s < min(ke[t], N) into `out` (other entries untouched) and
// returns it. q [T, H, D] bf16, k [N, D] bf16, weights [T, H] fp32 (unit inner stride), ks/ke [T] int32,
// out [T, N] fp32 (unit inner stride).
inline at::Tensor bf16_indexer_logits(const at::Tensor& q, const at::Tensor& k, const at::Tensor& weights,
                                      const at::Tensor& ks, const at::Tensor& ke, const at::Tensor& out) {
  constexpr const char* op = "deep_indexer.training.indexer_logits";
  TensorCheck(op, q, "q_I").dtype(at::kBFloat16).ndim(3).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  DI_CHECK_ARG(TrainingLogitsLayout::supported_shape(static_cast<int>(H), static_cast<int>(D)),
               "{}: q_I has {} heads of dim {}; the sm90 kernel supports heads 16/32/64/128, dims 64/128", op, H, D);
  TensorCheck(op, k, "k_I").dtype(at::kBFloat16).shape({TensorCheck::kAny, D}).contiguous();
  const int64_t N = k.size(0);
  DI_CHECK_ARG(N < INT_MAX - 64 && T < INT_MAX / 128, "{}: at most 2^31 - 64 keys and 2^24 tokens, got {} and {}", op,
               N, T);
  TensorCheck(op, weights, "weights").dtype(at::kFloat).shape({T, H}).row_major_2d();
  TensorCheck(op, ks, "ks").dtype(at::kInt).shape({T}).contiguous();
  TensorCheck(op, ke, "ke").dtype(at::kInt).shape({T}).contiguous();
  TensorCheck(op, out, "out").dtype(at::kFloat).shape({T, N}).row_major_2d();
  TensorCheck(op, q, "q_I").cuda();
  for (auto [t, name] : {std::pair{&k, "k_I"}, {&weights, "weights"}, {&ks, "ks"}, {&ke, "ke"}, {&out, "out"}})
    TensorCheck(op, *t, name).on(q.device());
  if (T == 0 || N == 0) return out;
  TensorCheck(op, q, "q_I").aligned(16);
  TensorCheck(op, k, "k_I").aligned(16);
  const OpDevice dev = op_device(q);
  TrainingLogitsRuntime::launch({{static_cast<int>(H), static_cast<int>(D)}, q.data_ptr(), k.data_ptr(),
                                 weights.data_ptr<float>(), weights.stride(0), ks.data_ptr<int>(), ke.data_ptr<int>(),
                                 out.data_ptr<float>(), out.stride(0), static_cast<int>(T), static_cast<int>(N)},
                                dev.device, dev.stream);
  return out;
}

}  // namespace deep_indexer
