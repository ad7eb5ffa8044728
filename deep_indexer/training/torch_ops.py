"""torch.ops.deep_indexer.* for the training ops: forward and backward as custom ops with fake (meta)
implementations and autograd registrations, so `indexer_logits`, `indexer_kl_loss` and
`sparse_indexer_kl_loss` trace under torch.compile(fullgraph=True).

The public functions in `ops.py` route through these ops while torch.compile traces them; in eager mode they
keep their autograd.Functions (same compute, `reference.py`). Everything that reads tensor values on the host
(bounds validation and the CPU copy that plans the loops, the `indices` checks) happens inside the ops, where
tensors are real. Non-tensor arguments (softmax_scale, target, total_heads, chunk sizes, backend, ...) are
Python constants of the traced program: torch.compile specialises on them.

    training_bounds(like, n_keys, ks?, ke?, cu_seqlens?, causal, token_mask?) -> (ks, ke, ks_cpu, ke_cpu)
    training_attention_lse(q, k, scale, ks, ke, ks_cpu, ke_cpu, chunk_rows?, chunk_keys?) -> lse [T, H]
    indexer_logits_fwd / indexer_logits_bwd
    indexer_kl_loss_fwd / indexer_kl_loss_bwd
    sparse_indexer_kl_loss_fwd / sparse_indexer_kl_loss_bwd
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference as ref
from .core import (_bounds, _cast, _check_indices, _detached, _index_pair, _sm90_logits, attention_lse,
                   logits_backward, warmup_backward, warmup_forward)

_LIB = "deep_indexer"


def _cpu_empty(rows) -> Tensor:
    return torch.empty((rows,), dtype=torch.int64, device="cpu")


def _fresh(t: Tensor, *inputs) -> Tensor:
    """t, cloned when it is one of the op's inputs (custom op outputs must not alias inputs)."""
    for x in inputs:
        if x is not None and t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and t.device == x.device:
            return t.clone()
    return t


# ------------------------------------------------------------------------------------ bounds
@torch.library.custom_op(f"{_LIB}::training_bounds", mutates_args=())
def training_bounds(like: Tensor, n_keys: int, ks: Optional[Tensor], ke: Optional[Tensor],
                    cu_seqlens: Optional[Tensor], causal: bool,
                    token_mask: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Validated int64 bounds of `like.shape[0]` rows on like's device and on the CPU (masked rows emptied)."""
    ks_d, ke_d, ks_c, ke_c = _bounds(like.shape[0], n_keys, like.device, ks, ke, cu_seqlens, causal)
    if token_mask is not None:
        mask, mask_cpu = _index_pair("token_mask", token_mask, like.device)
        ke_d = torch.where(mask, ke_d, ks_d)
        ke_c = torch.where(mask_cpu, ke_c, ks_c)
    ins = (ks, ke, cu_seqlens, token_mask)
    ks_d, ke_d = _fresh(ks_d, *ins), _fresh(ke_d, *ins)
    return ks_d, ke_d, _fresh(ks_c, *ins, ks_d, ke_d), _fresh(ke_c, *ins, ks_d, ke_d)


@training_bounds.register_fake
def _(like, n_keys, ks, ke, cu_seqlens, causal, token_mask):
    rows = like.shape[0]
    return (like.new_empty((rows,), dtype=torch.int64), like.new_empty((rows,), dtype=torch.int64),
            _cpu_empty(rows), _cpu_empty(rows))


# ------------------------------------------------------------------------------------ attention LSE
@torch.library.custom_op(f"{_LIB}::training_attention_lse", mutates_args=())
def training_attention_lse(q: Tensor, k: Tensor, scale: float, ks: Tensor, ke: Tensor, ks_cpu: Tensor,
                           ke_cpu: Tensor, chunk_rows: Optional[int] = None,
                           chunk_keys: Optional[int] = None, backend: str = "torch") -> Tensor:
    return attention_lse(q, k, scale, ks, ke, ks_cpu, ke_cpu, chunk_rows, chunk_keys, backend)


@training_attention_lse.register_fake
def _(q, k, scale, ks, ke, ks_cpu, ke_cpu, chunk_rows=None, chunk_keys=None, backend="torch"):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=ref.accum_dtype(q, k))


# ------------------------------------------------------------------------------------ indexer logits
@torch.library.custom_op(f"{_LIB}::indexer_logits_fwd", mutates_args=())
def indexer_logits_fwd(q_i: Tensor, k_i: Tensor, w: Tensor, ks: Tensor, ke: Tensor, ks_cpu: Tensor, ke_cpu: Tensor,
                       chunk_rows: Optional[int] = None, chunk_keys: Optional[int] = None,
                       backend: str = "torch") -> Tensor:
    if backend == "sm90":
        return _sm90_logits(q_i, k_i, w, ks, ke)
    q_i, k_i, w = _detached(q_i, k_i, w)
    return ref.indexer_logits_fwd(q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunk_rows, chunk_keys)


