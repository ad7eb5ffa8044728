"""Validation, row bounds and the backend dispatch of the training ops, shared by `ops.py` (the public functions
and their autograd.Functions) and `torch_ops.py` (the custom ops torch.compile traces): both import from here,
neither from the other's internals.
"""
from __future__ import annotations

import collections

import torch

import deep_indexer._C as _C
from . import reference as ref
from . import sm90

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INTS = (torch.int32, torch.int64)


def _tensor(name: str, t, dims: int, dtypes=_FLOATS) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    return t


def _same_device(ref_t: torch.Tensor, **named) -> None:
    for name, t in named.items():
        if t is not None and t.device != ref_t.device:
            raise ValueError(f"{name}: expected device {ref_t.device}, got {t.device}")


def _shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def _opt_int(name: str, v, min_value: int = 1) -> None:
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int or None, got {type(v).__name__}")
    if v < min_value:
        raise ValueError(f"{name}: expected >= {min_value}, got {v}")


def packed_bounds(cu_seqlens: torch.Tensor, causal: bool = True, query_positions: torch.Tensor | None = None):
    """Per-row key bounds (ks, ke), int64, for packed sequences.

    cu_seqlens [B + 1] (int32/int64, starts at 0, non-decreasing) splits the packed key tokens into
    sequences. Query row t is key token t unless `query_positions` [T] gives the global position of each
    local query row (context parallelism: a rank's query rows are a slice of the packed sequence while the
    keys are all of it). A row sees its own sequence's keys: all of them, or with `causal` those at
    positions <= its own. The result is on cu_seqlens' device; compute it on the CPU (and pass ks/ke as CPU
    tensors) to keep the training ops free of host synchronisation.
    """
    _tensor("cu_seqlens", cu_seqlens, 1, _INTS)
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens: expected at least one entry (B + 1 with B >= 0)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    cu = cu_seqlens.long()
    cu_cpu = cu.cpu()
    if int(cu_cpu[0]) != 0 or bool((cu_cpu[1:] < cu_cpu[:-1]).any()):
        raise ValueError(f"cu_seqlens: expected 0 first and non-decreasing values, got {cu_cpu.tolist()[:8]}...")
    total = int(cu_cpu[-1])
    if query_positions is None:
        pos = torch.arange(total, device=cu.device)
    else:
        _tensor("query_positions", query_positions, 1, _INTS)
        _same_device(cu, query_positions=query_positions)
        pos = query_positions.long()
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= total):
            raise ValueError(f"query_positions: expected values in [0, {total}), got [{int(pos.min())}, {int(pos.max())}]")
    seq = torch.searchsorted(cu[1:], pos, right=True)  # sequence of each row
    ks = cu[seq]
    ke = pos + 1 if causal else cu[seq + 1]
    return ks, ke


def _index_pair(name: str, t: torch.Tensor, device: torch.device):
    """(t on `device`, t on the CPU) for a small index/mask tensor given on either. A CPU tensor reaches a CUDA
    device through pinned memory with non_blocking (no host sync); a device tensor is copied back (a sync)."""
    if t.device == device:
        return t, t.cpu()
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected device {device} or cpu, got {t.device}")
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True), t
    return t.to(device), t


# (device, rows, keys, causal, cu_seqlens values) -> bounds of _bounds: a training step calls the ops of every
# layer with the same packing; the cached tensors are never written.
_BOUNDS_CACHE: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_BOUNDS_CACHE_SIZE = 16


def _cached_bounds(key, make):
    hit = _BOUNDS_CACHE.get(key)
    if hit is None:
        hit = _BOUNDS_CACHE[key] = make()
        if len(_BOUNDS_CACHE) > _BOUNDS_CACHE_SIZE:
            _BOUNDS_CACHE.popitem(last=False)
    else:
        _BOUNDS_CACHE.move_to_end(key)
    return hit


def _bounds(rows: int, n_keys: int, device, ks, ke, cu_seqlens, causal):
    """(ks, ke) on the device and on the CPU, int64, validated.

    NOTES: the CPU copy plans the Python loop over row chunks and key tiles (and validates). Bounds given on
    the CPU (cu_seqlens, ks/ke) or no bounds cost no device-to-host copy; bounds on the device cost one
    synchronising copy here, in the forward only (the backward reuses the CPU copy). Bounds from
    cu_seqlens or from no bounds are cached by value (host work of ~0.5 ms per call on a GPU host)."""
    device = torch.device(device)
    if cu_seqlens is not None:
        if ks is not None or ke is not None:
            raise ValueError("give either (ks, ke) or cu_seqlens, not both")
        _tensor("cu_seqlens", cu_seqlens, 1, _INTS)
        if cu_seqlens.device != device and cu_seqlens.device.type != "cpu":
            raise ValueError(f"cu_seqlens: expected device {device} or cpu, got {cu_seqlens.device}")
        cu_host = cu_seqlens.cpu()  # the one synchronising copy when cu_seqlens is on the device
        total = int(cu_host[-1]) if cu_host.numel() else 0
        if total != rows or total != n_keys:
            raise ValueError(f"cu_seqlens: expected the last entry to equal the query rows ({rows}) and the keys "
                             f"({n_keys}), got {total}; use packed_bounds(..., query_positions=) for local rows")

        def make():
            ks_h, ke_h = packed_bounds(cu_host, causal)  # on the host, then to the device without a sync
            (ks_d, ks_c), (ke_d, ke_c) = _index_pair("ks", ks_h, device), _index_pair("ke", ke_h, device)
            return ks_d, ke_d, ks_c, ke_c

        return _cached_bounds((str(device), rows, n_keys, causal, tuple(cu_host.long().tolist())), make)
    elif ks is None and ke is None:
        def make():
            ks_cpu = torch.zeros(rows, dtype=torch.int64)
            ke_cpu = torch.full((rows,), n_keys, dtype=torch.int64)
            return (torch.zeros(rows, dtype=torch.int64, device=device),
                    torch.full((rows,), n_keys, dtype=torch.int64, device=device), ks_cpu, ke_cpu)

        return _cached_bounds((str(device), rows, n_keys, None, None), make)
    else:
        if ks is None or ke is None:
            raise ValueError("ks and ke: give both or neither")
        for name, t in (("ks", ks), ("ke", ke)):
            _tensor(name, t, 1, _INTS)
            _shape(name, t, (rows,))
        if ks.device != ke.device:
            raise ValueError(f"ke: expected the device of ks ({ks.device}), got {ke.device}")
        ks, ke = ks.long(), ke.long()
    (ks, ks_cpu), (ke, ke_cpu) = _index_pair("ks", ks, device), _index_pair("ke", ke, device)
    for name, t in (("ks", ks_cpu), ("ke", ke_cpu)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > n_keys):
            raise ValueError(f"{name}: expected values in [0, {n_keys}], got [{int(t.min())}, {int(t.max())}]")
    return ks, ke, ks_cpu, ke_cpu


