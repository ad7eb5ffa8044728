// API entries of the SM90 training kernels behind deep_indexer.training's fast path (training/sm90.py):
// the warm-up loss's `mean` target, the indexer side's forward statistics, and the indexer logits backward.
// Row indices are absolute (rows [row_begin, row_end) of the [T, ...] inputs); the chunk buffers p / dI are
// indexed by (t - row_begin). Shapes, dtypes and strides are checked before the device.
#pragma once
#include <ATen/ATen.h>

#include <climits>
#include <cmath>

#include "../impls/training_indexer_bwd.hpp"
#include "../impls/training_logits.hpp"
#include "../impls/training_per_head.hpp"
#include "../impls/training_target.hpp"
#include "../utils/checks.hpp"
#include "device.hpp"
#include "training_logits.hpp"

namespace deep_indexer {


// p[t - row_begin, s] (valid keys only) and, when given, plogp[t], mass[t] of the rows [row_begin, row_end).
// q [T, 128, D] bf16, k [N, D] bf16, lse [T, 128] fp32 (finite), ks/ke [T] int32, p [rows, >= N] fp32.
inline void bf16_training_target(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse, const at::Tensor& ks,
                                 const at::Tensor& ke, const at::Tensor& p, const c10::optional<at::Tensor>& plogp,
                                 const c10::optional<at::Tensor>& mass, int64_t row_begin, int64_t row_end,
                                 double softmax_scale, double inv_heads) {
  constexpr const char* op = "deep_indexer.training.indexer_kl_loss (sm90 target)";
  TensorCheck(op, q, "q").dtype(at::kBFloat16).ndim(3).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  DI_CHECK_ARG(H == TrainingTargetLayout::kNumHeads && TrainingTargetLayout::supported_head_dim(static_cast<int>(D)),
               "{}: q has {} heads of dim {}; the sm90 target supports 128 heads, dims 64..576 (multiples of 64)", op, H, D);
  TensorCheck(op, k, "k").dtype(at::kBFloat16).shape({TensorCheck::kAny, D}).contiguous();
  const int64_t N = k.size(0);
  DI_CHECK_ARG(N < INT_MAX - 128 && T < INT_MAX / 128, "{}: at most 2^31 - 128 keys and 2^24 rows, got {} and {}", op,
               N, T);
  TensorCheck(op, lse, "attn_lse").dtype(at::kFloat).shape({T, H}).contiguous();
  training_api::check_bounds(op, ks, ke, T);
  training_api::check_rows(op, T, row_begin, row_end);
  training_api::check_chunk(op, p, "p", row_end - row_begin, N);
  for (const auto* o : {&plogp, &mass})
    if (o->has_value()) TensorCheck(op, o->value(), o == &plogp ? "plogp" : "mass").dtype(at::kFloat).shape({T}).contiguous();
  DI_CHECK_ARG(std::isfinite(softmax_scale) && softmax_scale > 0, "{}: softmax_scale must be positive, got {}", op,
               softmax_scale);
  TensorCheck(op, q, "q").cuda();
  for (auto [t, name] : {std::pair{&k, "k"}, {&lse, "attn_lse"}, {&ks, "ks"}, {&ke, "ke"}, {&p, "p"}})
    TensorCheck(op, *t, name).on(q.device());
  if (row_end == row_begin || N == 0) return;
  TensorCheck(op, k, "k").aligned(16);
  const OpDevice dev = op_device(q);
  TrainingTargetRuntime::launch(
      {{static_cast<int>(D), sm90::training_target_cluster()}, q.data_ptr(), k.data_ptr(), lse.data_ptr<float>(),
       ks.data_ptr<int>(), ke.data_ptr<int>(), p.data_ptr<float>(), p.stride(0),
       plogp.has_value() ? plogp->data_ptr<float>() : nullptr, mass.has_value() ? mass->data_ptr<float>() : nullptr,
       static_cast<int>(row_begin), static_cast<int>(row_end), static_cast<int>(N),
       static_cast<float>(softmax_scale * 1.4426950408889634), static_cast<float>(inv_heads), nullptr},
      dev.stream, dev.device);
}

// The attention's log-sum-exp lse_out[t, h] = log sum_s exp(softmax_scale q[t, h] . k[s]) over the valid keys of
// the rows [row_begin, row_end) (-inf for an empty row). q [T, 128, D] bf16, k [N, D] bf16, lse_out [T, 128] fp32.
inline void bf16_attention_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& ks, const at::Tensor& ke,
                               const at::Tensor& lse_out, int64_t row_begin, int64_t row_end, double softmax_scale) {
  constexpr const char* op = "deep_indexer.training.indexer_kl_loss (sm90 attention lse)";
  TensorCheck(op, q, "q").dtype(at::kBFloat16).ndim(3).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  DI_CHECK_ARG(H == TrainingTargetLayout::kNumHeads && TrainingTargetLayout::supported_head_dim(static_cast<int>(D)),
               "{}: q has {} heads of dim {}; the sm90 kernel supports 128 heads, dims 64..576 (multiples of 64)", op, H, D);
  TensorCheck(op, k, "k").dtype(at::kBFloat16).shape({TensorCheck::kAny, D}).contiguous();
  const int64_t N = k.size(0);
  DI_CHECK_ARG(N < INT_MAX - 128 && T < INT_MAX / 128, "{}: at most 2^31 - 128 keys and 2^24 rows, got {} and {}", op,
               N, T);
  training_api::check_bounds(op, ks, ke, T);
  training_api::check_rows(op, T, row_begin, row_end);
  TensorCheck(op, lse_out, "lse_out").dtype(at::kFloat).shape({T, H}).contiguous();
  DI_CHECK_ARG(std::isfinite(softmax_scale) && softmax_scale > 0, "{}: softmax_scale must be positive, got {}", op,
               softmax_scale);
  TensorCheck(op, q, "q").cuda();
  for (auto [t, name] : {std::pair{&k, "k"}, {&ks, "ks"}, {&ke, "ke"}, {&lse_out, "lse_out"}})
    TensorCheck(op, *t, name).on(q.device());
  if (row_end == row_begin) return;
  if (N == 0) {
    lse_out.narrow(0, row_begin, row_end - row_begin).fill_(-INFINITY);
    return;
  }
  TensorCheck(op, k, "k").aligned(16);
  const OpDevice dev = op_device(q);
  TrainingTargetRuntime::launch(
      {{static_cast<int>(D), sm90::training_target_cluster(), true}, q.data_ptr(), k.data_ptr(), nullptr,
       ks.data_ptr<int>(), ke.data_ptr<int>(), nullptr, 0, nullptr, nullptr, static_cast<int>(row_begin),
       static_cast<int>(row_end), static_cast<int>(N), static_cast<float>(softmax_scale * 1.4426950408889634), 1.0f,
       lse_out.data_ptr<float>()},
      dev.stream, dev.device);
}