@indexer_logits_fwd.register_fake
def _(q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunk_rows=None, chunk_keys=None, backend="torch"):
    dtype = torch.float32 if backend == "sm90" else ref.accum_dtype(q_i, k_i, w)
    return q_i.new_empty((q_i.shape[0], k_i.shape[0]), dtype=dtype)


@torch.library.custom_op(f"{_LIB}::indexer_logits_bwd", mutates_args=())
def indexer_logits_bwd(grad: Tensor, q_i: Tensor, k_i: Tensor, w: Tensor, ks: Tensor, ke: Tensor, ks_cpu: Tensor,
                       ke_cpu: Tensor, chunk_rows: Optional[int] = None, chunk_keys: Optional[int] = None,
                       backend: str = "torch") -> tuple[Tensor, Tensor, Tensor]:
    """(dq_I, dk_I, dw) in the inputs' dtypes."""
    grad, q_i, k_i, w = _detached(grad, q_i, k_i, w)
    dq, dk, dw = logits_backward(grad, q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunk_rows, chunk_keys, backend)
    return _cast(dq, q_i), _cast(dk, k_i), _cast(dw, w)


@indexer_logits_bwd.register_fake
def _(grad, q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunk_rows=None, chunk_keys=None, backend="torch"):
    return torch.empty_like(q_i), torch.empty_like(k_i), torch.empty_like(w)


def _logits_setup(ctx, inputs, output):
    q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunk_rows, chunk_keys, backend = inputs
    ctx.save_for_backward(q_i, k_i, w, ks, ke, ks_cpu, ke_cpu)
    ctx.chunks = (chunk_rows, chunk_keys, backend)


def _logits_backward(ctx, grad):
    q_i, k_i, w, ks, ke, ks_cpu, ke_cpu = ctx.saved_tensors
    dq, dk, dw = indexer_logits_bwd(grad, q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, *ctx.chunks)
    return dq, dk, dw, None, None, None, None, None, None, None


indexer_logits_fwd.register_autograd(_logits_backward, setup_context=_logits_setup)


# ------------------------------------------------------------------------------------ warm-up loss
@torch.library.custom_op(f"{_LIB}::indexer_kl_loss_fwd", mutates_args=())
def indexer_kl_loss_fwd(q_i: Tensor, k_i: Tensor, w: Tensor, q: Tensor, k: Tensor, lse_att: Tensor, ks: Tensor,
                        ke: Tensor, ks_cpu: Tensor, ke_cpu: Tensor, scale: float, per_head: bool, total_heads: int,
                        partial: bool, chunk_rows: Optional[int] = None,
                        chunk_keys: Optional[int] = None, backend: str = "torch") -> tuple[Tensor, Tensor, Tensor]:
    """(per_token loss [T], indexer_lse, target_mass) in the accumulation dtype."""
    q_i, k_i, w, q, k, lse_att = _detached(q_i, k_i, w, q, k, lse_att)
    return warmup_forward(q_i, k_i, w, q, k, scale, lse_att, ks, ke, ks_cpu, ke_cpu, per_head, total_heads, partial,
                          chunk_rows, chunk_keys, backend)


def _stat_shape(q, per_head):
    return (q.shape[0], q.shape[1]) if per_head else (q.shape[0],)


@indexer_kl_loss_fwd.register_fake
def _(q_i, k_i, w, q, k, lse_att, ks, ke, ks_cpu, ke_cpu, scale, per_head, total_heads, partial, chunk_rows=None,
      chunk_keys=None, backend="torch"):
    acc = ref.accum_dtype(q_i, k_i, w, q, k)
    stat = _stat_shape(q, per_head)
    return q.new_empty((q.shape[0],), dtype=acc), q.new_empty(stat, dtype=acc), q.new_empty(stat, dtype=acc)


@torch.library.custom_op(f"{_LIB}::indexer_kl_loss_bwd", mutates_args=())
def indexer_kl_loss_bwd(grad: Tensor, q_i: Tensor, k_i: Tensor, w: Tensor, q: Tensor, k: Tensor, lse_att: Tensor,
                        lse_i: Tensor, mass: Tensor, ks: Tensor, ke: Tensor, ks_cpu: Tensor, ke_cpu: Tensor,
                        scale: float, per_head: bool, total_heads: int, chunk_rows: Optional[int] = None,
                        chunk_keys: Optional[int] = None, backend: str = "torch") -> tuple[Tensor, Tensor, Tensor]:
    """(dq_I, dk_I, dw) in the inputs' dtypes for the per-token loss gradient grad [T]."""
    grad, q_i, k_i, w, q, k, lse_att = _detached(grad, q_i, k_i, w, q, k, lse_att)
    dq, dk, dw = warmup_backward(grad, q_i, k_i, w, q, k, scale, lse_att, lse_i, mass, ks, ke, ks_cpu, ke_cpu,
                                 per_head, total_heads, chunk_rows, chunk_keys, backend)
    return _cast(dq, q_i), _cast(dk, k_i), _cast(dw, w)


