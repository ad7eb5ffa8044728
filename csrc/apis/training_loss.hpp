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
                                             int64_t row_end, int64_t key_begin, int64_t key_end,
                                             const c10::optional<at::Tensor>& mask_out, int64_t mask_row0) {
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
  const bool mask = mask_out.has_value();
  DI_CHECK_ARG(!(mask && loss), "{}: mask_out is for the logits backward (not with the warm-up loss)", op);
  if (mask) training_api::check_mask(op, *mask_out, "mask_out", mask_row0, row_begin, row_end, key_end - key_begin);
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
      {{static_cast<int>(D), loss, mask}, q.data_ptr(), k.data_ptr(), weights.data_ptr<float>(), ks.data_ptr<int>(),
       ke.data_ptr<int>(), vals.data_ptr<float>(), vals.stride(0), static_cast<int>(vals_row0),
       loss ? g->data_ptr<float>() : nullptr, loss ? mass->data_ptr<float>() : nullptr,
       loss ? lse_i->data_ptr<float>() : nullptr, loss ? di_out->data_ptr<float>() : nullptr,
       loss ? di_out->stride(0) : 0, part.data_ptr<float>(), part_rows,
       mask ? reinterpret_cast<uint32_t*>(mask_out->data_ptr<int>()) : nullptr, mask ? mask_out->stride(0) : 0,
       static_cast<int>(mask_row0), static_cast<int>(T), static_cast<int>(row_begin),
       static_cast<int>(row_end), rows_per_split, splits, static_cast<int>(key_begin), static_cast<int>(kblocks),
       static_cast<int>(N)},
      dev.stream, dev.device);
  return part;
}

// dq_I [T, 64, D] and dw [T, 64] (fp32, rows [row_begin, row_end) written) from dI = di[t - di_row0, s] on the
// valid keys. With `mask` (written by bf16_indexer_logits_bwd_dk for rows from mask_row0 and keys [mask_key0,
// mask_key1)): no S recompute, keys clamped to that range, and dq_I may be bf16.
inline void bf16_indexer_logits_bwd_dq(const at::Tensor& q, const at::Tensor& k, const at::Tensor& weights,
                                       const at::Tensor& ks, const at::Tensor& ke, const at::Tensor& di,
                                       int64_t di_row0, const at::Tensor& dq, const at::Tensor& dw, int64_t row_begin,
                                       int64_t row_end, const c10::optional<at::Tensor>& mask, int64_t mask_row0,
                                       int64_t mask_key0, int64_t mask_key1) {
  constexpr const char* op = "deep_indexer.training (sm90 indexer backward, dq_I)";
  const auto [T, H, D, N] = training_api::check_indexer_inputs<TrainingIndexerBwdLayout>(
      op, q, k, weights, "64 heads of dim 64 or 128", 256);
  TensorCheck(op, weights, "weights").contiguous();
  training_api::check_bounds(op, ks, ke, T);
  training_api::check_rows(op, T, row_begin, row_end);
  DI_CHECK_ARG(0 <= di_row0 && di_row0 <= row_begin, "{}: di_row0 must be in [0, row_begin = {}], got {}", op,
               row_begin, di_row0);
  training_api::check_chunk(op, di, "dI", row_end - di_row0, N);
  const bool masked = mask.has_value();
  if (masked) {
    TensorCheck(op, dq, "dq").dtype_in({at::kFloat, at::kBFloat16}).shape({T, H, D}).contiguous();
    DI_CHECK_ARG(0 <= mask_key0 && mask_key0 <= mask_key1 && mask_key1 <= N, "{}: mask keys [{}, {}) must lie in [0, {}]",
                 op, mask_key0, mask_key1, N);
    training_api::check_mask(op, *mask, "mask", mask_row0, row_begin, row_end, mask_key1 - mask_key0);
  } else {
    TensorCheck(op, dq, "dq").dtype(at::kFloat).shape({T, H, D}).contiguous();
  }
  TensorCheck(op, dw, "dw").dtype(at::kFloat).shape({T, H}).contiguous();
  TensorCheck(op, q, "q_I").cuda();
  for (auto [t, name] : {std::pair{&k, "k_I"}, {&weights, "weights"}, {&ks, "ks"}, {&ke, "ke"}, {&di, "dI"},
                         {&dq, "dq"}, {&dw, "dw"}})
    TensorCheck(op, *t, name).on(q.device());
  if (masked) TensorCheck(op, *mask, "mask").on(q.device());
  if (row_end == row_begin || N == 0) return;  // no valid key: the caller's zeros stand
  TensorCheck(op, q, "q_I").aligned(16);
  TensorCheck(op, k, "k_I").aligned(16);
  const OpDevice dev = op_device(q);
  TrainingIndexerDqRuntime::launch(
      {{static_cast<int>(D), masked, dq.scalar_type() == at::kBFloat16}, q.data_ptr(), k.data_ptr(),
       weights.data_ptr<float>(), ks.data_ptr<int>(), ke.data_ptr<int>(), di.data_ptr<float>(), di.stride(0),
       static_cast<int>(di_row0), masked ? reinterpret_cast<const uint32_t*>(mask->data_ptr<int>()) : nullptr,
       masked ? mask->stride(0) : 0, static_cast<int>(mask_row0), static_cast<int>(mask_key0),
       static_cast<int>(mask_key1), dq.data_ptr(), dw.data_ptr<float>(), static_cast<int>(row_begin),
       static_cast<int>(row_end), static_cast<int>(N)},
      dev.stream, dev.device);
}