// lse_out[t] = logsumexp_s I[t, s], pi_out[t] = sum_s p[t - row_begin, s] I[t, s] over the valid keys of the
// rows [row_begin, row_end) (-inf and 0 for an empty row). q_I [T, H, D] bf16, k_I [N, D] bf16, w [T, H] fp32.
inline void bf16_indexer_logits_stats(const at::Tensor& q, const at::Tensor& k, const at::Tensor& weights,
                                      const at::Tensor& ks, const at::Tensor& ke, const at::Tensor& p,
                                      const at::Tensor& lse_out, const at::Tensor& pi_out, int64_t row_begin,
                                      int64_t row_end) {
  constexpr const char* op = "deep_indexer.training.indexer_kl_loss (sm90 indexer statistics)";
  const auto [T, H, D, N] = training_api::check_indexer_inputs<TrainingLogitsLayout>(
      op, q, k, weights, "heads 16/32/64/128, dims 64/128", 64);
  training_api::check_bounds(op, ks, ke, T);
  training_api::check_rows(op, T, row_begin, row_end);
  training_api::check_chunk(op, p, "p", row_end - row_begin, N);
  TensorCheck(op, lse_out, "lse_out").dtype(at::kFloat).shape({T}).contiguous();
  TensorCheck(op, pi_out, "pi_out").dtype(at::kFloat).shape({T}).contiguous();
  TensorCheck(op, q, "q_I").cuda();
  for (auto [t, name] : {std::pair{&k, "k_I"}, {&weights, "weights"}, {&ks, "ks"}, {&ke, "ke"}, {&p, "p"},
                         {&lse_out, "lse_out"}, {&pi_out, "pi_out"}})
    TensorCheck(op, *t, name).on(q.device());
  if (row_end == row_begin || N == 0) return;
  TensorCheck(op, q, "q_I").aligned(16);
  TensorCheck(op, k, "k_I").aligned(16);
  const OpDevice dev = op_device(q);
  TrainingLogitsStatsRuntime::launch({{static_cast<int>(H), static_cast<int>(D)}, q.data_ptr(), k.data_ptr(),
                                      weights.data_ptr<float>(), weights.stride(0), ks.data_ptr<int>(),
                                      ke.data_ptr<int>(), p.data_ptr<float>(), p.stride(0), lse_out.data_ptr<float>(),
                                      pi_out.data_ptr<float>(), static_cast<int>(row_begin), static_cast<int>(row_end),
                                      static_cast<int>(N)},
                                     dev.device, dev.stream);
}

