"""The public ops (docs/api.md). Thin wrappers over deep_indexer._C: validation, allocation and the
launch all happen in C++ on PyTorch's current stream of the inputs' device (fp8_mqa_topk_indices also
forks a second stream from it and joins it back before returning)."""
from __future__ import annotations

import threading
from typing import Optional

import torch

import deep_indexer._C as _C
from . import quant
from ._signatures import native
from .torch_ops import elem_bytes, padded_row_stride, paged_cache_rows_error  # (registers torch.ops.deep_indexer.*)

# @native: the signature (names, order, kinds, defaults) is deep_indexer._signatures' stub of the same
# name; each implementation below gets every argument positionally in that order, types checked.

# Under torch.compile the public functions go through torch.ops.deep_indexer.* (traceable, with
# fake implementations); in eager mode they call the extension directly (lowest host overhead).
_compiling = torch.compiler.is_compiling


def _ops():
    return torch.ops.deep_indexer


@native
def clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n):
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
    return elem_bytes(logits_dtype, f"deep_indexer.{op}")


# ------------------------------------------------------------------------------------ FP4 inputs
_FP4_CODE_DTYPES = tuple(getattr(torch, n) for n in ("uint8", "int8", "float4_e2m1fn_x2") if hasattr(torch, n))
_FP4_HEAD_DIMS = (32, 64, 128)  # the FP8 prefill kernel's head dims (FP4 needs D % 32 == 0)
_PAGED_HEAD_DIMS = (64, 128)  # the decode kernel's
_FP4_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fp4_codes(op: str, name: str, codes, sf, ndim: int, lead: str, dims: tuple = _FP4_HEAD_DIMS) -> torch.Tensor:
    """Validate one FP4 operand (codes [*lead, D / 2], sf int32 [*lead], D in dims); return the codes as uint8."""
    where = f"deep_indexer.{op}"
    if not isinstance(codes, torch.Tensor) or not isinstance(sf, torch.Tensor):
        bad = codes if not isinstance(codes, torch.Tensor) else sf
        raise TypeError(f"{where}: {name} must be two tensors (codes, int32 scale words), got {type(bad).__name__}")
    if codes.dtype not in _FP4_CODE_DTYPES:
        raise ValueError(f"{where}: {name}[0] (FP4 codes) must be uint8 or int8, got {codes.dtype}")
    if codes.dim() != ndim or codes.shape[-1] * 2 not in dims:
        raise ValueError(f"{where}: {name}[0] (FP4 codes) must be [{lead}, D / 2] with D in "
                         f"{'/'.join(map(str, dims))} (two e2m1 codes per byte), got shape {list(codes.shape)}")
    if sf.dtype != torch.int32 or tuple(sf.shape) != tuple(codes.shape[:-1]):
        raise ValueError(f"{where}: {name}[1] (FP4 scale words) must be int32 {list(codes.shape[:-1])} ([{lead}]: one "
                         f"ue8m0 exponent per 32 values, packed little-endian), got {sf.dtype} {list(sf.shape)}")
    if sf.device != codes.device:
        raise ValueError(f"{where}: {name}[1] must be on {name}[0]'s device {codes.device}, got {sf.device}")
    return codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)


def _is_fp4_kv(kv) -> bool:
    return (isinstance(kv, (tuple, list)) and len(kv) == 2 and isinstance(kv[0], torch.Tensor)
            and isinstance(kv[1], torch.Tensor) and (kv[0].dtype in _FP4_CODE_DTYPES or kv[1].dtype == torch.int32))