namespace training_api {

struct PerHeadShape {
  int64_t T, H, Hkv, Dqk, D, N;
};

// The per_head kernels' inputs: q [T, H, Dqk], k [N, Dqk] or [N, Hkv, Dqk] (Hkv | H), q_I [T, H, D], k_I [N, D]
// (bf16, contiguous), ks / ke [T] int32, lse / weights [T, H] fp32 (contiguous).
inline PerHeadShape check_per_head_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& q_i, const at::Tensor& k_i, const at::Tensor& ks,
                                          const at::Tensor& ke, const at::Tensor& lse, const at::Tensor& w) {
  TensorCheck(op, q, "q").dtype(at::kBFloat16).ndim(3).contiguous();
  const int64_t T = q.size(0), H = q.size(1), Dqk = q.size(2);
  TensorCheck(op, q_i, "q_I").dtype(at::kBFloat16).ndim(3).contiguous();
  const int64_t D = q_i.size(2);
  TensorCheck(op, q_i, "q_I").shape({T, H, D});
  const TrainingPerHeadLayout layout{static_cast<int>(Dqk), static_cast<int>(D)};
  DI_CHECK_ARG(layout.valid(), "{}: attention dim {} with indexer dim {} is not supported by the sm90 per_head kernels "
               "(indexer dim 64 with attention dim 64, 128 or 192)", op, Dqk, D);
  TensorCheck(op, k, "k").dtype(at::kBFloat16).contiguous();
  DI_CHECK_ARG((k.dim() == 2 || k.dim() == 3) && k.size(-1) == Dqk,
               "{}: k must be [N, {}] or [N, H_kv, {}], got {}", op, Dqk, Dqk, shape_str(k.sizes()));
  const int64_t N = k.size(0), Hkv = k.dim() == 3 ? k.size(1) : 1;
  DI_CHECK_ARG(Hkv >= 1 && H % Hkv == 0, "{}: k has {} key heads, which must divide the {} heads of q", op, Hkv, H);
  TensorCheck(op, k_i, "k_I").dtype(at::kBFloat16).shape({N, D}).contiguous();
  DI_CHECK_ARG(N < INT_MAX - 256 && T < (1 << 24) && H <= 1024, "{}: at most 2^31 - 256 keys, 2^24 rows and 1024 heads, "
               "got {}, {} and {}", op, N, T, H);
  check_bounds(op, ks, ke, T);
  TensorCheck(op, lse, "attn_lse").dtype(at::kFloat).shape({T, H}).contiguous();
  TensorCheck(op, w, "weights").dtype(at::kFloat).shape({T, H}).contiguous();
  return {T, H, Hkv, Dqk, D, N};
}

// After the shape checks: every tensor on q's CUDA device, the TMA sources 16-byte aligned.
inline void check_per_head_device(const char* op, std::initializer_list<std::pair<const at::Tensor*, const char*>> ts) {
  const at::Tensor& q = *ts.begin()->first;
  TensorCheck(op, q, "q").cuda();
  for (auto [t, name] : ts) TensorCheck(op, *t, name).on(q.device());
  for (auto [t, name] : ts)
    if (t->scalar_type() == at::kBFloat16) TensorCheck(op, *t, name).aligned(16);
}