// dk_I partial sums of the rows [row_begin, row_end) over the keys [key_begin, key_end): returns
// [splits, ceil((key_end - key_begin) / 128) * 128, D] fp32 (sum over dim 0; rows past N are unspecified).
// dI: `vals` (the incoming gradient, vals[t - vals_row0, s]) when `g` is None; else the warm-up loss's
// dI = g[t] (mass[t] exp(I - lse_i[t]) - p) with p = vals[t - vals_row0, s], also written to
// di_out[t - vals_row0, s] (valid keys only). q_I [T, 64, D], k_I [N, D] bf16, w [T, 64] fp32 (contiguous).
inline at::Tensor bf16_indexer_logits_bwd_dk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& weights,
                                             const at::Tensor& ks, const at::Tensor& ke, const at::Tensor& vals,
                                             int64_t vals_row0, const c10::optional<at::Tensor>& g,
                                             const c10::optional<at::Tensor>& mass,
                                             const c10::optional<at::Tensor>& lse_i,
                                             const c10::optional<at::Tensor>& di_out, int64_t row_begin,
                                             int64_t row_end, int64_t key_begin, int64_t key_end) {
  constexpr const char* op = "deep_indexer.training (sm90 indexer backward, dk_I)";
  const auto [T, H, D, N] = training_api::check_indexer_inputs<TrainingIndexerBwdLayout>(
      op, q, k, weights, "64 heads of dim 64 or 128", 256);
  TensorCheck(op, weights, "weights").contiguous();
  training_api::check_bounds(op, ks, ke, T);
  training_api::check_rows(op, T, row_begin, row_end);
  DI_CHECK_ARG(0 <= vals_row0 && vals_row0 <= row_begin, "{}: vals_row0 must be in [0, row_begin = {}], got {}", op,
               row_begin, vals_row0);
  training_api::check_chunk(op, vals, "vals", row_end - vals_row0, N);
  DI_CHECK_ARG(0 <= key_begin && key_begin <= key_end && key_end <= N, "{}: keys [{}, {}) must lie in [0, {}]", op,
               key_begin, key_end, N);
  const bool loss = g.has_value();
  DI_CHECK_ARG(loss == mass.has_value() && loss == lse_i.has_value() && loss == di_out.has_value(),
               "{}: g, mass, lse_i and di_out are given together (the warm-up loss) or not at all", op);
  if (loss) {
    for (const auto* o : {&g, &mass, &lse_i})
      TensorCheck(op, o->value(), o == &g ? "g" : (o == &mass ? "mass" : "lse_i")).dtype(at::kFloat).shape({T}).contiguous();
    training_api::check_chunk(op, *di_out, "di_out", row_end - vals_row0, N);
  }
  TensorCheck(op, q, "q_I").cuda();
  for (auto [t, name] : {std::pair{&k, "k_I"}, {&weights, "weights"}, {&ks, "ks"}, {&ke, "ke"}, {&vals, "vals"}})
    TensorCheck(op, *t, name).on(q.device());
  const int64_t kblocks = (key_end - key_begin + TrainingIndexerBwdLayout::kKeysPerCta - 1) / TrainingIndexerBwdLayout::kKeysPerCta;
  const int64_t rows = row_end - row_begin;
  if (kblocks == 0 || rows == 0) return at::zeros({1, kblocks * TrainingIndexerBwdLayout::kKeysPerCta, D}, q.options().dtype(at::kFloat));
  TensorCheck(op, q, "q_I").aligned(16);
  TensorCheck(op, k, "k_I").aligned(16);
  const OpDevice dev = op_device(q);
  const int splits = sm90::training_dk_splits(static_cast<int>(kblocks), static_cast<int>(rows), dev.num_sms);
  const int rows_per_split = static_cast<int>((rows + splits - 1) / splits);
  const int64_t part_rows = kblocks * TrainingIndexerBwdLayout::kKeysPerCta;
  at::Tensor part = at::empty({splits, part_rows, D}, q.options().dtype(at::kFloat));
  TrainingIndexerDkRuntime::launch(
      {{static_cast<int>(D), loss}, q.data_ptr(), k.data_ptr(), weights.data_ptr<float>(), ks.data_ptr<int>(),
       ke.data_ptr<int>(), vals.data_ptr<float>(), vals.stride(0), static_cast<int>(vals_row0),
       loss ? g->data_ptr<float>() : nullptr, loss ? mass->data_ptr<float>() : nullptr,
       loss ? lse_i->data_ptr<float>() : nullptr, loss ? di_out->data_ptr<float>() : nullptr,
       loss ? di_out->stride(0) : 0, part.data_ptr<float>(), part_rows, static_cast<int>(T), static_cast<int>(row_begin),
       static_cast<int>(row_end), rows_per_split, splits, static_cast<int>(key_begin), static_cast<int>(kblocks),
       static_cast<int>(N)},
      dev.stream, dev.device);
  return part;
}

