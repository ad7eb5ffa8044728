"""Autograd ops for training the lightning indexer (portable PyTorch path: CPU or CUDA; SM90 kernels in sm90.py).

Public entry points: `indexer_logits`, `indexer_kl_loss` (warm-up stage, dense), `sparse_indexer_kl_loss`
(sparse stage, over given top-k sets) and `packed_bounds`. The compute lives in `reference.py`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from . import reference as ref
from . import sm90
from . import torch_ops as _torch_ops  # noqa: F401  (registers torch.ops.deep_indexer.* training ops)
from .core import (_FLOATS, _INTS, _bounds, _cast, _check_indices, _detached, _index_pair,  # noqa: F401  (names
                   _opt_int, _same_device, _shape, _tensor, _sm90_logits, attention_lse, logits_backward,  # kept
                   packed_bounds, warmup_backward, warmup_forward)  # importable from ops)

# NOTES: while torch.compile traces, the public functions go through torch.ops.deep_indexer.* (custom ops with
# fake implementations, see torch_ops.py); in eager mode they use the autograd.Functions below (same compute).
_compiling = torch.compiler.is_compiling


def _ops():
    return torch.ops.deep_indexer

__all__ = ["indexer_logits", "indexer_kl_loss", "sparse_indexer_kl_loss", "packed_bounds", "KLLoss"]

_TARGETS = ("mean", "per_head")
_REDUCTIONS = ("mean", "sum")


class KLLoss(NamedTuple):
    """Result of `indexer_kl_loss` / `sparse_indexer_kl_loss`.

    loss:        reduced loss (scalar; `reduction` = "mean" over valid tokens, or "sum"); differentiable.
    per_token:   [T] loss of every query row (0 for masked or empty rows); differentiable.
    num_tokens:  int64 scalar tensor, the number of valid rows (mask set and at least one valid key).
    indexer_lse: log-sum-exp of the indexer logits over the row's keys ([T], or [T, H] for `per_head`);
                 -inf for an empty row.
    attn_lse:    [T, H] attention log-sum-exp used for the target (given, or computed; for the sparse loss,
                 over the selected set).
    target_mass: sum of the target over the row's keys ([T], or [T, H] for `per_head`): 1 for a row of a
                 single-rank target, the heads' share under tensor parallelism.
    """

    loss: torch.Tensor
    per_token: torch.Tensor
    num_tokens: torch.Tensor
    indexer_lse: torch.Tensor
    attn_lse: torch.Tensor
    target_mass: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _indexer_args(q_i, k_i, weights):
    _tensor("q_I", q_i, 3)
    _tensor("k_I", k_i, 2)
    _tensor("weights", weights, 2)
    rows, heads, dim = q_i.shape
    if k_i.shape[1] != dim:
        raise ValueError(f"k_I: expected shape [N, {dim}] (D_I of q_I), got {tuple(k_i.shape)}")
    _shape("weights", weights, (rows, heads))
    _same_device(q_i, k_I=k_i, weights=weights)


def _attention_args(q_i, q, k, rows, n_keys, softmax_scale, attn_lse):
    _tensor("q", q, 3)
    if not isinstance(k, torch.Tensor) or k.dim() not in (2, 3):
        raise ValueError(f"k: expected a [N, Dqk] or [N, H_kv, Dqk] tensor, got {getattr(k, 'shape', type(k).__name__)}")
    _tensor("k", k, k.dim())
    _same_device(q_i, q=q, k=k, attn_lse=attn_lse)
    heads, dqk = q.shape[1], q.shape[2]
    if q.shape[0] != rows:
        raise ValueError(f"q: expected {rows} rows (those of q_I), got shape {tuple(q.shape)}")
    if k.shape[0] != n_keys or k.shape[-1] != dqk:
        raise ValueError(f"k: expected [{n_keys}, (H_kv,) {dqk}] (keys of k_I, Dqk of q), got {tuple(k.shape)}")
    if k.dim() == 3 and (k.shape[1] < 1 or heads % k.shape[1] != 0):
        raise ValueError(f"k: expected H_kv dividing the {heads} query heads, got H_kv = {k.shape[1]}")
    if attn_lse is not None:
        _tensor("attn_lse", attn_lse, 2)
        _shape("attn_lse", attn_lse, (rows, heads))
    if softmax_scale is None:
        return 1.0 / math.sqrt(dqk)
    ok = isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
    if not (ok and softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale: expected a positive finite float or None, got {softmax_scale!r}")
    return float(softmax_scale)


def _loss_options(target, reduction, total_heads, heads, heads_i, token_mask, rows, device):
    if target not in _TARGETS:
        raise ValueError(f"target: expected one of {_TARGETS}, got {target!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    per_head = target == "per_head"
    if per_head and heads_i != heads:
        raise ValueError(f"q_I: the per_head target pairs indexer head h with attention head h: expected "
                         f"{heads} indexer heads (those of q), got {heads_i}")
    _opt_int("total_heads", total_heads)
    if total_heads is not None and total_heads < heads:
        raise ValueError(f"total_heads: expected >= the {heads} heads of q, got {total_heads}")
    total = total_heads or heads
    if token_mask is not None:
        _tensor("token_mask", token_mask, 1, (torch.bool,))
        _shape("token_mask", token_mask, (rows,))
        if token_mask.device != device and token_mask.device.type != "cpu":
            raise ValueError(f"token_mask: expected device {device} or cpu, got {token_mask.device}")
    return per_head, total, total != heads


def _reduce(per_token, valid, reduction):
    n = valid.sum()
    if reduction == "sum":
        return per_token.sum(), n
    return per_token.sum() / n.clamp_min(1).to(per_token.dtype), n


# ----------------------------------------------------------------------------------------------
# Indexer logits
# ----------------------------------------------------------------------------------------------


class _IndexerLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunks, backend):
        ctx.save_for_backward(q_i, k_i, w, ks, ke)
        ctx.cpu_bounds, ctx.chunks, ctx.backend = (ks_cpu, ke_cpu), chunks, backend
        if backend == "sm90":
            return _sm90_logits(q_i, k_i, w, ks, ke)
        return ref.indexer_logits_fwd(*_detached(q_i, k_i, w), ks, ke, ks_cpu, ke_cpu, *chunks)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q_i, k_i, w, ks, ke = _detached(*ctx.saved_tensors)
        dq, dk, dw = logits_backward(grad, q_i, k_i, w, ks, ke, *ctx.cpu_bounds, *ctx.chunks, ctx.backend)
        return _cast(dq, q_i), _cast(dk, k_i), _cast(dw, w), None, None, None, None, None, None


def indexer_logits(q_I, k_I, weights, *, ks=None, ke=None, cu_seqlens=None, causal=True, deterministic=False,
                   chunk_rows=None, chunk_keys=None, backend="torch") -> torch.Tensor:
    """Indexer logits with autograd: I[t, s] = sum_h weights[t, h] * relu(q_I[t, h, :] . k_I[s, :]).

    q_I [T, H_I, D_I], k_I [N, D_I] (one key head), weights [T, H_I]: bfloat16, float16, float32 or float64.
    Row t's valid keys: ks[t] <= s < ke[t] (int32/int64 [T], values in [0, N]); or packed sequences
    `cu_seqlens` [B + 1] with T = N (row t sees its own sequence, up to itself when `causal`); or, with
    neither, every key. Returns float32 logits [T, N] (float64 for float64 inputs), exactly -inf outside
    each row's range. The backward gives dq_I, dk_I, dweights (computed in float32, returned in the inputs'
    dtypes); the incoming gradient is ignored outside the valid range.

    Host synchronisation: the loops are planned on the host from a CPU copy of the bounds. For inputs on a
    GPU, give ks/ke or cu_seqlens as CPU tensors (or no bounds) to avoid any device-to-host copy; bounds on
    the GPU cost one synchronising copy in the forward (the backward reuses it).

    Compute: chunks of `chunk_rows` query rows x tiles of `chunk_keys` keys (defaults: tiles of 512 keys
    and about 32 MiB per temporary on the CPU, 1024 keys and 128 MiB on a GPU), accumulated in float32
    (float64 for float64 inputs) in a fixed order: run to run bitwise reproducible; `deterministic` is
    accepted for symmetry with the losses (this op is always deterministic).

    backend: "torch" (the portable code above) or "sm90": the forward runs on a Hopper kernel (bf16 q_I and
    k_I, WGMMA with fp32 accumulation; H_I in 16/32/64/128, D_I in 64/128; deterministic), and so does the
    backward for H_I = 64 (dS = dI w [S > 0] rounded to bf16 as the operand of the dq_I / dk_I WGMMAs, fp32
    accumulation, no atomics: deterministic); other shapes take the portable backward.

    torch.compile: traceable with fullgraph=True (through torch.ops.deep_indexer custom ops); the non-tensor
    arguments are constants of the compiled program (a new value recompiles).
    """
    _indexer_args(q_I, k_I, weights)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    _opt_int("chunk_rows", chunk_rows)
    _opt_int("chunk_keys", chunk_keys)
    if backend not in ("torch", "sm90"):
        raise ValueError(f"backend: expected 'torch' or 'sm90', got {backend!r}")
    if _compiling():
        ks, ke, ks_cpu, ke_cpu = _ops().training_bounds(q_I, k_I.shape[0], ks, ke, cu_seqlens, causal, None)
        return _ops().indexer_logits_fwd(q_I, k_I, weights, ks, ke, ks_cpu, ke_cpu, chunk_rows, chunk_keys, backend)
    ks, ke, ks_cpu, ke_cpu = _bounds(q_I.shape[0], k_I.shape[0], q_I.device, ks, ke, cu_seqlens, causal)
    return _IndexerLogits.apply(q_I, k_I, weights, ks, ke, ks_cpu, ke_cpu, (chunk_rows, chunk_keys), backend)


# ----------------------------------------------------------------------------------------------
# Warm-up loss
# ----------------------------------------------------------------------------------------------


class _WarmupKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_i, k_i, w, q, k, lse_att, ks, ke, ks_cpu, ke_cpu, cfg):
        scale, per_head, total, partial, chunks, backend = cfg
        loss, lse_i, mass = warmup_forward(*_detached(q_i, k_i, w), q, k, scale, lse_att, ks, ke, ks_cpu, ke_cpu,
                                           per_head, total, partial, *chunks, backend)
        ctx.save_for_backward(q_i, k_i, w, q, k, lse_att, lse_i, mass, ks, ke)
        ctx.cpu_bounds, ctx.cfg = (ks_cpu, ke_cpu), cfg
        ctx.mark_non_differentiable(lse_i, mass)
        return loss, lse_i, mass

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _g_lse, _g_mass):
        q_i, k_i, w, q, k, lse_att, lse_i, mass, ks, ke = _detached(*ctx.saved_tensors)
        scale, per_head, total, _partial, chunks, backend = ctx.cfg
        dq, dk, dw = warmup_backward(grad, q_i, k_i, w, q, k, scale, lse_att, lse_i, mass, ks, ke, *ctx.cpu_bounds,
                                     per_head, total, *chunks, backend)
        return _cast(dq, q_i), _cast(dk, k_i), _cast(dw, w), *([None] * 8)


_BACKENDS = ("auto", "torch", "sm90")


def _loss_backend(backend, q_i, k_i, q, k, per_head) -> str:
    """"auto" -> "sm90" where the SM90 kernels apply, else "torch"; "sm90" where they do not is an error."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return backend
    why = sm90.loss_unsupported(q_i, k_i, q, k, per_head)
    if why is None:
        return "sm90"
    if backend == "sm90":
        raise ValueError(f"backend='sm90': the SM90 warm-up loss {why}")
    return "torch"