inline PerHeadRowsArgs per_head_rows_args(const at::Tensor& q, const at::Tensor& q_i, const at::Tensor& ks,
                                          const at::Tensor& ke, const at::Tensor& lse, const at::Tensor& w) {
  return {q.data_ptr(), q_i.data_ptr(), ks.data_ptr<int>(), ke.data_ptr<int>(), lse.data_ptr<float>(),
          w.data_ptr<float>(), nullptr, nullptr, nullptr};
}

}  // namespace training_api

// per_head target forward: kl, lse_I, mass [T, H] fp32, every row written (0, -inf, 0 for a row without keys):
// kl[t, h] = KL(P[t, h] || softmax(I_h[t])) with P = exp(scale q.k - attn_lse) over the row's keys
// max(ks, 0) <= s < min(ke, N); attn_lse non-finite means an empty row.
inline void bf16_per_head_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_i, const at::Tensor& k_i,
                              const at::Tensor& ks, const at::Tensor& ke, const at::Tensor& lse, const at::Tensor& w,
                              const at::Tensor& kl, const at::Tensor& lse_i, const at::Tensor& mass,
                              double softmax_scale) {
  constexpr const char* op = "deep_indexer.training.indexer_kl_loss (sm90 per_head forward)";
  const auto sh = training_api::check_per_head_inputs(op, q, k, q_i, k_i, ks, ke, lse, w);
  for (auto [t, name] : {std::pair{&kl, "kl"}, {&lse_i, "lse_I"}, {&mass, "mass"}})
    TensorCheck(op, *t, name).dtype(at::kFloat).shape({sh.T, sh.H}).contiguous();
  DI_CHECK_ARG(std::isfinite(softmax_scale) && softmax_scale > 0, "{}: softmax_scale must be positive, got {}", op,
               softmax_scale);
  training_api::check_per_head_device(op, {{&q, "q"}, {&k, "k"}, {&q_i, "q_I"}, {&k_i, "k_I"}, {&ks, "ks"}, {&ke, "ke"},
                                           {&lse, "attn_lse"}, {&w, "weights"}, {&kl, "kl"}, {&lse_i, "lse_I"},
                                           {&mass, "mass"}});
  if (sh.T == 0) return;
  if (sh.N == 0) {
    kl.zero_();
    lse_i.fill_(-INFINITY);
    mass.zero_();
    return;
  }
  const OpDevice dev = op_device(q);
  TrainingPerHeadRowsRuntime::launch(
      {{static_cast<int>(sh.Dqk), static_cast<int>(sh.D), false}, k.data_ptr(), k_i.data_ptr(),
       training_api::per_head_rows_args(q, q_i, ks, ke, lse, w), PerHeadBwdOut{}, kl.data_ptr<float>(),
       lse_i.data_ptr<float>(), mass.data_ptr<float>(), static_cast<int>(sh.T), static_cast<int>(sh.H),
       static_cast<int>(sh.Hkv), static_cast<int>(sh.N), static_cast<int>((sh.T + 127) / 128 * 128),
       static_cast<float>(softmax_scale * 1.4426950408889634)},
      dev.stream, dev.device);
}