// dq_I [T, 64, D] and dw [T, 64] (fp32, rows [row_begin, row_end) written) from dI = di[t - di_row0, s] on the
// valid keys.
inline void bf16_indexer_logits_bwd_dq(const at::Tensor& q, const at::Tensor& k, const at::Tensor& weights,
                                       const at::Tensor& ks, const at::Tensor& ke, const at::Tensor& di,
                                       int64_t di_row0, const at::Tensor& dq, const at::Tensor& dw, int64_t row_begin,
                                       int64_t row_end) {
  constexpr const char* op = "deep_indexer.training (sm90 indexer backward, dq_I)";
  const auto [T, H, D, N] = training_api::check_indexer_inputs<TrainingIndexerBwdLayout>(
      op, q, k, weights, "64 heads of dim 64 or 128", 256);
  TensorCheck(op, weights, "weights").contiguous();
  training_api::check_bounds(op, ks, ke, T);
  training_api::check_rows(op, T, row_begin, row_end);
  DI_CHECK_ARG(0 <= di_row0 && di_row0 <= row_begin, "{}: di_row0 must be in [0, row_begin = {}], got {}", op,
               row_begin, di_row0);
  training_api::check_chunk(op, di, "dI", row_end - di_row0, N);
  TensorCheck(op, dq, "dq").dtype(at::kFloat).shape({T, H, D}).contiguous();
  TensorCheck(op, dw, "dw").dtype(at::kFloat).shape({T, H}).contiguous();
  TensorCheck(op, q, "q_I").cuda();
  for (auto [t, name] : {std::pair{&k, "k_I"}, {&weights, "weights"}, {&ks, "ks"}, {&ke, "ke"}, {&di, "dI"},
                         {&dq, "dq"}, {&dw, "dw"}})
    TensorCheck(op, *t, name).on(q.device());
  if (row_end == row_begin || N == 0) return;  // no valid key: the caller's zeros stand
  TensorCheck(op, q, "q_I").aligned(16);
  TensorCheck(op, k, "k_I").aligned(16);
  const OpDevice dev = op_device(q);
  TrainingIndexerDqRuntime::launch({{static_cast<int>(D)}, q.data_ptr(), k.data_ptr(), weights.data_ptr<float>(),
                                    ks.data_ptr<int>(), ke.data_ptr<int>(), di.data_ptr<float>(), di.stride(0),
                                    static_cast<int>(di_row0), dq.data_ptr<float>(), dw.data_ptr<float>(),
                                    static_cast<int>(row_begin), static_cast<int>(row_end), static_cast<int>(N)},
                                   dev.stream, dev.device);
}

