"""The public ops (docs/api.md). Thin wrappers over deep_indexer._C: validation, allocation and the
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
    """Writes -inf outside each row's key range, in place, and returns `logits` (docs/api.md).

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
    max_seqlen_k: int = 0,
    logits_dtype: torch.dtype = torch.float32,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Prefill indexer logits: I[i, j] = k_scale[j] * sum_h w[i, h] * relu(q[i, h] . k[j]).

    q [S, H, D] fp8 e4m3 (H in 16/32/64/128, D in 32/64/128); kv = (k [SKV, D] fp8, k_scale [SKV]
    float32); weights [S, H] float32 or bfloat16 (unit inner stride, rows may be padded);
    cu_seq_len_k_start / cu_seq_len_k_end (ks, ke) int32 [S]. Row i covers the keys
    lo_i <= j < hi_i with lo_i = max(ks[i], 0) (a negative start means 0) and hi_i = min(ke[i], SKV);
    the row is empty when hi_i <= lo_i.

    max_seqlen_k = 0 (default): returns [S, SKV] with logits[i, j] = I[i, j] inside the row's range;
    with clean_logits every other entry is -inf, else unspecified.

    max_seqlen_k = M > 0 (compressed logits): returns [S, M] with logits[i, c] = I[i, lo_i + c] for
    0 <= c < min(hi_i - lo_i, M). A row longer than M gets only its first M keys (lo_i .. lo_i + M - 1);
    nothing is written out of bounds and no host sync is needed. With clean_logits the columns
    past min(hi_i - lo_i, M) are -inf, else unspecified.

    logits_dtype: float32 or bfloat16. Returns a view whose row stride may be padded (stride(1) == 1),
    or `out` when given (shape [S, SKV] or [S, M], logits_dtype, stride(1) == 1).
    """
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ValueError("deep_indexer.fp8_mqa_logits: kv must be a tuple (k [SKV, D] fp8, k_scale [SKV] float32)")
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int):
        raise TypeError(f"deep_indexer.fp8_mqa_logits: max_seqlen_k must be an int, got {type(max_seqlen_k).__name__}")
    if _compiling():
        if out is None:
            return _ops().fp8_mqa_logits(q, kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                                         logits_dtype, max_seqlen_k)
        _ops().fp8_mqa_logits_out(q, kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, out,
                                  max_seqlen_k)
        return out
    return _C.fp8_mqa_logits(q, kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end, bool(clean_logits),
                             _elem_bytes(logits_dtype, "fp8_mqa_logits"), out, max_seqlen_k)


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor, block_kv: int, num_sms: Optional[int] = None, *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Decode work split (docs/api.md), computed on the GPU without a host sync: int32 [num_sms + 1, 2]
    (sequence, segment) start pairs over segments of 256 tokens; see reference.paged_mqa_logits_metadata.
    context_lens: int32 [B] or [B, next_n]. num_sms defaults to the device's SM count."""
    if _compiling():
        if out is None:
            return _ops().get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)
        _ops().get_paged_mqa_logits_metadata_out(context_lens, block_kv, out)
        return out
    return _C.get_paged_mqa_logits_metadata(context_lens, int(block_kv), num_sms, out)


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
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode indexer logits over a paged fp8 KV cache (docs/api.md): [B * next_n, max_context_len].

    q [B, next_n, H, D] fp8 (next_n 1..4, H 16/32/64/128, D 64/128); kv_cache uint8
    [num_blocks, block_kv (32/64), 1, D + 4] (fp8 keys then fp32 scales per block); weights
    [B * next_n, H] float32 (rows may be padded to a multiple of 4 elements; 16-byte aligned); context_lens int32 [B] (row (b, i) sees j <= ctx[b] - next_n + i) or
    [B, next_n] (row (b, i) sees j < ctx[b, i]); block_table int32 [B, max_blocks]; schedule_meta from
    get_paged_mqa_logits_metadata with the same block_kv. max_context_len must be >= every context length.
    """
    if _compiling():
        if out is None:
            return _ops().fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                               max_context_len, clean_logits, logits_dtype)
        _ops().fp8_paged_mqa_logits_out(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                        max_context_len, clean_logits, out)
        return out
    return _C.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                   int(max_context_len), bool(clean_logits),
                                   _elem_bytes(logits_dtype, "fp8_paged_mqa_logits"), out)


def topk_indices(
    logits: torch.Tensor,
    k: int,
    cu_seq_len_k_start: Optional[torch.Tensor] = None,
    cu_seq_len_k_end: Optional[torch.Tensor] = None,
    *,
    context_lens: Optional[torch.Tensor] = None,
    next_n: int = 1,
    sorted: bool = False,
    index_mode: str = "relative",
    block_table: Optional[torch.Tensor] = None,
    block_size: Optional[int] = None,
    row_offset: Optional[torch.Tensor] = None,
    return_values: bool = False,
    out: Optional[torch.Tensor] = None,
    out_values: Optional[torch.Tensor] = None,
):
    """Exact, deterministic top-k column indices of every row of `logits` (see docs/topk.md).

    logits: [M, N] float32/bfloat16, stride(1) == 1 (rows may be padded). Row ranges: either
    ks/ke int32 [M // next_n] (ks None = 0; row (g, i) = row g * next_n + i covers
    max(ks[g], 0) <= j < min(ke[g] - next_n + i + 1, N)), or context_lens int32 [B] (M = B * next_n;
    row (b, i) covers j < ctx[b] - next_n + i + 1) or [B, next_n] (row (b, i) covers j < ctx[b, i]).
    k: 1..2048. Returns int32 [M, k] (and the values, logits dtype, with return_values=True):
    the k largest values of each row's range, ties to the smaller column, NaN ranked below -inf;
    a row with n < k valid columns returns all n, then -1 (value -inf). Order: ascending column
    (sorted=False) or value descending, then column ascending (sorted=True).
    index_mode: "relative" (j - row start), "absolute" (j) or "slot" (p = j - row start ->
    block_table[seq, p // block_size] * block_size + p % block_size, seq = row // next_n; -1 past
    the table's columns). row_offset int32 [M] is added to every index != -1. out / out_values:
    preallocated outputs ([M, k], stride(1) == 1) for CUDA graphs.
    """
    if _compiling():
        if out is None:
            out = logits.new_empty((logits.shape[0], k), dtype=torch.int32)
        if return_values and out_values is None:
            out_values = logits.new_empty((logits.shape[0], k))
        _ops().topk_indices_out(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted,
                                index_mode, block_table, 0 if block_size is None else block_size, row_offset, out,
                                out_values if return_values else None)
        return (out, out_values) if return_values else out
    res = _C.topk_indices(logits, int(k), cu_seq_len_k_start, cu_seq_len_k_end, context_lens, int(next_n),
                          bool(sorted), str(index_mode), block_table, 0 if block_size is None else int(block_size),
                          row_offset, bool(return_values), out, out_values)
    return (res[0], res[1]) if return_values else res[0]