// per_head target backward for the per-token loss gradient divided by total_heads, g [T]: writes dq_I [T, H, D]
// and dw [T, H] (fp32, every row) and returns dk_I [N, D] fp32. lse_i, mass [T, H]: the forward's statistics.
inline at::Tensor bf16_per_head_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_i,
                                    const at::Tensor& k_i, const at::Tensor& ks, const at::Tensor& ke,
                                    const at::Tensor& lse, const at::Tensor& w, const at::Tensor& lse_i,
                                    const at::Tensor& mass, const at::Tensor& g, const at::Tensor& dq,
                                    const at::Tensor& dw, double softmax_scale) {
  constexpr const char* op = "deep_indexer.training.indexer_kl_loss (sm90 per_head backward)";
  const auto sh = training_api::check_per_head_inputs(op, q, k, q_i, k_i, ks, ke, lse, w);
  TensorCheck(op, lse_i, "lse_I").dtype(at::kFloat).shape({sh.T, sh.H}).contiguous();
  TensorCheck(op, mass, "mass").dtype(at::kFloat).shape({sh.T, sh.H}).contiguous();
  TensorCheck(op, g, "g").dtype(at::kFloat).shape({sh.T}).contiguous();
  TensorCheck(op, dq, "dq").dtype(at::kFloat).shape({sh.T, sh.H, sh.D}).contiguous();
  TensorCheck(op, dw, "dw").dtype(at::kFloat).shape({sh.T, sh.H}).contiguous();
  DI_CHECK_ARG(std::isfinite(softmax_scale) && softmax_scale > 0, "{}: softmax_scale must be positive, got {}", op,
               softmax_scale);
  training_api::check_per_head_device(op, {{&q, "q"}, {&k, "k"}, {&q_i, "q_I"}, {&k_i, "k_I"}, {&ks, "ks"}, {&ke, "ke"},
                                           {&lse, "attn_lse"}, {&w, "weights"}, {&lse_i, "lse_I"}, {&mass, "mass"},
                                           {&g, "g"}, {&dq, "dq"}, {&dw, "dw"}});
  const auto f32 = q.options().dtype(at::kFloat), i32 = q.options().dtype(at::kInt);
  const int64_t kblocks = (sh.N + TrainingPerHeadLayout::kKeysPerCta - 1) / TrainingPerHeadLayout::kKeysPerCta;
  if (sh.T == 0 || sh.N == 0) {
    dq.zero_();
    dw.zero_();
    return at::zeros({sh.N, sh.D}, f32);
  }
  const int64_t t_pad = (sh.T + 127) / 128 * 128;
  at::Tensor info = at::empty({sh.H, t_pad, TrainingPerHeadLayout::kInfoFloats}, f32);
  at::Tensor tiles = at::empty({4, t_pad / 64}, i32);
  at::Tensor kb_first = at::full({kblocks}, INT_MAX, i32), kb_last = at::full({kblocks}, -1, i32);
  PerHeadRowsArgs rows = training_api::per_head_rows_args(q, q_i, ks, ke, lse, w);
  rows.lse_i = lse_i.data_ptr<float>();
  rows.mass = mass.data_ptr<float>();
  rows.g = g.data_ptr<float>();
  int* tp = tiles.data_ptr<int>();
  const int64_t nt = t_pad / 64;
  const PerHeadBwdOut bo{reinterpret_cast<RowInfo*>(info.data_ptr<float>()), tp, tp + nt, tp + 2 * nt, tp + 3 * nt,
                         kb_first.data_ptr<int>(), kb_last.data_ptr<int>()};
  const OpDevice dev = op_device(q);
  const float scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  TrainingPerHeadRowsRuntime::launch(
      {{static_cast<int>(sh.Dqk), static_cast<int>(sh.D), true}, k.data_ptr(), k_i.data_ptr(), rows, bo,
       dq.data_ptr<float>(), dw.data_ptr<float>(), nullptr, static_cast<int>(sh.T), static_cast<int>(sh.H),
       static_cast<int>(sh.Hkv), static_cast<int>(sh.N), static_cast<int>(t_pad), scale_log2},
      dev.stream, dev.device);
  const int per_group = sm90::training_per_head_dk_heads_per_group(static_cast<int>(kblocks), static_cast<int>(sh.H),
                                                                    dev.num_sms);
  const int groups = static_cast<int>((sh.H + per_group - 1) / per_group);
  const int64_t part_rows = kblocks * TrainingPerHeadLayout::kKeysPerCta;
  at::Tensor part = at::empty({groups, part_rows, sh.D}, f32);
  TrainingPerHeadDkRuntime::launch(
      {{static_cast<int>(sh.Dqk), static_cast<int>(sh.D)}, q.data_ptr(), k.data_ptr(), q_i.data_ptr(), k_i.data_ptr(),
       info.data_ptr(), bo.tile_lo, bo.tile_hi, bo.tile_lo_max, bo.tile_hi_min, bo.kb_first, bo.kb_last,
       part.data_ptr<float>(), part_rows,
       static_cast<int>(kblocks), per_group, groups, static_cast<int>(sh.T), static_cast<int>(sh.H),
       static_cast<int>(sh.Hkv), static_cast<int>(sh.N), static_cast<int>(t_pad), scale_log2},
      dev.stream, dev.device);
  return groups == 1 ? part[0].narrow(0, 0, sh.N) : part.sum(0).narrow(0, 0, sh.N);
}

}  // namespace deep_indexer