def _check_indices(indices: torch.Tensor, n_keys: int) -> None:
    """indices [T, K]: values in [-1, n_keys), distinct keys within a row (reads results on the host)."""
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= n_keys:
            raise ValueError(f"indices: expected values in [-1, {n_keys}) (-1 = padding), got [{lo}, {hi}]")
        srt = indices.sort(dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if bool(dup.any()):
            r = int(dup.any(dim=1).nonzero()[0])
            raise ValueError(f"indices: expected distinct keys within a row, row {r} repeats a key")


def _detached(*ts):
    """The tensors without their requires_grad flag (None kept).

    NOTES: torch.matmul picks its algorithm (fold into one mm, or batched) by the operands' requires_grad flag,
    which changes the summation order: the compute always sees detached inputs, so eager mode, the custom ops
    and torch.compile give bitwise identical results."""
    return tuple(None if t is None else t.detach() for t in ts)


def _cast(g, like):
    return None if g is None else g.to(like.dtype)


def logits_backward(grad, q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunk_rows, chunk_keys, backend):
    """(dq_I, dk_I, dw) in the accumulation dtype: on the SM90 kernels for backend "sm90" where they apply
    (64 indexer heads of dim 64 or 128, bf16), else the portable code."""
    if backend == "sm90" and sm90.logits_unsupported(q_i, k_i) is None:
        return sm90.logits_bwd(grad, q_i, k_i, w, ks, ke, ks_cpu, ke_cpu)
    return ref.indexer_logits_bwd(grad, q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunk_rows, chunk_keys)


def _sm90_logits(q_i, k_i, w, ks, ke):
    """Forward on the SM90 kernel (the prefill kernel's bf16 form): it writes every entry, -inf outside."""
    if q_i.dtype != torch.bfloat16 or k_i.dtype != torch.bfloat16:
        raise TypeError(f"backend='sm90': q_I and k_I must be bfloat16, got {q_i.dtype} and {k_i.dtype}")
    out = torch.empty((q_i.shape[0], k_i.shape[0]), dtype=torch.float32, device=q_i.device)
    return _C.bf16_indexer_logits(q_i.contiguous(), k_i.contiguous(), w.float().contiguous(), ks.int().contiguous(),
                                  ke.int().contiguous(), out, clean=True)


def warmup_forward(q_i, k_i, w, q, k, scale, lse_att, ks, ke, ks_cpu, ke_cpu, per_head, total, partial, chunk_rows,
                   chunk_keys, backend):
    """(per_token, indexer_lse, target_mass): the SM90 kernels for backend "sm90" (resolved by _loss_backend),
    else reference.warmup_kl_fwd."""
    if backend == "sm90" and per_head:
        return sm90.per_head_fwd(q_i, k_i, w, q, k, scale, lse_att, ks, ke, total)
    if backend == "sm90":
        return sm90.mean_fwd(q_i, k_i, w, q, k, scale, lse_att, ks, ke, ks_cpu, ke_cpu, total, partial)
    return ref.warmup_kl_fwd(q_i, k_i, w, q, k, scale, lse_att, ks, ke, ks_cpu, ke_cpu, per_head, total, partial,
                             chunk_rows, chunk_keys)


def warmup_backward(grad, q_i, k_i, w, q, k, scale, lse_att, lse_i, mass, ks, ke, ks_cpu, ke_cpu, per_head, total,
                    chunk_rows, chunk_keys, backend):
    if backend == "sm90" and per_head:
        return sm90.per_head_bwd(grad, q_i, k_i, w, q, k, scale, lse_att, lse_i, mass, ks, ke, total)
    if backend == "sm90":
        return sm90.mean_bwd(grad, q_i, k_i, w, q, k, scale, lse_att, lse_i, mass, ks, ke, ks_cpu, ke_cpu, total)
    return ref.warmup_kl_bwd(grad, q_i, k_i, w, q, k, scale, lse_att, lse_i, mass, ks, ke, ks_cpu, ke_cpu, per_head,
                             total, chunk_rows, chunk_keys)


def attention_lse(q, k, scale, ks, ke, ks_cpu, ke_cpu, chunk_rows, chunk_keys, backend):
    """The attention's LSE [T, H] when the caller gives none: on the SM90 kernel for backend "sm90"."""
    if backend == "sm90" and sm90.lse_unsupported(q, k) is None:
        return sm90.attention_lse(q, k, scale, ks, ke)
    return ref.attention_lse(q, k, scale, ks, ke, ks_cpu, ke_cpu, chunk_rows, chunk_keys)