def _loss_args(q_I, k_I, weights, q, k, softmax_scale, attn_lse, target, reduction, total_heads, token_mask):
    """Validation shared by the two losses: (rows, n_keys, scale, per_head, total_heads, partial)."""
    _indexer_args(q_I, k_I, weights)
    rows, n_keys = q_I.shape[0], k_I.shape[0]
    scale = _attention_args(q_I, q, k, rows, n_keys, softmax_scale, attn_lse)
    per_head, total, partial = _loss_options(target, reduction, total_heads, q.shape[1], q_I.shape[1], token_mask,
                                             rows, q_I.device)
    return rows, n_keys, scale, per_head, total, partial


def indexer_kl_loss(q_I, k_I, weights, q, k, softmax_scale=None, *, ks=None, ke=None, cu_seqlens=None,
                    causal=True, attn_lse=None, target="mean", token_mask=None, reduction="mean",
                    total_heads=None, deterministic=False, chunk_rows=None, chunk_keys=None,
                    backend="auto") -> KLLoss:
    """Warm-up (dense) indexer loss: KL(p[t, :] || softmax(I[t, :])) per query row, against a frozen attention.

    Indexer: q_I [T, H_I, D_I], k_I [N, D_I], weights [T, H_I] (see `indexer_logits`). Frozen attention:
    q [T, H, Dqk] and k [N, Dqk] (one key head shared by all query heads, e.g. MLA's MQA mode, Dqk up to
    576) or [N, H_kv, Dqk] (query head h reads key head h // (H / H_kv)); softmax_scale (default
    Dqk ** -0.5); attn_lse [T, H] = logsumexp_s(softmax_scale * q[t, h] . k[s]) over the row's valid keys
    as returned by the attention forward (natural log), computed here when None. Valid keys per row as in
    `indexer_logits` (ks/ke, cu_seqlens + causal, or all). Gradients flow to q_I, k_I and weights only;
    q, k and attn_lse are treated as constants.

    With P[t, h, s] = exp(softmax_scale * q[t, h] . k[s] - attn_lse[t, h]):
      target="mean" (DeepSeek-V3.2): p[t, s] = mean_h P[t, h, s]; per_token[t] = KL(p[t] || softmax(I[t])).
      target="per_head" (needs H_I = H): indexer head h alone, I_h[t, s] = weights[t, h] relu(q_I[t, h] . k_I[s]),
          is matched to attention head h: per_token[t] = mean_h KL(P[t, h] || softmax(I_h[t])).
    KL(p || r) = sum_s p[s] log(p[s] / r[s]) over the valid keys; dL/dI[t, s] = softmax(I[t])[s] - p[t, s].

    token_mask [T] bool (optional) excludes rows (padding): their loss and gradient are 0; rows with no
    valid key are excluded too. reduction: "mean" over the valid rows (0 when there is none) or "sum".

    Tensor parallelism: when q holds a slice of the attention heads, pass total_heads = the number of heads
    over all ranks. "per_head" (with the matching slice of indexer heads) then gives this rank's exact
    share of the loss. "mean" gives this rank's share of the cross-entropy -sum_s p log softmax(I) (the
    target's entropy, constant for the indexer, is left out): summed over ranks it is the loss plus that
    constant. In both cases the gradients summed over ranks (one all-reduce) are exact.

    Host synchronisation: as in `indexer_logits`; ks/ke, cu_seqlens and token_mask may be CPU tensors for
    GPU inputs (no device-to-host copy); on the GPU they cost one synchronising copy in the forward.

    Compute: one sweep over key tiles per chunk of query rows (two when attn_lse is None), online
    log-sum-exp; the backward recomputes the tiles. No [T, N] tensor is formed. Accumulation in float32
    (float64 for float64 inputs), fixed order: bitwise reproducible run to run (`deterministic` has no
    further effect here).

    backend: "auto" (default): the SM90 kernels (sm90.py) when they apply -- an SM90 GPU, bfloat16 q_I, k_I,
    q, k, and for target "mean" up to 128 attention heads (fewer, e.g. a tensor-parallel rank's share, run
    padded to 128 and take the time of 128) of one key head with Dqk a multiple of 64 up to 576, 64 indexer
    heads of dim 64 or 128; for target "per_head" any head count, one or H_kv key heads, Dqk 64, 128
    or 192 and indexer dim 64 -- else the portable code; "torch": the portable code; "sm90": the kernels or an
    error. The kernels compute in fp32 like the portable code, except dS = dI w [S > 0], rounded to bf16 as
    the operand of the dq_I / dk_I WGMMAs; they use no float atomics (deterministic). For "per_head" without
    attn_lse, the LSE comes from the portable code: pass your attention forward's LSE.

    Returns KLLoss(loss, per_token, num_tokens, indexer_lse, attn_lse, target_mass).

    torch.compile: traceable with fullgraph=True (through torch.ops.deep_indexer custom ops); the non-tensor
    arguments are constants of the compiled program (a new value recompiles).
    """
    rows, n_keys, scale, per_head, total, partial = _loss_args(q_I, k_I, weights, q, k, softmax_scale, attn_lse,
                                                               target, reduction, total_heads, token_mask)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    _opt_int("chunk_rows", chunk_rows)
    _opt_int("chunk_keys", chunk_keys)
    backend = _loss_backend(backend, q_I, k_I, q, k, per_head)
    if _compiling():
        return _warmup_loss_traced(q_I, k_I, weights, q, k, scale, ks, ke, cu_seqlens, causal, attn_lse, per_head,
                                   total, partial, token_mask, reduction, (chunk_rows, chunk_keys), backend)
    ks, ke, ks_cpu, ke_cpu = _bounds(rows, n_keys, q_I.device, ks, ke, cu_seqlens, causal)
    if token_mask is not None:  # a masked row becomes empty: no work, no loss
        mask, mask_cpu = _index_pair("token_mask", token_mask, q_I.device)
        ke = torch.where(mask, ke, ks)
        ke_cpu = torch.where(mask_cpu, ke_cpu, ks_cpu)
    valid = ke > ks
    chunks = (chunk_rows, chunk_keys)
    with torch.no_grad():
        q_d, k_d = q.detach(), k.detach()
        if attn_lse is None:
            lse = attention_lse(q_d, k_d, scale, ks, ke, ks_cpu, ke_cpu, *chunks, backend)
        else:
            lse = attn_lse.detach()
    per_token, lse_i, mass = _WarmupKL.apply(q_I, k_I, weights, q_d, k_d, lse, ks, ke, ks_cpu, ke_cpu,
                                             (scale, per_head, total, partial, chunks, backend))
    loss, n = _reduce(per_token, valid, reduction)
    return KLLoss(loss, per_token, n, lse_i, lse, mass)