def _prefill_inputs(op: str, q, kv, weights):
    """The prefill inputs as the FP8 kernel takes them (q fp8, (k fp8, k_scale float32), weights).

    q: a tensor, (q, None) or FP4 (q_fp4 [S, H, D / 2] uint8/int8, q_sf [S, H] int32); kv: (k fp8, k_scale
    float32) or FP4 (k_fp4 [SKV, D / 2], k_sf [SKV] int32). FP4 operands are folded into e4m3 values: k's per-key
    base exponent becomes k_scale = 2^(base - 127), q's per-(token, head) base multiplies the weights (float32).
    On SM90 in eager mode one _C.fp4_prefill_fold launch writes all of it; elsewhere quant.fold_fp4_to_e4m3 and
    torch ops, the same bytes. No host sync."""
    q_sf = None
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            raise ValueError(f"deep_indexer.{op}: q must be a tensor, (q, None) or (q_fp4, q_sf), got a "
                             f"{type(q).__name__} of {len(q)}")
        q, q_sf = q
        if q_sf is None and not isinstance(q, torch.Tensor):
            raise TypeError(f"deep_indexer.{op}: q[0] must be a torch.Tensor, got {type(q).__name__}")
    if q_sf is None and isinstance(q, torch.Tensor) and q.dtype in _FP4_CODE_DTYPES:
        raise ValueError(f"deep_indexer.{op}: q has dtype {q.dtype} (packed FP4) but no scale words: pass "
                         f"q = (q_fp4 [S, H, D / 2], q_sf [S, H] int32)")
    fp4_k = _is_fp4_kv(kv)
    if q_sf is None and not fp4_k:
        return q, kv, weights
    if q_sf is not None:
        codes = _fp4_codes(op, "q", q, q_sf, 3, "S, H")
        if not isinstance(weights, torch.Tensor) or weights.dtype not in _FP4_WEIGHT_DTYPES or \
                tuple(weights.shape) != tuple(codes.shape[:2]):
            got = f"{weights.dtype} {list(weights.shape)}" if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise ValueError(f"deep_indexer.{op}: weights must be float32/bfloat16/float16 {list(codes.shape[:2])} "
                             f"([S, H] of the FP4 q), got {got}")
        if weights.device != codes.device:
            raise ValueError(f"deep_indexer.{op}: weights must be on q's device {codes.device}, got {weights.device}")
    k_codes = _fp4_codes(op, "kv", kv[0], kv[1], 2, "SKV") if fp4_k else None
    one = codes if q_sf is not None else k_codes
    if one.is_cuda and not _compiling() and quant._fold_kernel_ok(one.device):
        # one launch for both operands (_C.fp4_prefill_fold): the same bytes as the torch form below
        fp4_q = q_sf is not None
        q8, w8, k8, k_scale = _C.fp4_prefill_fold(codes if fp4_q else None, q_sf, weights if fp4_q else None, k_codes,
                                                  kv[1] if fp4_k else None)
        if q8 is not None:
            q, weights = q8, w8
        if k8 is not None:
            kv = (k8, k_scale)
        return q, kv, weights
    if q_sf is not None:
        q, q_base = quant.fold_fp4_to_e4m3(codes, q_sf)
        weights = weights.float() * quant.exp2_int(q_base)  # exact: a power of two (float32 range permitting)
    if fp4_k:
        k, k_base = quant.fold_fp4_to_e4m3(k_codes, kv[1])
        kv = (k, quant.exp2_int(k_base))
    return q, kv, weights