@indexer_kl_loss_bwd.register_fake
def _(grad, q_i, k_i, w, q, k, lse_att, lse_i, mass, ks, ke, ks_cpu, ke_cpu, scale, per_head, total_heads,
      chunk_rows=None, chunk_keys=None, backend="torch"):
    return torch.empty_like(q_i), torch.empty_like(k_i), torch.empty_like(w)


def _warmup_setup(ctx, inputs, output):
    q_i, k_i, w, q, k, lse_att, ks, ke, ks_cpu, ke_cpu, scale, per_head, total, _partial, cr, ck, backend = inputs
    _loss, lse_i, mass = output
    ctx.save_for_backward(q_i, k_i, w, q, k, lse_att, lse_i, mass, ks, ke, ks_cpu, ke_cpu)
    ctx.cfg = (scale, per_head, total, cr, ck, backend)


def _warmup_backward(ctx, grad, _g_lse, _g_mass):
    # NOTES: only the per-token loss is differentiable; the statistics are detached by the caller.
    dq, dk, dw = indexer_kl_loss_bwd(grad, *ctx.saved_tensors, *ctx.cfg)
    return dq, dk, dw, *([None] * 14)


indexer_kl_loss_fwd.register_autograd(_warmup_backward, setup_context=_warmup_setup)


# ------------------------------------------------------------------------------------ sparse loss
@torch.library.custom_op(f"{_LIB}::sparse_indexer_kl_loss_fwd", mutates_args=())
def sparse_indexer_kl_loss_fwd(q_i: Tensor, k_i: Tensor, w: Tensor, q: Tensor, k: Tensor, lse_att: Optional[Tensor],
                               idx: Tensor, ks: Optional[Tensor], ke: Optional[Tensor], scale: float, per_head: bool,
                               total_heads: int, partial: bool, deterministic: bool = False,
                               chunk_rows: Optional[int] = None,
                               check_indices: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(per_token loss [T], indexer_lse over the set, attention lse over the set [T, H], target_mass).
    With `check_indices`, validates idx first (range [-1, N), distinct keys per row: reads idx on the host).
    `deterministic` is for the backward (the k_I scatter)."""
    if check_indices:
        _check_indices(idx, k_i.shape[0])
    q_i, k_i, w, q, k, lse_att = _detached(q_i, k_i, w, q, k, lse_att)
    return ref.sparse_kl_fwd(q_i, k_i, w, q, k, scale, lse_att, idx, ks, ke, per_head, total_heads, partial,
                             chunk_rows)


@sparse_indexer_kl_loss_fwd.register_fake
def _(q_i, k_i, w, q, k, lse_att, idx, ks, ke, scale, per_head, total_heads, partial, deterministic=False,
      chunk_rows=None, check_indices=True):
    acc = ref.accum_dtype(q_i, k_i, w, q, k)
    stat = _stat_shape(q, per_head)
    return (q.new_empty((q.shape[0],), dtype=acc), q.new_empty(stat, dtype=acc),
            q.new_empty((q.shape[0], q.shape[1]), dtype=acc), q.new_empty(stat, dtype=acc))


@torch.library.custom_op(f"{_LIB}::sparse_indexer_kl_loss_bwd", mutates_args=())
def sparse_indexer_kl_loss_bwd(grad: Tensor, q_i: Tensor, k_i: Tensor, w: Tensor, q: Tensor, k: Tensor,
                               lse_att: Optional[Tensor], idx: Tensor, ks: Optional[Tensor], ke: Optional[Tensor],
                               scale: float, per_head: bool, total_heads: int, deterministic: bool,
                               chunk_rows: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq_I, dk_I, dw) in the inputs' dtypes."""
    grad, q_i, k_i, w, q, k, lse_att = _detached(grad, q_i, k_i, w, q, k, lse_att)
    dq, dk, dw = ref.sparse_kl_bwd(grad, q_i, k_i, w, q, k, scale, lse_att, idx, ks, ke, per_head, total_heads,
                                   deterministic, chunk_rows)
    return _cast(dq, q_i), _cast(dk, k_i), _cast(dw, w)


@sparse_indexer_kl_loss_bwd.register_fake
def _(grad, q_i, k_i, w, q, k, lse_att, idx, ks, ke, scale, per_head, total_heads, deterministic, chunk_rows=None):
    return torch.empty_like(q_i), torch.empty_like(k_i), torch.empty_like(w)


def _sparse_setup(ctx, inputs, output):
    q_i, k_i, w, q, k, lse_att, idx, ks, ke, scale, per_head, total, _partial, deterministic, chunk_rows, _chk = inputs
    ctx.save_for_backward(q_i, k_i, w, q, k, lse_att, idx, ks, ke)
    ctx.cfg = (scale, per_head, total, deterministic, chunk_rows)


def _sparse_backward(ctx, grad, *_unused):
    dq, dk, dw = sparse_indexer_kl_loss_bwd(grad, *ctx.saved_tensors, *ctx.cfg)
    return dq, dk, dw, *([None] * 13)


sparse_indexer_kl_loss_fwd.register_autograd(_sparse_backward, setup_context=_sparse_setup)
