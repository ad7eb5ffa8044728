// API entry of the training kernels: bf16 indexer logits forward (deep_indexer.training, backend="sm90"),
// and the input checks every training entry shares (training_api).
#pragma once
#include <array>
#include <climits>

#include <deep_indexer/training/training_indexer_bwd_layout.hpp>

#include "../impls/training_logits.hpp"
#include "../utils/checks.hpp"
#include "device.hpp"
#include "mqa_logits.hpp"

namespace deep_indexer {

namespace training_api {

inline void check_rows(const char* op, int64_t T, int64_t row_begin, int64_t row_end) {
  DI_CHECK_ARG(0 <= row_begin && row_begin <= row_end && row_end <= T, "{}: rows [{}, {}) must lie in [0, {}]", op,
               row_begin, row_end, T);
}

inline void check_bounds(const char* op, const at::Tensor& ks, const at::Tensor& ke, int64_t T) {
  TensorCheck(op, ks, "ks").dtype(at::kInt).shape({T}).contiguous();
  TensorCheck(op, ke, "ke").dtype(at::kInt).shape({T}).contiguous();
}

// A chunk buffer [rows, >= N] fp32 (unit inner stride) covering rows [row_begin, row_end).
inline void check_chunk(const char* op, const at::Tensor& t, const char* name, int64_t rows, int64_t N) {
  TensorCheck(op, t, name).dtype(at::kFloat).ndim(2).row_major_2d();
  DI_CHECK_ARG(t.size(0) >= rows && t.size(1) >= N, "{}: {} must have at least {} rows and {} columns, got {}", op,
               name, rows, N, shape_str(t.sizes()));
}

// The sign mask of the indexer backward (int32 words, see training_indexer_bwd_layout.hpp): rows
// [row_begin - row0, row_end - row0) of a row-major [rows, words] tensor (16-byte aligned rows) covering
// `num_keys` keys.
inline void check_mask(const char* op, const at::Tensor& m, const char* name, int64_t row0, int64_t row_begin,
                       int64_t row_end, int64_t num_keys) {
  TensorCheck(op, m, name).dtype(at::kInt).ndim(2).row_major_2d().aligned(16);
  const int64_t words = TrainingIndexerBwdLayout::mask_words_per_row(num_keys);
  DI_CHECK_ARG(0 <= row0 && row0 <= row_begin, "{}: {}_row0 must be in [0, row_begin = {}], got {}", op, name,
               row_begin, row0);
  DI_CHECK_ARG(m.size(0) >= row_end - row0 && m.size(1) >= words && m.stride(0) % 4 == 0,
               "{}: {} must have at least {} rows and {} columns (a row stride a multiple of 4), got {} (stride {})",
               op, name, row_end - row0, words, shape_str(m.sizes()), m.stride(0));
}

// The indexer inputs of the training kernels: q_I [T, H, D] and k_I [N, D] bf16 (contiguous), weights
// [T, H] fp32 (unit inner stride), (H, D) a shape `Layout` supports (`supported`: its heads / dims for
// the message), N < 2^31 - key_margin, T < 2^24. Returns {T, H, D, N}.
template <typename Layout>
inline std::array<int64_t, 4> check_indexer_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& weights, const char* supported,
                                                    int64_t key_margin) {
  TensorCheck(op, q, "q_I").dtype(at::kBFloat16).ndim(3).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  DI_CHECK_ARG(Layout::supported_shape(static_cast<int>(H), static_cast<int>(D)),
               "{}: q_I has {} heads of dim {}; the sm90 kernel supports {}", op, H, D, supported);
  TensorCheck(op, k, "k_I").dtype(at::kBFloat16).shape({TensorCheck::kAny, D}).contiguous();
  const int64_t N = k.size(0);
  DI_CHECK_ARG(N < INT_MAX - key_margin && T < INT_MAX / 128, "{}: at most 2^31 - {} keys and 2^24 rows, got {} and {}",
               op, key_margin, N, T);
  TensorCheck(op, weights, "weights").dtype(at::kFloat).shape({T, H}).row_major_2d();
  return {T, H, D, N};
}

}  // namespace training_api

// Writes logits[t, s] for max(ks[t], 0) <= s < min(ke[t], N) into `out` and returns it; with `clean`
// every other entry of out becomes -inf, else it is left untouched. q [T, H, D] bf16, k [N, D] bf16,
// weights [T, H] fp32 (unit inner stride), ks/ke [T] int32, out [T, N] fp32 (unit inner stride).
// The kernel is the prefill one (mqa_logits.cuh) in its bf16 form.
inline at::Tensor bf16_indexer_logits(const at::Tensor& q, const at::Tensor& k, const at::Tensor& weights,
                                      const at::Tensor& ks, const at::Tensor& ke, const at::Tensor& out, bool clean) {
  constexpr const char* op = "deep_indexer.training.indexer_logits";
  const auto [T, H, D, N] = training_api::check_indexer_inputs<TrainingLogitsLayout>(
      op, q, k, weights, "heads 16/32/64/128, dims 64/128", 64);
  training_api::check_bounds(op, ks, ke, T);
  TensorCheck(op, out, "out").dtype(at::kFloat).shape({T, N}).row_major_2d();
  TensorCheck(op, q, "q_I").cuda();
  for (auto [t, name] : {std::pair{&k, "k_I"}, {&weights, "weights"}, {&ks, "ks"}, {&ke, "ke"}, {&out, "out"}})
    TensorCheck(op, *t, name).on(q.device());
  if (T == 0 || N == 0) return out;
  TensorCheck(op, q, "q_I").aligned(16);
  TensorCheck(op, k, "k_I").aligned(16);
  const OpDevice dev = op_device(q);
  const MqaLogitsRuntime::Params params{static_cast<int>(H), static_cast<int>(D), 4, 2};
  launch_mqa_logits({params, q.data_ptr(), k.data_ptr(), nullptr, weights.data_ptr(), weights.stride(0), false,
                     ks.data_ptr<int>(), ke.data_ptr<int>(), out.data_ptr(), out.stride(0), static_cast<int>(T),
                     static_cast<int>(N), 0, false},
                    clean, N, dev);
  return out;
}

}  // namespace deep_indexer