namespace training_api {

// The per_head kernels' inputs: q [T, H, Dqk], k [N, Dqk] or [N, Hkv, Dqk] (Hkv | H), q_I [T, H, D], k_I [N, D]
// (bf16, contiguous), info [H, t_pad, 8] fp32 (RowInfo, t_pad = T rounded up to 128), tile_lo / tile_hi
// [t_pad / 64] int32. Returns {T, H, Hkv, Dqk, D, N, t_pad}.
inline std::array<int64_t, 7> check_per_head_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& q_i, const at::Tensor& k_i,
                                                    const at::Tensor& info, const at::Tensor& tile_lo,
                                                    const at::Tensor& tile_hi) {
  TensorCheck(op, q, "q").dtype(at::kBFloat16).ndim(3).contiguous();
  const int64_t T = q.size(0), H = q.size(1), Dqk = q.size(2);
  TensorCheck(op, q_i, "q_I").dtype(at::kBFloat16).ndim(3).contiguous();
  const int64_t D = q_i.size(2);
  TensorCheck(op, q_i, "q_I").shape({T, H, D});
  const TrainingPerHeadLayout layout{static_cast<int>(Dqk), static_cast<int>(D)};
  DI_CHECK_ARG(layout.valid(),
               "{}: attention dim {} with indexer dim {} is not supported by the sm90 per_head kernels", op, Dqk, D);
  TensorCheck(op, k, "k").dtype(at::kBFloat16).contiguous();
  DI_CHECK_ARG((k.dim() == 2 || k.dim() == 3) && k.size(-1) == Dqk,
               "{}: k must be [N, {}] or [N, H_kv, {}], got {}", op, Dqk, Dqk, shape_str(k.sizes()));
  const int64_t N = k.size(0), Hkv = k.dim() == 3 ? k.size(1) : 1;
  DI_CHECK_ARG(Hkv >= 1 && H % Hkv == 0, "{}: k has {} key heads, which must divide the {} heads of q", op, Hkv, H);
  TensorCheck(op, k_i, "k_I").dtype(at::kBFloat16).shape({N, D}).contiguous();
  DI_CHECK_ARG(N < INT_MAX - 256 && T < (1 << 24) && H <= 1024, "{}: at most 2^31 - 256 keys, 2^24 rows and 1024 heads, "
               "got {}, {} and {}", op, N, T, H);
  const int64_t t_pad = (T + 127) / 128 * 128;
  TensorCheck(op, info, "info").dtype(at::kFloat).shape({H, t_pad, 8}).contiguous();
  TensorCheck(op, tile_lo, "tile_lo").dtype(at::kInt).shape({t_pad / 64}).contiguous();
  TensorCheck(op, tile_hi, "tile_hi").dtype(at::kInt).shape({t_pad / 64}).contiguous();
  return {T, H, Hkv, Dqk, D, N, t_pad};
}

// After the shape checks: every input on q's CUDA device, the TMA sources 16-byte aligned.
inline void check_per_head_device(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_i,
                                  const at::Tensor& k_i, const at::Tensor& info, const at::Tensor& tile_lo,
                                  const at::Tensor& tile_hi) {
  TensorCheck(op, q, "q").cuda();
  for (auto [t, name] : {std::pair{&k, "k"}, {&q_i, "q_I"}, {&k_i, "k_I"}, {&info, "info"}, {&tile_lo, "tile_lo"},
                         {&tile_hi, "tile_hi"}})
    TensorCheck(op, *t, name).on(q.device());
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&q_i, "q_I"}, {&k_i, "k_I"}, {&info, "info"}})
    TensorCheck(op, *t, name).aligned(16);
}

}  // namespace training_api

// per_head target, row-major kernel. Forward (`backward` false): out_a = kl, out_b = lse_I, out_c = mass, each
// [T, H] fp32. Backward: out_a = dq_I [T, H, D] fp32, out_b = dw [T, H] fp32 (out_c unused). Every row < T is
// written. info holds the rows' values (RowInfo in training_per_head.cuh), tile_lo / tile_hi the row tiles' hulls.
inline void bf16_per_head_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_i, const at::Tensor& k_i,
                               const at::Tensor& info, const at::Tensor& tile_lo, const at::Tensor& tile_hi,
                               const at::Tensor& out_a, const at::Tensor& out_b, const c10::optional<at::Tensor>& out_c,
                               double softmax_scale, bool backward) {
  constexpr const char* op = "deep_indexer.training.indexer_kl_loss (sm90 per_head rows)";
  const auto [T, H, Hkv, Dqk, D, N, t_pad] = training_api::check_per_head_inputs(op, q, k, q_i, k_i, info, tile_lo, tile_hi);
  if (backward) {
    TensorCheck(op, out_a, "dq").dtype(at::kFloat).shape({T, H, D}).contiguous();
  } else {
    TensorCheck(op, out_a, "kl").dtype(at::kFloat).shape({T, H}).contiguous();
    DI_CHECK_ARG(out_c.has_value(), "{}: the forward needs out_c (mass)", op);
    TensorCheck(op, *out_c, "mass").dtype(at::kFloat).shape({T, H}).contiguous();
  }
  TensorCheck(op, out_b, backward ? "dw" : "lse_I").dtype(at::kFloat).shape({T, H}).contiguous();
  DI_CHECK_ARG(std::isfinite(softmax_scale) && softmax_scale > 0, "{}: softmax_scale must be positive, got {}", op,
               softmax_scale);
  training_api::check_per_head_device(op, q, k, q_i, k_i, info, tile_lo, tile_hi);
  TensorCheck(op, out_a, "out_a").on(q.device());
  TensorCheck(op, out_b, "out_b").on(q.device());
  if (!backward) TensorCheck(op, *out_c, "mass").on(q.device());
  if (T == 0 || N == 0) return;
  const OpDevice dev = op_device(q);
  TrainingPerHeadRowsRuntime::launch(
      {{static_cast<int>(Dqk), static_cast<int>(D), backward}, q.data_ptr(), k.data_ptr(), q_i.data_ptr(),
       k_i.data_ptr(), info.data_ptr(), tile_lo.data_ptr<int>(), tile_hi.data_ptr<int>(), out_a.data_ptr<float>(),
       out_b.data_ptr<float>(), backward ? nullptr : out_c->data_ptr<float>(), static_cast<int>(T),
       static_cast<int>(H), static_cast<int>(Hkv), static_cast<int>(N), static_cast<int>(t_pad),
       static_cast<float>(softmax_scale * 1.4426950408889634)},
      dev.stream, dev.device);
}