@native
def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, max_seqlen_k, logits_dtype, out):
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

    FP4 inputs (DeepGEMM's format, docs/fp4.md): q = (q_fp4 [S, H, D / 2] uint8/int8, q_sf [S, H] int32)
    and/or kv = (k_fp4 [SKV, D / 2] uint8/int8, k_sf [SKV] int32), D in 32/64/128, in any combination
    with the FP8 forms. They are folded exactly into e4m3 (on SM90 one fp4_prefill_fold launch for both) and
    run through the same kernel: the logits are those of the dequantized inputs.
    """
    q, kv, weights = _prefill_inputs("fp8_mqa_logits", q, kv, weights)
    if _compiling():
        if out is None:
            return _ops().fp8_mqa_logits(q, kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                                         logits_dtype, max_seqlen_k)
        _ops().fp8_mqa_logits_out(q, kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, out,
                                  max_seqlen_k)
        return out
    return _C.fp8_mqa_logits(q, kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end, bool(clean_logits),
                             _elem_bytes(logits_dtype, "fp8_mqa_logits"), out, max_seqlen_k)


@native
def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices, out):
    """Decode work split (docs/api.md), computed on the GPU without a host sync: int32 [num_sms + 1, 2]
    (sequence, segment) start pairs over segments of 256 tokens; see reference.paged_mqa_logits_metadata.
    context_lens: int32 [B] or [B, next_n] (next_n 1..8). num_sms defaults to the SM count set by set_num_sms, else the device's.
    indices: optional int32 [R] request id per q row for a varlen batch (then context_lens is [R] or
    [R, 1]); pass the same tensor to fp8_paged_mqa_logits. Every row is scheduled by its own length."""
    if _compiling():
        if out is None:
            return _ops().get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices)
        _ops().get_paged_mqa_logits_metadata_out(context_lens, block_kv, out, indices)
        return out
    return _C.get_paged_mqa_logits_metadata(context_lens, int(block_kv), num_sms, out, indices)


# ------------------------------------------------------------------------------------ decode inputs
# The decode hot path (~10 us a call) checks nothing here beyond unpacking q: the extension validates every
# argument, and when it raises, _decode_inputs_error looks for a cause it can name more clearly.
_CODE_VIEWS = tuple(d for d in _FP4_CODE_DTYPES if d != torch.uint8)  # FP4 code dtypes passed on as uint8
_PAGED_FP4_FORM = "(q_fp4 [B, next_n, H, D / 2], q_sf [B, next_n, H] int32)"


def _decode_q(op: str, q) -> tuple:
    """(q, q_sf) as the extension takes them: (q, None) for an FP8 q, (codes as uint8, q_sf) for an FP4 q.

    q: a tensor, (q, None) or (q_fp4 [B, next_n, H, D / 2] uint8/int8/float4_e2m1fn_x2, q_sf [B, next_n, H]
    int32). Only the Python types are checked here (see _decode_inputs_error)."""
    if isinstance(q, torch.Tensor):
        return q, None
    if not isinstance(q, (tuple, list)) or len(q) != 2:
        got = f"a {type(q).__name__} of {len(q)}" if isinstance(q, (tuple, list)) else type(q).__name__
        raise ValueError(f"deep_indexer.{op}: q must be a tensor, (q, None) or (q_fp4, q_sf), got {got}")
    q, q_sf = q
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"deep_indexer.{op}: q[0] must be a torch.Tensor, got {type(q).__name__}")
    if q_sf is None:
        return q, None
    if not isinstance(q_sf, torch.Tensor):
        raise TypeError(f"deep_indexer.{op}: q must be two tensors (codes, int32 scale words), got "
                        f"{type(q_sf).__name__}")
    return (q.view(torch.uint8) if q.dtype in _CODE_VIEWS else q), q_sf


def _decode_inputs_error(op: str, q: torch.Tensor, q_sf, kv_cache):
    """A clearer error for decode inputs the extension rejected, or None: packed FP4 codes without scale
    words, a malformed FP4 q (codes dtype or shape, q_sf dtype, shape or device), a cache of neither layout."""
    if q_sf is None:
        if q.dtype in _FP4_CODE_DTYPES:
            return ValueError(f"deep_indexer.{op}: q has dtype {q.dtype} (packed FP4) but no scale words: pass "
                              f"q = {_PAGED_FP4_FORM}")
    else:
        try:
            _fp4_codes(op, "q", q, q_sf, 4, "B, next_n, H", _PAGED_HEAD_DIMS)
        except (TypeError, ValueError) as e:
            return e
    return paged_cache_rows_error(op, q, q_sf, kv_cache)


def _paged_logits(op: str, q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                  clean_logits, logits_dtype, indices, out):
    """The decode logits of q as _decode_q returns it, over either cache layout (the extension tells them
    apart by the row bytes for q's head dim: D + 4 or D / 2 + 4)."""
    if _compiling():
        err = _decode_inputs_error(op, q, q_sf, kv_cache)  # (at trace time only)
        if err is not None:
            raise err
        if out is None:
            return _ops().fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                               max_context_len, clean_logits, logits_dtype, indices, q_sf)
        _ops().fp8_paged_mqa_logits_out(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                        max_context_len, clean_logits, out, indices, q_sf)
        return out
    try:
        return _C.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                       int(max_context_len), bool(clean_logits), _elem_bytes(logits_dtype, op), out,
                                       indices, q_sf)
    except ValueError:
        err = _decode_inputs_error(op, q, q_sf, kv_cache)
        if err is None:
            raise
    raise err


