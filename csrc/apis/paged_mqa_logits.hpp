// API entries of get_paged_mqa_logits_metadata and fp8_paged_mqa_logits (docs/api.md).
#pragma once
#include <ATen/ops/empty.h>

#include <climits>
#include <optional>

#include "../impls/paged_mqa_logits.hpp"
#include "mqa_logits.hpp"

namespace deep_indexer {

constexpr int kMaxPagedNextN = PagedMqaLogitsLayout::kMaxNextN;

// Shared checks of context_lens: int32 [B] or [B, next_n] (next_n <= 8), contiguous. Returns next_n
// of the 2-D form (1 for 1-D).
inline int check_context_lens(const char* op, const at::Tensor& context_lens, int64_t batch) {
  TensorCheck(op, context_lens, "context_lens").dtype(at::kInt).contiguous();
  DI_CHECK_ARG(context_lens.dim() == 1 || context_lens.dim() == 2,
               "{}: context_lens must be [B] or [B, next_n], got shape {}", op, shape_str(context_lens.sizes()));
  if (batch >= 0)
    DI_CHECK_ARG(context_lens.size(0) == batch, "{}: context_lens must have {} rows (the batch of q), got {}", op,
                 batch, context_lens.size(0));
  const int64_t width = context_lens.dim() == 2 ? context_lens.size(1) : 1;
  DI_CHECK_ARG(width >= 1 && width <= kMaxPagedNextN, "{}: context_lens [B, next_n] needs 1 <= next_n <= {}, got {}",
               op, kMaxPagedNextN, width);
  return static_cast<int>(width);
}

// Varlen request ids: int32 [R] (R = rows of context_lens), contiguous; context_lens must then hold one
// length per row ([R] or [R, 1]). Id values are only compared for equality. (Device: checked by the caller.)
inline void check_indices(const char* op, const std::optional<at::Tensor>& indices, const at::Tensor& context_lens) {
  if (!indices.has_value()) return;
  TensorCheck(op, *indices, "indices").dtype(at::kInt).ndim(1).contiguous();
  DI_CHECK_ARG(indices->size(0) == context_lens.size(0),
               "{}: indices must be [R] with R = {} (one request id per q row), got shape {}", op,
               context_lens.size(0), shape_str(indices->sizes()));
  DI_CHECK_ARG(context_lens.dim() == 1 || context_lens.size(1) == 1,
               "{}: with indices, context_lens must be [R] or [R, 1] (one length per q row), got shape {}", op,
               shape_str(context_lens.sizes()));
}

// With indices (varlen) every q row is scheduled as a sequence of its own length: the same work split
// as without them (rows of one run share KV blocks, which the L2 serves).
inline at::Tensor get_paged_mqa_logits_metadata(const at::Tensor& context_lens, int64_t block_kv,
                                                std::optional<int64_t> num_sms,
                                                const std::optional<at::Tensor>& out,
                                                const std::optional<at::Tensor>& indices = std::nullopt) {
  constexpr const char* op = "deep_indexer.get_paged_mqa_logits_metadata";
  const int width = check_context_lens(op, context_lens, -1);
  DI_CHECK_ARG(block_kv == 32 || block_kv == 64, "{}: block_kv must be 32 or 64, got {}", op, block_kv);
  const int64_t batch = context_lens.size(0);
  DI_CHECK_ARG(batch < INT_MAX, "{}: batch too large ({})", op, batch);
  check_indices(op, indices, context_lens);
  TensorCheck(op, context_lens, "context_lens").cuda();
  if (indices.has_value()) TensorCheck(op, *indices, "indices").on(context_lens.device());
  const OpDevice dev = op_device(context_lens);
  const int64_t sms = num_sms.value_or(dev.num_sms);
  DI_CHECK_ARG(sms >= 1 && sms <= 65536, "{}: num_sms must be in [1, 65536], got {}", op, sms);
  at::Tensor schedule;
  if (out.has_value()) {
    TensorCheck(op, *out, "out").dtype(at::kInt).shape({sms + 1, 2}).contiguous().on(context_lens.device());
    schedule = *out;
  } else {
    schedule = at::empty({sms + 1, 2}, context_lens.options());
  }
  PagedMqaMetadataRuntime::launch({width, sm90::paged_mqa_metadata_small(batch)}, context_lens.data_ptr<int>(),
                                  static_cast<int>(batch),
                                  static_cast<int>(sms), schedule.data_ptr<int>(), dev.device, dev.stream);
  return schedule;
}

inline at::Tensor fp8_paged_mqa_logits(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& weights,
                                       const at::Tensor& context_lens, const at::Tensor& block_table,
                                       const at::Tensor& schedule, int64_t max_context_len, bool clean_logits,
                                       int64_t elem_bytes, const std::optional<at::Tensor>& out,
                                       const std::optional<at::Tensor>& indices = std::nullopt,
                                       const std::optional<at::Tensor>& q_sf = std::nullopt) {
  constexpr const char* op = "deep_indexer.fp8_paged_mqa_logits";
  // q: e4m3 [B, next_n, H, D], or FP4 codes uint8 [B, next_n, H, D / 2] with q_sf int32 [B, next_n, H].
  const bool q_fp4 = q_sf.has_value();
  if (q_fp4) {
    TensorCheck(op, q, "q (FP4 codes, with q_sf)").dtype(at::kByte).ndim(4).contiguous();
    TensorCheck(op, *q_sf, "q_sf").dtype(at::kInt).shape({q.size(0), q.size(1), q.size(2)}).contiguous();
  } else {
    TensorCheck(op, q, "q").dtype(at::kFloat8_e4m3fn).ndim(4).contiguous();
  }
  const int64_t B = q.size(0), next_n = q.size(1), H = q.size(2), D = q.size(3) * (q_fp4 ? 2 : 1);
  DI_CHECK_ARG(next_n >= 1 && next_n <= kMaxPagedNextN,
               "{}: q must be [B, next_n, H, D] with 1 <= next_n <= {}, got next_n = {}", op, kMaxPagedNextN, next_n);
  DI_CHECK_ARG(!indices.has_value() || next_n == 1,
               "{}: with indices (varlen), q must be [R, 1, H, D] (one row per request token), got next_n = {}", op,
               next_n);
  DI_CHECK_ARG((H == 16 || H == 32 || H == 64 || H == 128) && (D == 64 || D == 128),
               "{}: q has {} heads of dim {}; supported: heads 16/32/64/128, dims 64/128", op, H, D);
  DI_CHECK_ARG(B * next_n * H < INT_MAX, "{}: q has {} rows (B * next_n * H); at most 2^31 - 1 are supported", op,
               B * next_n * H);
  // The cache's row bytes tell its format: D + 4 (e4m3 keys, fp32 scales) or D / 2 + 4 (FP4 codes, scale words).
  TensorCheck(op, kv_cache, "kv_cache").dtype(at::kByte).ndim(4);
  const int64_t row_bytes = kv_cache.size(3);
  DI_CHECK_ARG(kv_cache.size(2) == 1 && (row_bytes == D + 4 || row_bytes == D / 2 + 4),
               "{}: kv_cache must be [num_blocks, block_kv, 1, {}] (FP8) or [num_blocks, block_kv, 1, {}] (FP4) for "
               "head_dim {}, got shape {}",
               op, D + 4, D / 2 + 4, D, shape_str(kv_cache.sizes()));
  const bool kv_fp4 = row_bytes == D / 2 + 4;
  const int64_t num_blocks = kv_cache.size(0), block_kv = kv_cache.size(1);
  DI_CHECK_ARG(block_kv == 32 || block_kv == 64, "{}: kv_cache blocks must hold 32 or 64 tokens, got {}", op, block_kv);
  DI_CHECK_ARG(kv_cache.stride(3) == 1 && kv_cache.stride(1) == row_bytes &&
                   kv_cache.stride(0) >= block_kv * row_bytes && kv_cache.stride(0) % 16 == 0,
               "{}: kv_cache must be contiguous inside each block with a block stride >= {} bytes and a multiple of "
               "16, got strides {}",
               op, block_kv * row_bytes, shape_str(kv_cache.strides()));
  TensorCheck(op, weights, "weights").dtype(at::kFloat).shape({B * next_n, H}).row_major_2d();
  // The kernel bulk-copies each weights row into shared memory: rows must start 16-byte aligned.
  DI_CHECK_ARG(weights.size(0) <= 1 || weights.stride(0) % 4 == 0,
               "{}: weights row stride must be a multiple of 4 elements (16 bytes), got {}", op, weights.stride(0));
  const int width = check_context_lens(op, context_lens, B);
  DI_CHECK_ARG(context_lens.dim() == 1 || width == next_n,
               "{}: context_lens [B, next_n] must have next_n = {} (from q), got {}", op, next_n, width);
  TensorCheck(op, block_table, "block_table").dtype(at::kInt).ndim(2).row_major_2d();
  DI_CHECK_ARG(block_table.size(0) == B, "{}: block_table must have {} rows (the batch of q), got {}", op, B,
               block_table.size(0));
  TensorCheck(op, schedule, "schedule_meta").dtype(at::kInt).ndim(2).contiguous();
  DI_CHECK_ARG(schedule.size(1) == 2 && schedule.size(0) >= 2,
               "{}: schedule_meta must be [num_sms + 1, 2] (from get_paged_mqa_logits_metadata), got {}", op,
               shape_str(schedule.sizes()));
  DI_CHECK_ARG(max_context_len >= 0 && max_context_len < INT_MAX, "{}: max_context_len must be in [0, 2^31), got {}",
               op, max_context_len);
  DI_CHECK_ARG(elem_bytes == 4 || elem_bytes == 2, "{}: logits_dtype must be float32 or bfloat16", op);
  check_indices(op, indices, context_lens);
  check_out(op, out, B * next_n, max_context_len, static_cast<int>(elem_bytes));
  TensorCheck(op, q, "q").cuda();
  for (auto [t, name] : {std::pair{&kv_cache, "kv_cache"}, {&weights, "weights"}, {&context_lens, "context_lens"},
                         {&block_table, "block_table"}, {&schedule, "schedule_meta"}})
    TensorCheck(op, *t, name).on(q.device());
  if (indices.has_value()) TensorCheck(op, *indices, "indices").on(q.device());
  if (q_fp4) TensorCheck(op, *q_sf, "q_sf").on(q.device());
  at::Tensor logits = logits_output(op, out, B * next_n, max_context_len, static_cast<int>(elem_bytes), q);
  if (B == 0 || max_context_len == 0) return logits;
  TensorCheck(op, q, "q").aligned(16);
  TensorCheck(op, kv_cache, "kv_cache").aligned(16);
  TensorCheck(op, weights, "weights").aligned(16);
  if (q_fp4) TensorCheck(op, *q_sf, "q_sf").aligned(16);

  const OpDevice dev = op_device(q);
  const PagedMqaLogitsRuntime::Params params{static_cast<int>(next_n), static_cast<int>(H), static_cast<int>(D),
                                             static_cast<int>(block_kv), static_cast<int>(elem_bytes),
                                             context_lens.dim() == 2, indices.has_value(), q_fp4, kv_fp4};
  PagedMqaLogitsRuntime::launch(
      {params, q.data_ptr(), q_fp4 ? q_sf->data_ptr<int>() : nullptr, kv_cache.data_ptr<uint8_t>(), num_blocks, kv_cache.stride(0), weights.data_ptr<float>(),
       weights.stride(0), context_lens.data_ptr<int>(), block_table.data_ptr<int>(), block_table.stride(0),
       static_cast<int>(std::min<int64_t>(block_table.size(1), INT_MAX)), schedule.data_ptr<int>(),
       static_cast<int>(schedule.size(0) - 1), logits.data_ptr(), logits.stride(0), static_cast<int>(B),
       static_cast<int>(max_context_len), indices.has_value() ? indices->data_ptr<int>() : nullptr},
      dev.device, dev.stream);
  if (clean_logits) {
    // [B] lengths: row (b, i) keeps j < ctx[b] - next_n + i + 1 (clean_logits' next_n grouping);
    // [B, next_n] lengths: row r keeps j < ctx.flatten()[r] (grouping of 1).
    const bool two_d = context_lens.dim() == 2;
    CleanLogitsRuntime::launch({logits.data_ptr(), static_cast<int>(elem_bytes), logits.stride(0), B * next_n,
                                static_cast<int>(max_context_len), two_d ? 1 : static_cast<int>(next_n), nullptr,
                                context_lens.data_ptr<int>()},
                               dev.device, dev.stream);
  }
  return logits;
}

}  // namespace deep_indexer
