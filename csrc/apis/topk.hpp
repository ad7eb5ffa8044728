// API entry of topk_indices (docs/topk.md).
#pragma once
#include <ATen/ops/empty.h>

#include <climits>
#include <optional>
#include <string>
#include <vector>

#include "../impls/topk.hpp"
#include "../utils/checks.hpp"
#include "device.hpp"

namespace deep_indexer {

inline std::vector<at::Tensor> topk_indices(const at::Tensor& logits, int64_t k, const std::optional<at::Tensor>& ks,
                                            const std::optional<at::Tensor>& ke,
                                            const std::optional<at::Tensor>& context_lens, int64_t next_n, bool sorted,
                                            const std::string& index_mode,
                                            const std::optional<at::Tensor>& block_table, int64_t block_size,
                                            const std::optional<at::Tensor>& row_offset, bool return_values,
                                            const std::optional<at::Tensor>& out,
                                            const std::optional<at::Tensor>& out_values,
                                            const std::optional<at::Tensor>& indices = std::nullopt) {
  constexpr const char* op = "deep_indexer.topk_indices";
  TensorCheck(op, logits, "logits").dtype_in({at::kFloat, at::kBFloat16}).ndim(2).row_major_2d();
  DI_CHECK_ARG(k >= 1 && k <= TopkLayout::kMaxK, "{}: k must be in [1, {}], got {}", op, TopkLayout::kMaxK, k);
  DI_CHECK_ARG(next_n >= 1, "{}: next_n must be >= 1, got {}", op, next_n);
  const int64_t m = logits.size(0), n = logits.size(1);
  DI_CHECK_ARG(m % next_n == 0, "{}: logits has {} rows, not a multiple of next_n = {}", op, m, next_n);
  // columns: vector indices times 16 bytes stay in int (the kernel's column arithmetic)
  DI_CHECK_ARG(n <= INT_MAX - 64, "{}: logits has {} columns; at most {} are supported", op, n, INT_MAX - 64);
  DI_CHECK_ARG(m <= INT_MAX - (1 << 20), "{}: logits has {} rows; at most {} are supported", op, m, INT_MAX - (1 << 20));
  const int64_t groups = m / next_n;

  // Row ranges: (ks, ke) grouped by next_n, context_lens [B] (the same grouping, ks = 0) or
  // context_lens [B, next_n] (one end per row).
  const at::Tensor* ends = nullptr;
  int range_next_n = static_cast<int>(next_n);
  if (context_lens.has_value()) {
    DI_CHECK_ARG(!ks.has_value() && !ke.has_value(),
                 "{}: pass either context_lens or cu_seq_len_k_start/cu_seq_len_k_end, not both", op);
    TensorCheck(op, *context_lens, "context_lens").dtype(at::kInt).contiguous();
    if (context_lens->dim() == 2) {
      TensorCheck(op, *context_lens, "context_lens").shape({groups, next_n});
      range_next_n = 1;
    } else {
      TensorCheck(op, *context_lens, "context_lens").shape({groups});
    }
    ends = &*context_lens;
  } else {
    DI_CHECK_ARG(ke.has_value(), "{}: cu_seq_len_k_end (or context_lens) is required", op);
    TensorCheck(op, *ke, "cu_seq_len_k_end").dtype(at::kInt).shape({groups}).contiguous();
    if (ks.has_value()) TensorCheck(op, *ks, "cu_seq_len_k_start").dtype(at::kInt).shape({groups}).contiguous();
    ends = &*ke;
  }

  TopkIndexMode mode;
  if (index_mode == "relative") mode = TopkIndexMode::kRelative;
  else if (index_mode == "absolute") mode = TopkIndexMode::kAbsolute;
  else if (index_mode == "slot") mode = TopkIndexMode::kSlot;
  else throw DIValueError(fmt::format("{}: index_mode must be 'relative', 'absolute' or 'slot', got '{}'", op, index_mode));
  if (mode == TopkIndexMode::kSlot) {
    DI_CHECK_ARG(block_table.has_value(), "{}: index_mode='slot' needs block_table", op);
    DI_CHECK_ARG(block_size >= 1 && block_size < INT_MAX, "{}: index_mode='slot' needs block_size >= 1, got {}", op,
                 block_size);
    TensorCheck(op, *block_table, "block_table").dtype(at::kInt).ndim(2).shape({groups, -1}).unit_inner_stride();
    DI_CHECK_ARG(block_table->size(1) < INT_MAX, "{}: block_table has too many columns ({})", op, block_table->size(1));
  } else {
    DI_CHECK_ARG(!block_table.has_value(), "{}: block_table is only used with index_mode='slot' (got index_mode='{}')",
                 op, index_mode);
  }
  if (row_offset.has_value()) TensorCheck(op, *row_offset, "row_offset").dtype(at::kInt).shape({m}).contiguous();
  // Varlen request ids (one q row per request token): with index_mode='slot' a row's block-table row is
  // the first row of its run of equal ids.
  if (indices.has_value()) {
    DI_CHECK_ARG(next_n == 1, "{}: with indices (varlen) every row is its own sequence: next_n must be 1, got {}", op,
                 next_n);
    TensorCheck(op, *indices, "indices").dtype(at::kInt).shape({m}).contiguous();
  }
  if (out.has_value())
    TensorCheck(op, *out, "out").dtype(at::kInt).shape({m, k}).row_major_2d();
  DI_CHECK_ARG(!out_values.has_value() || return_values, "{}: out_values needs return_values=True", op);
  if (out_values.has_value())
    TensorCheck(op, *out_values, "out_values").dtype(logits.scalar_type()).shape({m, k}).row_major_2d();

  TensorCheck(op, logits, "logits").cuda();
  const c10::Device dev = logits.device();
  TensorCheck(op, *ends, context_lens.has_value() ? "context_lens" : "cu_seq_len_k_end").on(dev);
  if (ks.has_value()) TensorCheck(op, *ks, "cu_seq_len_k_start").on(dev);
  if (block_table.has_value()) TensorCheck(op, *block_table, "block_table").on(dev);
  if (row_offset.has_value()) TensorCheck(op, *row_offset, "row_offset").on(dev);
  if (indices.has_value()) TensorCheck(op, *indices, "indices").on(dev);
  if (out.has_value()) TensorCheck(op, *out, "out").on(dev);
  if (out_values.has_value()) TensorCheck(op, *out_values, "out_values").on(dev);

  at::Tensor idx = out.has_value() ? *out : at::empty({m, k}, logits.options().dtype(at::kInt));
  at::Tensor vals;
  if (return_values) vals = out_values.has_value() ? *out_values : at::empty({m, k}, logits.options());
  std::vector<at::Tensor> result{idx};
  if (return_values) result.push_back(vals);
  if (m == 0) return result;

  const OpDevice d = op_device(logits);
  TopkArgs args{};
  args.logits = logits.data_ptr();
  args.row_stride = logits.stride(0);
  args.num_rows = m;
  args.num_cols = static_cast<int>(n);
  args.range_next_n = range_next_n;
  args.table_next_n = static_cast<int>(next_n);
  args.ks = ks.has_value() ? ks->data_ptr<int>() : nullptr;
  args.ke = ends->data_ptr<int>();
  args.k = static_cast<int>(k);
  args.index_mode = static_cast<int>(mode);
  args.block_table = block_table.has_value() ? block_table->data_ptr<int>() : nullptr;
  args.indices = indices.has_value() ? indices->data_ptr<int>() : nullptr;
  args.table_stride = block_table.has_value() ? block_table->stride(0) : 0;
  args.table_cols = block_table.has_value() ? static_cast<int>(block_table->size(1)) : 0;
  args.block_size = static_cast<int>(block_size);
  args.block_shift = block_size >= 1 && (block_size & (block_size - 1)) == 0 ? __builtin_ctzll(block_size) : -1;
  args.row_offset = row_offset.has_value() ? row_offset->data_ptr<int>() : nullptr;
  args.out = idx.data_ptr<int>();
  args.out_stride = idx.stride(0);
  args.out_values = return_values ? vals.data_ptr() : nullptr;
  args.values_stride = return_values ? vals.stride(0) : 0;
  const bool rows_aligned = reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0 &&
                            (logits.stride(0) * logits.element_size()) % 16 == 0;
  launch_topk(static_cast<int>(logits.element_size()), sorted, rows_aligned, args, *d.info, d.num_sms, d.device,
              d.stream);
  return result;
}

}  // namespace deep_indexer