// per_head target, key-major kernel: dk_I partials [groups, ceil(N / 128) * 128, D] fp32 (sum over dim 0; rows
// past N unspecified). kb_first / kb_last [ceil(N / 128)] int32: per 128-key block the first and last row tile
// whose hull meets it (first > last: none).
inline at::Tensor bf16_per_head_dk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_i,
                                   const at::Tensor& k_i, const at::Tensor& info, const at::Tensor& tile_lo,
                                   const at::Tensor& tile_hi, const at::Tensor& kb_first, const at::Tensor& kb_last,
                                   double softmax_scale) {
  constexpr const char* op = "deep_indexer.training.indexer_kl_loss (sm90 per_head dk_I)";
  const auto [T, H, Hkv, Dqk, D, N, t_pad] = training_api::check_per_head_inputs(op, q, k, q_i, k_i, info, tile_lo, tile_hi);
  const int64_t kblocks = (N + TrainingPerHeadLayout::kKeysPerCta - 1) / TrainingPerHeadLayout::kKeysPerCta;
  TensorCheck(op, kb_first, "kb_first").dtype(at::kInt).shape({kblocks}).contiguous();
  TensorCheck(op, kb_last, "kb_last").dtype(at::kInt).shape({kblocks}).contiguous();
  DI_CHECK_ARG(std::isfinite(softmax_scale) && softmax_scale > 0, "{}: softmax_scale must be positive, got {}", op,
               softmax_scale);
  training_api::check_per_head_device(op, q, k, q_i, k_i, info, tile_lo, tile_hi);
  TensorCheck(op, kb_first, "kb_first").on(q.device());
  TensorCheck(op, kb_last, "kb_last").on(q.device());
  const int64_t part_rows = kblocks * TrainingPerHeadLayout::kKeysPerCta;
  if (T == 0 || kblocks == 0) return at::zeros({1, part_rows, D}, q.options().dtype(at::kFloat));
  const OpDevice dev = op_device(q);
  const int per_group = sm90::training_per_head_dk_heads_per_group(static_cast<int>(kblocks), static_cast<int>(H),
                                                                    dev.num_sms);
  const int groups = static_cast<int>((H + per_group - 1) / per_group);
  at::Tensor part = at::empty({groups, part_rows, D}, q.options().dtype(at::kFloat));
  TrainingPerHeadDkRuntime::launch(
      {{static_cast<int>(Dqk), static_cast<int>(D)}, q.data_ptr(), k.data_ptr(), q_i.data_ptr(), k_i.data_ptr(),
       info.data_ptr(), tile_lo.data_ptr<int>(), tile_hi.data_ptr<int>(), kb_first.data_ptr<int>(),
       kb_last.data_ptr<int>(), part.data_ptr<float>(), part_rows, static_cast<int>(kblocks), per_group, groups,
       static_cast<int>(T), static_cast<int>(H), static_cast<int>(Hkv), static_cast<int>(N), static_cast<int>(t_pad),
       static_cast<float>(softmax_scale * 1.4426950408889634)},
      dev.stream, dev.device);
  return part;
}

}  // namespace deep_indexer