# ----------------------------------------------------------------------------------------------
# Sparse-stage loss
# ----------------------------------------------------------------------------------------------


class _SparseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_i, k_i, w, q, k, lse_att, idx, ks, ke, cfg):
        scale, per_head, total, partial, deterministic, chunk_rows = cfg
        loss, lse_i, lse_set, mass = ref.sparse_kl_fwd(*_detached(q_i, k_i, w), q, k, scale, lse_att, idx, ks, ke, per_head,
                                                       total, partial, chunk_rows)
        ctx.save_for_backward(q_i, k_i, w, q, k, lse_att, idx, ks, ke)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse_i, lse_set, mass)
        return loss, lse_i, lse_set, mass

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, *_unused):
        q_i, k_i, w, q, k, lse_att, idx, ks, ke = _detached(*ctx.saved_tensors)
        scale, per_head, total, _partial, deterministic, chunk_rows = ctx.cfg
        dq, dk, dw = ref.sparse_kl_bwd(grad, q_i, k_i, w, q, k, scale, lse_att, idx, ks, ke, per_head, total,
                                       deterministic, chunk_rows)
        return _cast(dq, q_i), _cast(dk, k_i), _cast(dw, w), *([None] * 7)


def sparse_indexer_kl_loss(q_I, k_I, weights, q, k, indices, softmax_scale=None, *, ks=None, ke=None,
                           cu_seqlens=None, causal=True, attn_lse=None, target="mean", token_mask=None,
                           reduction="mean", total_heads=None, deterministic=False, chunk_rows=None) -> KLLoss:
    """Sparse-stage indexer loss over given key sets: KL(p[t, S_t] || softmax(I[t, S_t])) per query row.

    Tensors as in `indexer_kl_loss`; indices [T, K] int32/int64: the selected keys of each row as absolute
    key indices in [0, N) (add the row's start if your top-k returns them relative to it), -1 for padding,
    distinct within a row (e.g. torch.topk of the indexer logits, or a radix top-k). When bounds are given
    (ks/ke or cu_seqlens), selected keys outside the row's range are ignored too (a topk over -inf logits).
    The work is O(T * K * (H Dqk + H_I D_I)): only the selected keys are read.

    Target on the set S_t: each attention head's softmax restricted to S_t (what a sparse attention over
    S_t computes), P_S[t, h, j] = softmax_j(softmax_scale * q[t, h] . k[S_t[j]]).
      target="mean": p = mean_h P_S[t, h] -- or, when attn_lse (the dense attention's LSE) is given, the
          dense head-mean target restricted to S_t and renormalised (heads weighted by their mass on S_t).
      target="per_head": indexer head h against P_S[t, h] (attn_lse is not needed).
    The indexer's distribution is softmax(I) over S_t. token_mask, reduction, total_heads as in
    `indexer_kl_loss` (with total_heads and target="mean", attn_lse must be None: the per-head
    renormalisation is then local to each rank).

    `deterministic=True`: the gradient of k_I (a scatter into selected key rows) is accumulated with a
    sort-based, order-independent reduction on CUDA, bitwise reproducible; the default uses atomics there.
    On the CPU both are sequential.

    Host synchronisation: the forward validates `indices` (range, distinct keys) on the host: one
    synchronisation per call. Bounds and token_mask may be CPU tensors. The backward makes no device-to-host
    copy.

    Returns KLLoss(loss, per_token, num_tokens, indexer_lse over the set, attn_lse over the set [T, H],
    target_mass).

    torch.compile: traceable with fullgraph=True (through torch.ops.deep_indexer custom ops); the non-tensor
    arguments are constants of the compiled program (a new value recompiles).
    """
    rows, n_keys, scale, per_head, total, partial = _loss_args(q_I, k_I, weights, q, k, softmax_scale, attn_lse,
                                                               target, reduction, total_heads, token_mask)
    if partial and not per_head and attn_lse is not None:
        raise ValueError("attn_lse: with total_heads (a tensor-parallel slice of heads) and target='mean' the "
                         "target is renormalised per head on the set; pass attn_lse=None")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    _opt_int("chunk_rows", chunk_rows)
    _tensor("indices", indices, 2, _INTS)
    if indices.shape[0] != rows:
        raise ValueError(f"indices: expected shape [{rows}, K], got {tuple(indices.shape)}")
    _same_device(q_I, indices=indices)
    if _compiling():
        return _sparse_loss_traced(q_I, k_I, weights, q, k, indices, scale, ks, ke, cu_seqlens, causal, attn_lse,
                                   per_head, total, partial, token_mask, reduction, deterministic, chunk_rows)
    _check_indices(indices, n_keys)
    bounded = ks is not None or ke is not None or cu_seqlens is not None
    if bounded:
        ks, ke, _, _ = _bounds(rows, n_keys, q_I.device, ks, ke, cu_seqlens, causal)
    idx = indices
    if token_mask is not None:
        idx = torch.where(token_mask.to(q_I.device).unsqueeze(1), idx, torch.full_like(idx, -1))
    sel = idx >= 0
    if bounded:
        sel &= (idx >= ks.unsqueeze(1)) & (idx < ke.unsqueeze(1))
    valid = sel.any(dim=1)
    with torch.no_grad():
        q_d, k_d = q.detach(), k.detach()
        lse = None if attn_lse is None else attn_lse.detach()
    per_token, lse_i, lse_set, mass = _SparseKL.apply(q_I, k_I, weights, q_d, k_d, lse, idx, ks, ke,
                                                      (scale, per_head, total, partial, deterministic, chunk_rows))
    loss, n = _reduce(per_token, valid, reduction)
    return KLLoss(loss, per_token, n, lse_i, lse_set, mass)