@native
def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits,
                         logits_dtype, indices, out):
    """Decode indexer logits over a paged KV cache (docs/api.md): [B * next_n, max_context_len].

    q [B, next_n, H, D] fp8 (also as (q, None); next_n 1..8, H 16/32/64/128, D 64/128) or FP4
    (q_fp4 [B, next_n, H, D / 2] uint8/int8/float4_e2m1fn_x2, q_sf [B, next_n, H] int32: DeepGEMM's format,
    docs/fp4.md); kv_cache uint8 [num_blocks, block_kv (32/64), 1, D + 4] (fp8 keys then fp32 scales per
    block) or [..., D / 2 + 4] (the FP4 cache: codes then int32 scale words per block), with either q;
    weights [B * next_n, H] float32 (rows may be padded to a multiple of 4 elements; 16-byte aligned);
    context_lens int32 [B] (row (b, i) sees j <= ctx[b] - next_n + i) or
    [B, next_n] (row (b, i) sees j < ctx[b, i]); block_table int32 [B, max_blocks]; schedule_meta from
    get_paged_mqa_logits_metadata with the same block_kv. max_context_len must be >= every context length.

    Varlen batches: indices int32 [R] gives the request id of each q row (q is then [R, 1, H, D],
    weights [R, H], context_lens [R] or [R, 1] with each row's own length, block_table [R, max_blocks]).
    A run of equal consecutive ids is one request: all its rows read the block-table row of the run's
    first row (the other rows' block-table entries are ignored), and row r sees keys j < context_lens[r].
    Id values are only compared with their neighbours, so any int32 value is safe. Pass the same
    indices to get_paged_mqa_logits_metadata.

    FP4 operands are folded into e4m3 per key and per (token, head) inside the kernel: the logits are those of
    the dequantized inputs (docs/fp4.md says when a row's scales span too many binades for that).
    """
    q_sf = None
    if not isinstance(q, torch.Tensor):
        q, q_sf = _decode_q("fp8_paged_mqa_logits", q)
    return _paged_logits("fp8_paged_mqa_logits", q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta,
                         max_context_len, clean_logits, logits_dtype, indices, out)


@native
def topk_indices(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode, block_table,
                 block_size, row_offset, return_values, out, out_values, indices):
    """Exact, deterministic top-k column indices of every row of `logits` (see docs/topk.md).

    logits: [M, N] float32/bfloat16, stride(1) == 1 (rows may be padded; rows that start 16-byte aligned,
    as the ops' logits do, are fastest, whatever ks). Row ranges: either
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
    preallocated outputs ([M, k], stride(1) == 1) for CUDA graphs. indices (varlen decode, next_n = 1):
    int32 [M] request id per row; with index_mode="slot" row r maps through the block-table row of
    the first row of its run of equal ids (as fp8_paged_mqa_logits reads the cache).
    """
    if _compiling():
        if out is None:
            out = logits.new_empty((logits.shape[0], k), dtype=torch.int32)
        if return_values and out_values is None:
            out_values = logits.new_empty((logits.shape[0], k))
        _ops().topk_indices_out(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted,
                                index_mode, block_table, 0 if block_size is None else block_size, row_offset, out,
                                out_values if return_values else None, indices)
        return (out, out_values) if return_values else out
    res = _C.topk_indices(logits, int(k), cu_seq_len_k_start, cu_seq_len_k_end, context_lens, int(next_n),
                          bool(sorted), str(index_mode), block_table, 0 if block_size is None else int(block_size),
                          row_offset, bool(return_values), out, out_values, indices)
    return (res[0], res[1]) if return_values else res[0]


def _logits_workspace(like: torch.Tensor, rows: int, cols: int, dtype: torch.dtype,
                      workspace: Optional[torch.Tensor], op: str) -> torch.Tensor:
    """A [rows, cols] view of `workspace` (or of a fresh buffer with the ops' padded row stride)."""
    if workspace is None:
        return like.new_empty((rows, padded_row_stride(cols, dtype)), dtype=dtype)[:, :cols]
    if not isinstance(workspace, torch.Tensor) or workspace.dim() != 2 or workspace.dtype != dtype:
        raise ValueError(f"deep_indexer.{op}: workspace must be a 2-D {dtype} tensor, got "
                         f"{getattr(workspace, 'dtype', type(workspace))} {list(getattr(workspace, 'shape', []))}")
    if workspace.shape[0] < rows or workspace.shape[1] < cols or (workspace.shape[1] > 1 and workspace.stride(1) != 1):
        raise ValueError(f"deep_indexer.{op}: workspace must be at least [{rows}, {cols}] with stride(1) == 1, got "
                         f"shape {list(workspace.shape)} strides {list(workspace.stride())}")
    if (workspace.stride(0) * workspace.element_size()) % 16 or workspace.data_ptr() % 16:
        raise ValueError(f"deep_indexer.{op}: workspace rows must start 16-byte aligned (row stride "
                         f"{workspace.stride(0)} elements); allocate it with deep_indexer.topk_workspace")
    return workspace[:rows, :cols]


