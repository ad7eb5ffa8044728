"""The public ops (SPEC 2). Thin wrappers over deep_indexer._C: validation, allocation and the
launch all happen in C++ on PyTorch's current stream of the inputs' device."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C

# Under torch.compile the public functions go through torch.ops.deep_indexer.* (traceable, with
# fake implementations); in eager mode they call the extension directly (lowest host overhead).
_compiling = torch.compiler.is_compiling


def _ops():
    from . import torch_ops  # noqa: F401  (registers torch.ops.deep_indexer.*)

    return torch.ops.deep_indexer


def clean_logits(
    logits: torch.Tensor,
    cu_seq_len_k_start: Optional[torch.Tensor],
    cu_seq_len_k_end: torch.Tensor,
    next_n: int = 1,
) -> torch.Tensor:
    """Writes -inf outside each row's key range, in place, and returns `logits` (SPEC 2.4).

    logits: [M, N] float32/bfloat16 (stride(1) == 1, rows may be padded). ks/ke: int32
    [M // next_n]; ks may be None (0). Row r (group g = r // next_n, i = r % next_n) keeps
    columns max(ks[g], 0) <= j < min(ke[g] - next_n + i + 1, N).
    """
    if _compiling():
        _ops().clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n)
        return logits
    return _C.clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n)


def _elem_bytes(logits_dtype: torch.dtype, op: str) -> int:
    from .torch_ops import elem_bytes

    return elem_bytes(logits_dtype, f"deep_indexer.{op}")


def fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    *,
    logits_dtype: torch.dtype = torch.float32,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Prefill indexer logits (SPEC 2.1): [S, SKV], logits[i, j] = k_scale[j] * sum_h w[i, h] *
    relu(q[i, h] . k[j]) for max(ks[i], 0) <= j < min(ke[i], SKV); -inf elsewhere when clean_logits.

    q [S, H, D] fp8 e4m3 (H in 16/32/64/128, D in 32/64/128); kv = (k [SKV, D] fp8, k_scale [SKV]
    float32); weights [S, H] float32 (rows may be padded). Returns a view whose row stride may be
    padded, or `out` ([S, SKV], logits_dtype, stride(1) == 1) when given.
    """
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ValueError("deep_indexer.fp8_mqa_logits: kv must be a tuple (k [SKV, D] fp8, k_scale [SKV] float32)")
    if _compiling():
        if out is None:
            return _ops().fp8_mqa_logits(q, kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                                         logits_dtype)
        _ops().fp8_mqa_logits_out(q, kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, out)
        return out
    return _C.fp8_mqa_logits(q, kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end, bool(clean_logits),
                             _elem_bytes(logits_dtype, "fp8_mqa_logits"), out)


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor,
    block_kv: int,
    num_sms: Optional[int] = None,
    *,
    indices: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode work split, computed on the GPU without a host sync: int32 [num_sms + 1, 2]
    (sequence, segment) start pairs over segments of 256 tokens; see reference.paged_mqa_logits_metadata.
    context_lens: int32 [B] or [B, next_n] (next_n 1..8). num_sms defaults to the device's SM count.
    indices: optional int32 [R] request id per q row for a varlen batch (then context_lens is [R] or
    [R, 1]); pass the same tensor to fp8_paged_mqa_logits. Every row is scheduled by its own length."""
    if _compiling():
        if out is None:
            return _ops().get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices)
        _ops().get_paged_mqa_logits_metadata_out(context_lens, block_kv, out, indices)
        return out
    return _C.get_paged_mqa_logits_metadata(context_lens, int(block_kv), num_sms, out, indices)


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    *,
    logits_dtype: torch.dtype = torch.float32,
    indices: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode indexer logits over a paged fp8 KV cache: [B * next_n, max_context_len].

    q [B, next_n, H, D] fp8 (next_n 1..8, H 16/32/64/128, D 64/128); kv_cache uint8
    [num_blocks, block_kv (32/64), 1, D + 4] (fp8 keys then fp32 scales per block); weights
    [B * next_n, H] float32 (rows may be padded to a multiple of 4 elements; 16-byte aligned); context_lens int32 [B] (row (b, i) sees j <= ctx[b] - next_n + i) or
    [B, next_n] (row (b, i) sees j < ctx[b, i]); block_table int32 [B, max_blocks]; schedule_meta from
    get_paged_mqa_logits_metadata with the same block_kv. max_context_len must be >= every context length.

    Varlen batches: indices int32 [R] gives the request id of each q row (q is then [R, 1, H, D],
    weights [R, H], context_lens [R] or [R, 1] with each row's own length, block_table [R, max_blocks]).
    A run of equal consecutive ids is one request: all its rows read the block-table row of the run's
    first row (the other rows' block-table entries are ignored), and row r sees keys j < context_lens[r].
    Id values are only compared with their neighbours, so any int32 value is safe. Pass the same
    indices to get_paged_mqa_logits_metadata.
    """
    if _compiling():
        if out is None:
            return _ops().fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                               max_context_len, clean_logits, logits_dtype, indices)
        _ops().fp8_paged_mqa_logits_out(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                        max_context_len, clean_logits, out, indices)
        return out
    return _C.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                   int(max_context_len), bool(clean_logits),
                                   _elem_bytes(logits_dtype, "fp8_paged_mqa_logits"), out, indices)