# ----------------------------------------------------------------------------------------------
# torch.compile paths: the same compute through the custom ops of torch_ops.py
# ----------------------------------------------------------------------------------------------


def _warmup_loss_traced(q_i, k_i, w, q, k, scale, ks, ke, cu_seqlens, causal, attn_lse, per_head, total, partial,
                        token_mask, reduction, chunks, backend="torch"):
    ops = _ops()
    ks, ke, ks_cpu, ke_cpu = ops.training_bounds(q_i, k_i.shape[0], ks, ke, cu_seqlens, causal, token_mask)
    valid = ke > ks
    q_d, k_d = q.detach(), k.detach()
    if attn_lse is None:
        lse = ops.training_attention_lse(q_d, k_d, scale, ks, ke, ks_cpu, ke_cpu, *chunks, backend)
    else:
        lse = attn_lse.detach()
    per_token, lse_i, mass = ops.indexer_kl_loss_fwd(q_i, k_i, w, q_d, k_d, lse, ks, ke, ks_cpu, ke_cpu, scale,
                                                     per_head, total, partial, *chunks, backend)
    loss, n = _reduce(per_token, valid, reduction)
    return KLLoss(loss, per_token, n, lse_i.detach(), lse, mass.detach())


def _sparse_loss_traced(q_i, k_i, w, q, k, indices, scale, ks, ke, cu_seqlens, causal, attn_lse, per_head, total,
                        partial, token_mask, reduction, deterministic, chunk_rows):
    ops = _ops()
    bounded = ks is not None or ke is not None or cu_seqlens is not None
    if bounded:
        ks, ke, _, _ = ops.training_bounds(q_i, k_i.shape[0], ks, ke, cu_seqlens, causal, None)
    idx = indices
    if token_mask is not None:
        idx = torch.where(token_mask.to(q_i.device).unsqueeze(1), idx, torch.full_like(idx, -1))
    sel = idx >= 0
    if bounded:
        sel = sel & (idx >= ks.unsqueeze(1)) & (idx < ke.unsqueeze(1))
    valid = sel.any(dim=1)
    q_d, k_d = q.detach(), k.detach()
    lse = None if attn_lse is None else attn_lse.detach()
    # NOTES: the indices are validated inside the forward op, after masking: under torch.compile the rows
    # excluded by token_mask are not checked (eager checks every row).
    per_token, lse_i, lse_set, mass = ops.sparse_indexer_kl_loss_fwd(q_i, k_i, w, q_d, k_d, lse, idx, ks, ke, scale,
                                                                     per_head, total, partial, deterministic,
                                                                     chunk_rows, True)
    loss, n = _reduce(per_token, valid, reduction)
    return KLLoss(loss, per_token, n, lse_i.detach(), lse_set.detach(), mass.detach())