@native
def topk_workspace(rows, cols, logits_dtype, device):
    """A reusable logits buffer for fp8_paged_mqa_topk_indices (rows = B * next_n, cols >= every
    max_context_len) or fp8_mqa_topk_indices (rows = chunk_rows, cols = SKV), rows 256-byte aligned."""
    return torch.empty((rows, padded_row_stride(cols, logits_dtype)), dtype=logits_dtype, device=device)[:, :cols]


@native
def fp8_paged_mqa_topk_indices(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, k,
                               sorted, index_mode, row_offset, return_values, logits_dtype, workspace, out, out_values,
                               indices):
    """Decode indexer -> top-k in one call: fp8_paged_mqa_logits (clean_logits=False) into
    `workspace`, then topk_indices with the decode row grouping of `context_lens` ([B] or
    [B, next_n]). Returns int32 [B * next_n, k] (and the values with return_values=True).

    index_mode "slot" maps through `block_table` with block_size = kv_cache.shape[1]. `workspace`
    (from topk_workspace(B * next_n, >= max_context_len, logits_dtype)) is reused across calls;
    without it a buffer is allocated per call (pass one for CUDA graphs). indices: varlen batches, as
    in fp8_paged_mqa_logits (q [R, 1, H, D]; "slot" maps each row through the block-table row of its
    run's first row). q and kv_cache may be FP4, as in fp8_paged_mqa_logits. The logits still go
    through memory once (a fused kernel that keeps them on chip is future work).
    """
    op = "fp8_paged_mqa_topk_indices"
    q_sf = None
    if not isinstance(q, torch.Tensor):
        q, q_sf = _decode_q(op, q)
    rows = q.shape[0] * q.shape[1] if q.dim() == 4 else 0
    logits = _logits_workspace(q, rows, int(max_context_len), logits_dtype, workspace, op)
    _paged_logits(op, q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, False,
                  logits_dtype, indices, logits)
    slot = index_mode == "slot"
    return topk_indices(logits, k, context_lens=context_lens, next_n=q.shape[1], sorted=sorted, index_mode=index_mode,
                        block_table=block_table if slot else None, block_size=kv_cache.shape[1] if slot else None,
                        row_offset=row_offset, return_values=return_values, out=out, out_values=out_values,
                        indices=indices)


@native
def fp8_mqa_topk_indices(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, k, sorted, index_mode, row_offset,
                         return_values, logits_dtype, chunk_rows, workspace, out, out_values, overlap):
    """Prefill indexer -> top-k: [S, k] int32 (and values) without an [S, SKV] logits buffer.

    Query rows are processed in chunks that share `chunk_rows` rows of logits (default: 256 MiB, or
    two waves of the logits kernel's query rows, 2 x SMs x 4 rows at H = 64, where that is more):
    for each chunk fp8_mqa_logits (clean_logits=False) writes into `workspace` (from
    topk_workspace(chunk_rows, SKV, logits_dtype); allocated once per call when None), then
    topk_indices selects from it. With `overlap` (default) and more than one chunk, the workspace is
    split in two halves used in turn by the current stream and a second stream (joined before the
    call returns), so that one chunk's top-k runs while the next chunk's logits start on the SMs it
    leaves idle; overlap=False runs every chunk on the current stream, one after the other.
    Memory: O(chunk_rows * SKV + S * k). Arguments as in fp8_mqa_logits and topk_indices
    (index_mode "relative" or "absolute"). The result is the same either way. q / kv may be FP4 as in
    fp8_mqa_logits (folded once, before the chunks).
    """
    op = "fp8_mqa_topk_indices"
    if index_mode == "slot":
        raise ValueError(f"deep_indexer.{op}: index_mode must be 'relative' or 'absolute' (no block table in prefill)")
    q, kv, weights = _prefill_inputs(op, q, kv, weights)  # FP4 forms folded once for all chunks
    S, SKV = q.shape[0], kv[0].shape[0]
    elem = 4 if logits_dtype == torch.float32 else 2
    if chunk_rows is None:
        chunk_rows = workspace.shape[0] if workspace is not None else _default_chunk_rows(q, SKV * elem)
    chunk_rows = max(1, min(int(chunk_rows), max(S, 1)))
    if out is None:
        out = q.new_empty((S, k), dtype=torch.int32)
    if return_values and out_values is None:
        out_values = q.new_empty((S, k), dtype=logits_dtype)
    ws = _logits_workspace(q, chunk_rows, SKV, logits_dtype, workspace, op)
    # two streams take chunks of half the workspace in turn (one stream: whole-workspace chunks)
    two = bool(overlap) and chunk_rows >= 2 and S > chunk_rows // 2 and not _compiling() and q.is_cuda
    step = chunk_rows // 2 if two else chunk_rows
    bufs = (ws[:step], ws[step: 2 * step]) if two else (ws,)

    def chunk(i: int, s0: int) -> None:
        s1 = min(S, s0 + step)
        logits = fp8_mqa_logits(q[s0:s1], (kv[0], kv[1]), weights[s0:s1], cu_seq_len_k_start[s0:s1],
                                cu_seq_len_k_end[s0:s1], False, logits_dtype=logits_dtype,
                                out=bufs[i % len(bufs)][: s1 - s0])
        topk_indices(logits, k, cu_seq_len_k_start[s0:s1], cu_seq_len_k_end[s0:s1], sorted=sorted,
                     index_mode=index_mode, row_offset=None if row_offset is None else row_offset[s0:s1],
                     return_values=return_values, out=out[s0:s1],
                     out_values=out_values[s0:s1] if return_values else None)

    # NOTES: stream order keeps each half's reuse safe (a stream's next logits follow its own top-k);
    # the side stream forks from and joins the current one, so callers (and the caching allocator,
    # and CUDA graph capture) see one stream.
    if two:
        main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        fork = torch.cuda.Event()
        fork.record(main)
        side.wait_event(fork)
    for i, s0 in enumerate(range(0, S, step)):
        if two and i % 2 == 1:
            with torch.cuda.stream(side):
                chunk(i, s0)
        else:
            chunk(i, s0)
    if two:
        join = torch.cuda.Event()
        join.record(side)
        main.wait_event(join)
    return (out, out_values) if return_values else out


def _default_chunk_rows(q: torch.Tensor, row_bytes: int) -> int:
    """Workspace rows of fp8_mqa_topk_indices: 256 MiB of logits, or two waves of query rows if more.

    NOTES: a chunk with fewer query rows than one wave of the logits kernel (SMs x tokens per CTA:
    4 at H = 64, 8 at H = 32, 16 at H = 16, 3 at H = 128, here over-estimated as 4) leaves SMs idle;
    with overlap each of the two halves is a chunk. Measured on H100 (P5, SKV = 128K, k = 2048): 256 MiB
    (2 x 256 rows) 1.15x the logits alone, 2 x 512 rows 1.12x, 2 x 2048 rows 1.11x.
    """
    rows = max(1, (256 << 20) // max(1, row_bytes))
    if q.is_cuda and q.dim() == 3 and q.shape[1] > 0 and not _compiling():  # (no extension call while tracing)
        sms = _C.get_num_sms(_device_index(q.device))
        rows = max(rows, 2 * sms * max(4, 256 // q.shape[1]))
    return rows


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_SIDE_STREAMS = threading.local()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of fp8_mqa_topk_indices' overlapped chunks: one per device and host thread (threads
    that call concurrently do not queue behind each other's chunks), created once."""
    idx = _device_index(device)
    streams = getattr(_SIDE_STREAMS, "by_device", None)
    if streams is None:
        streams = _SIDE_STREAMS.by_device = {}
    st = streams.get(idx)
    if st is None:
        st = streams[idx] = torch.cuda.Stream(device=idx)
    return st
