"""Plain PyTorch reference implementations of the lightning indexer ops (CPU or CUDA).

All ops compute on the dequantized inputs,

    logits[r, j] = sum_h w[r, h] * relu(q[r, h, :] . k[j, :]) * k_scale[j],

in `accum_dtype` (float32 by default, float64 optional), cast to `logits_dtype` at the end, and
write exactly -inf outside every row's valid key range (regardless of `clean_logits`). Work is
chunked over query rows (and key columns when a single row is too wide) so that a chunk's
temporaries stay under `_CHUNK_BYTES`. The fp8 products are exact even under TF32 matmuls;
the head weights are applied elementwise, so results do not depend on TF32 settings.
"""
from __future__ import annotations

import math

import torch

from ._signatures import REFERENCE, op as _op
from .quant import FP8, _check, _check_int, _kv_cache_views
from .quant import _fp4_dequant, _fp4_inputs

__all__ = ["mqa_logits", "paged_mqa_logits", "clean_logits", "paged_mqa_logits_metadata", "topk_indices", "topk_keys"]

_CHUNK_BYTES = 256 << 20  # budget for one chunk's temporaries
_LOGITS_DTYPES = (torch.float32, torch.bfloat16)
_ACCUM_DTYPES = (torch.float32, torch.float64)
_NEG_INF = float("-inf")


def _check_options(clean: object, logits_dtype: object, accum_dtype: object, chunk: object) -> None:
    if not isinstance(clean, bool):
        raise TypeError(f"clean_logits: expected a bool, got {type(clean).__name__}")
    if logits_dtype not in _LOGITS_DTYPES:
        raise TypeError(f"logits_dtype: expected torch.float32 or torch.bfloat16, got {logits_dtype}")
    if accum_dtype not in _ACCUM_DTYPES:
        raise TypeError(f"accum_dtype: expected torch.float32 or torch.float64, got {accum_dtype}")
    if chunk is not None:
        _check_int("chunk", chunk, min_value=1)


def row_chunks(start: torch.Tensor, end: torch.Tensor, rows_per_chunk: int):
    """(r0, r1, lo, hi) for every chunk of rows_per_chunk rows with at least one valid key (start < end,
    CPU tensors); [lo, hi) covers the chunk's keys."""
    rows = start.numel()
    for r0 in range(0, rows, rows_per_chunk):
        r1 = min(rows, r0 + rows_per_chunk)
        s, e = start[r0:r1], end[r0:r1]
        live = s < e
        if not bool(live.any()):
            continue
        yield r0, r1, int(s[live].min()), int(e[live].max())


def _weighted_relu_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    w: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    accum: torch.dtype,
    chunk: int | None,
    compressed: bool = False,
) -> None:
    """out[r, j] = logits(r, j) for start[r] <= j < end[r]; -inf elsewhere in columns [lo, hi) of a chunk.
    compressed: out[r, j - start[r]] instead (end[r] - start[r] must fit out's width), nothing else written.

    q [R, H, D] fp8, k [N, D] fp8, k_scale [N], w [R, H], out [R, >= N] (compressed: [R, M]) prefilled
    with -inf; start/end: CPU int64 [R], already clipped into [0, N].
    """
    rows, heads = q.shape[0], q.shape[1]
    esize = torch.finfo(accum).bits // 8
    rc = chunk or max(1, _CHUNK_BYTES // (heads * max(1, out.shape[1] if not compressed else k.shape[0]) * esize))
    dev = out.device
    for r0, r1, lo, hi in row_chunks(start, end, rc):
        cc = max(1, _CHUNK_BYTES // ((r1 - r0) * heads * esize))
        qf = q[r0:r1].to(accum)
        wf = w[r0:r1].to(accum).unsqueeze(-1)
        sd, ed = start[r0:r1].to(dev).unsqueeze(1), end[r0:r1].to(dev).unsqueeze(1)
        for c0 in range(lo, hi, cc):
            c1 = min(hi, c0 + cc)
            prod = torch.matmul(qf, k[c0:c1].to(accum).t())  # [rows, H, cols]
            blk = prod.relu_().mul_(wf).sum(dim=1).mul_(k_scale[c0:c1].to(accum))
            cols = torch.arange(c0, c1, device=dev).unsqueeze(0)
            outside = (cols < sd) | (cols >= ed)
            if compressed:
                rr, jj = (~outside).nonzero(as_tuple=True)
                out[r0 + rr, c0 + jj - sd[rr, 0]] = blk[rr, jj].to(out.dtype)
                continue
            blk.masked_fill_(outside, _NEG_INF)
            out[r0:r1, c0:c1] = blk


@_op(REFERENCE["mqa_logits"], checks=False)
def mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, max_seqlen_k, logits_dtype, accum_dtype,
               chunk):
    """Prefill logits: [S, SKV] in logits_dtype, or [S, max_seqlen_k] when max_seqlen_k > 0.

    q [S, H, D] fp8, kv = (k [SKV, D] fp8, k_scale [SKV] fp32), weights [S, H] fp32 or bf16,
    ks/ke [S] int32. Row i is valid for lo_i <= j < hi_i, lo_i = max(ks[i], 0), hi_i = min(ke[i], SKV);
    -inf elsewhere (always, clean_logits only validated). Compressed (max_seqlen_k = M > 0): column c
    of row i holds key lo_i + c for c < min(hi_i - lo_i, M) (a longer row keeps its first M keys),
    -inf after. chunk = query rows per chunk (None: auto).

    FP4 inputs (DeepGEMM's fp4 form, deep_indexer.quant.per_token_cast_to_fp4): q = (codes [S, H, D / 2]
    uint8/int8, sf [S, H] int32), kv = (codes [SKV, D / 2], sf [SKV] int32); both sides are dequantized
    (codes x 2^(e - 127), exact in accum_dtype barring fp32 overflow) and the same logits are computed.
    """
    if _is_fp4_q(q):  # FP4 inputs: q = (codes, sf), kv = (codes, sf)
        return _mqa_logits_fp4(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                               max_seqlen_k, logits_dtype, accum_dtype, chunk)
    _check_options(clean_logits, logits_dtype, accum_dtype, chunk)
    _check_int("max_seqlen_k", max_seqlen_k, min_value=0)
    q = _check("q", q, dtypes=(FP8,), ndim=3)
    s_len, heads, d = q.shape
    if heads < 1 or d < 1:
        raise ValueError(f"q: expected shape [S, H >= 1, D >= 1], got {list(q.shape)}")
    dev = q.device
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError(f"kv: expected a tuple (k, k_scale), got {type(kv).__name__}"
                        + (f" of length {len(kv)}" if isinstance(kv, (tuple, list)) else ""))
    k = _check("kv[0] (k)", kv[0], dtypes=(FP8,), shape=(None, d), device=dev)
    skv = k.shape[0]
    k_scale = _check("kv[1] (k_scale)", kv[1], dtypes=(torch.float32,), shape=(skv,), device=dev)
    return _prefill_logits(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k, logits_dtype,
                           accum_dtype, chunk)


def _prefill_logits(q, k, k_scale, weights, ks_in, ke_in, max_seqlen_k, logits_dtype, accum_dtype, chunk):
    """The prefill references' common part: q [S, H, D] and keys k [SKV, D] (fp8 or dequantized) with their
    per-key scale; checks weights and the key ranges, then the chunked computation."""
    (s_len, heads, _), skv, dev = q.shape, k.shape[0], q.device
    w = _check("weights", weights, dtypes=(torch.float32, torch.bfloat16), shape=(s_len, heads), device=dev)
    ks = _check("cu_seq_len_k_start", ks_in, dtypes=(torch.int32,), shape=(s_len,), device=dev)
    ke = _check("cu_seq_len_k_end", ke_in, dtypes=(torch.int32,), shape=(s_len,), device=dev)
    out = torch.full((s_len, max_seqlen_k or skv), _NEG_INF, dtype=logits_dtype, device=dev)
    start = ks.cpu().long().clamp_min(0)
    end = ke.cpu().long().clamp(0, skv)
    if max_seqlen_k:
        end = torch.minimum(end, start + max_seqlen_k)
    _weighted_relu_into(out, q, k, k_scale, w, start, end, accum_dtype, chunk, compressed=max_seqlen_k > 0)
    return out


def _paged_sequences(ctx, bt, bt_row, b_sz, next_n, mcl, bkv, nb, dev):
    """The decode references' walk: per sequence with keys, (b, keys, blocks, physical block ids on dev,
    ends [next_n]: each q row's key count), after checking its block-table entries."""
    ctx_c = ctx.cpu().long()
    ends = ctx_c.unsqueeze(1) - next_n + 1 + torch.arange(next_n) if ctx_c.dim() == 1 else ctx_c
    ends = ends.clamp(0, mcl)  # [B, next_n]
    bt_c = bt.cpu()
    for b in range(b_sz):
        n_tok = int(ends[b].max())
        if n_tok == 0:
            continue
        n_blk = math.ceil(n_tok / bkv)
        if n_blk > bt.shape[1]:
            raise ValueError(f"block_table: sequence {b} needs {n_blk} blocks, got only {bt.shape[1]} columns")
        ids = bt_c[bt_row[b], :n_blk]
        if bool(((ids < 0) | (ids >= nb)).any()):
            raise ValueError(f"block_table: row {bt_row[b]} expected entries in [0, {nb}) for its first "
                             f"{n_blk} blocks, got {ids.tolist()}")
        yield b, n_tok, n_blk, ids.long().to(dev), ends[b]


def _check_paged_args(q_shape, b_sz, next_n, heads, dev, weights, context_lens, block_table, max_context_len,
                      indices):
    """The decode arguments besides q and the cache, checked against q's [B, next_n, H]; returns (weights,
    context_lens, block_table, max_context_len, block-table row of each sequence)."""
    w = _check("weights", weights, dtypes=(torch.float32,), shape=(b_sz * next_n, heads), device=dev)
    ctx = _check("context_lens", context_lens, dtypes=(torch.int32,), ndim=(1, 2), device=dev)
    if tuple(ctx.shape) not in ((b_sz,), (b_sz, next_n)):
        raise ValueError(f"context_lens: expected shape [{b_sz}] or [{b_sz}, {next_n}], got {list(ctx.shape)}")
    bt = _check("block_table", block_table, dtypes=(torch.int32,), shape=(b_sz, None), device=dev)
    mcl = _check_int("max_context_len", max_context_len, min_value=0)
    if indices is not None and next_n != 1:
        raise ValueError(f"q: expected shape [R, 1, H, D] with indices (varlen), got {q_shape}")
    return w, ctx, bt, mcl, _table_rows(b_sz, 1, indices, dev)


@_op(REFERENCE["paged_mqa_logits"], checks=False)
def paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len, clean_logits, logits_dtype,
                     accum_dtype, chunk, indices):
    """Decode logits over a fused paged cache (docs/api.md): [B * next_n, max_context_len].

    q [B, next_n, H, D] fp8 (or (q, None)); kv_cache uint8 [num_blocks, block_kv, 1, D + 4]; weights
    [B * next_n, H] fp32; block_table [B, max_blocks] int32. context_lens int32 [B]: row (b, i)
    sees j < ctx[b] - next_n + i + 1; or [B, next_n]: row (b, i) sees j < ctx[b, i]. Ranges are
    clipped to [0, max_context_len); -inf elsewhere. Only the first ceil(len_b / block_kv)
    block_table entries of a row are read (len_b = the row group's largest clipped end).

    indices (varlen): int32 [R] request id per q row (q [R, 1, H, D], context_lens [R] or [R, 1]).
    A run of equal consecutive ids is one request; each of its rows reads the block-table row of
    the run's first row and sees keys j < context_lens[r].

    FP4 inputs, in any combination with the FP8 forms: q = (codes [B, next_n, H, D / 2] uint8/int8, sf
    [B, next_n, H] int32) and/or the FP4 cache uint8 [num_blocks, block_kv, 1, D / 2 + 4]
    (deep_indexer.quant.pack_paged_kv_cache_fp4; told apart from the FP8 cache by its row bytes for q's D).
    FP4 operands are dequantized (codes x 2^(e - 127), exact in accum_dtype barring fp32 overflow).
    """
    _check_options(clean_logits, logits_dtype, accum_dtype, chunk)
    if isinstance(q, (tuple, list)) and len(q) == 2 and q[1] is None:
        q = q[0]
    if _is_fp4_q(q):
        qx = _fp4_operand("q", q, 4, accum_dtype)  # dequantized
        q_shape, q_name = list(q[0].shape), "q[0] (codes)"
    else:
        qx = _check("q", q, dtypes=(FP8,), ndim=4)
        q_shape, q_name = list(q.shape), "q"
    b_sz, next_n, heads, d = qx.shape
    if next_n < 1 or heads < 1 or d < 1:
        raise ValueError(f"{q_name}: expected shape [B, next_n >= 1, H >= 1, {'D / 2' if q_name != 'q' else 'D'} >= 1], "
                         f"got {q_shape}")
    dev = qx.device
    fp4_kv = isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4 and kv_cache.shape[-1] == d // 2 + 4
    k_bytes, s_bytes = _kv_cache_views(kv_cache, fp4=fp4_kv)
    nb, bkv, c_kv = k_bytes.shape
    if c_kv != (d // 2 if fp4_kv else d) or kv_cache.device != dev:
        raise ValueError(f"kv_cache: expected shape [*, *, 1, {d + 4}] (the FP8 cache, D + 4) or [*, *, 1, {d // 2 + 4}] "
                         f"(the FP4 cache, D / 2 + 4) for D = {d} on {dev}, got {list(kv_cache.shape)} on "
                         f"{kv_cache.device}")
    w, ctx, bt, mcl, bt_row = _check_paged_args(q_shape, b_sz, next_n, heads, dev, weights, context_lens, block_table,
                                                max_context_len, indices)
    out = torch.full((b_sz * next_n, mcl), _NEG_INF, dtype=logits_dtype, device=dev)
    zero = torch.zeros(next_n, dtype=torch.long)
    for b, n_tok, n_blk, ids, ends_b in _paged_sequences(ctx, bt, bt_row, b_sz, next_n, mcl, bkv, nb, dev):
        keys = k_bytes.index_select(0, ids).reshape(n_blk * bkv, c_kv)[:n_tok]
        words = s_bytes.index_select(0, ids).reshape(n_blk * bkv, 4)[:n_tok].contiguous()
        if fp4_kv:  # codes and int32 scale words: dequantized, unit scale
            k = _fp4_dequant(*_fp4_inputs(keys, words.view(torch.int32).view(-1)), accum_dtype)
            scale = torch.ones(n_tok, dtype=accum_dtype, device=dev)
        else:  # fp8 keys and float32 scales
            k, scale = keys.view(FP8), words.view(torch.float32).view(-1)
        rows = slice(b * next_n, (b + 1) * next_n)
        _weighted_relu_into(out[rows], qx[b], k, scale, w[rows], zero, ends_b, accum_dtype, chunk)
    return out


# ------------------------------------------------------------------------------------ FP4 inputs
def _is_fp4_q(q: object) -> bool:
    """q given as (codes, sf) with sf a tensor: DeepGEMM's FP4 form."""
    return isinstance(q, (tuple, list)) and len(q) == 2 and isinstance(q[1], torch.Tensor)


def _fp4_operand(name: str, x: object, ndim: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """(codes [..., D / 2] uint8/int8, sf [...] int32) named `name` -> dequantized [..., D] in dtype."""
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"{name}: expected a tuple (codes, sf) of FP4 codes and int32 scale words, got "
                        f"{type(x).__name__}" + (f" of length {len(x)}" if isinstance(x, (tuple, list)) else ""))
    codes = _check(f"{name}[0] (codes)", x[0], ndim=ndim, device=device)
    c, exps = _fp4_inputs(codes, x[1], f"{name}[0] (codes)", f"{name}[1] (sf)")
    return _fp4_dequant(c, exps, dtype)


def _mqa_logits_fp4(q, kv, weights, ks_in, ke_in, clean_logits, max_seqlen_k, logits_dtype, accum_dtype, chunk):
    """mqa_logits on FP4 inputs: dequantize q and k, then the same computation (k_scale = 1)."""
    _check_options(clean_logits, logits_dtype, accum_dtype, chunk)
    _check_int("max_seqlen_k", max_seqlen_k, min_value=0)
    qd = _fp4_operand("q", q, 3, accum_dtype)
    s_len, heads, d = qd.shape
    if heads < 1:
        raise ValueError(f"q[0] (codes): expected shape [S, H >= 1, D / 2], got {list(q[0].shape)}")
    dev = qd.device
    kd = _fp4_operand("kv", kv, 2, accum_dtype, dev)
    if kd.shape[1] != d:
        raise ValueError(f"kv[0] (codes): expected shape [*, {d // 2}] (D = {d} from q), got {list(kv[0].shape)}")
    ones = torch.ones(kd.shape[0], dtype=accum_dtype, device=dev)
    return _prefill_logits(qd, kd, ones, weights, ks_in, ke_in, max_seqlen_k, logits_dtype, accum_dtype, chunk)


def split_relu_pieces(q_tilde: torch.Tensor, num_pieces: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' split_relu decomposition (include/deep_indexer/logits/split_relu.cuh), for tests and study:
    fp32 rows q~ [T, D] -> (pieces [num_pieces, T, D] float8_e4m3fn, scales [num_pieces, T] fp32) with
    q~ ~= sum_p scales[p, :, None] * pieces[p]. Piece p is e4m3(r_p / sigma_p) (saturating), r_0 = q~,
    r_{p+1} = r_p - sigma_p piece_p, sigma_p = max_d |r_p| / 448 (0 for an all-zero row)."""
    r = q_tilde.float().clone()
    pieces, scales = [], []
    for _ in range(num_pieces):
        amax = r.abs().amax(dim=-1, keepdim=True)
        inv = torch.where(amax > 0, 448.0 / amax, torch.zeros_like(amax))
        p = (r * inv).clamp(-448, 448).to(FP8)
        sigma = amax * (1.0 / 448.0)
        r = r - sigma * p.float()
        pieces.append(p)
        scales.append(sigma.squeeze(-1))
    return torch.stack(pieces), torch.stack(scales)


def row_ranges(
    m: int,
    n: int,
    cu_seq_len_k_start: torch.Tensor | None,
    cu_seq_len_k_end: torch.Tensor | None,
    context_lens: torch.Tensor | None,
    next_n: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid columns [lo, hi) (int64 [M] each, 0 <= lo <= hi <= N): clean_logits, topk_indices."""
    _check_int("next_n", next_n, min_value=1)
    if m % next_n:
        raise ValueError(f"logits: expected a row count divisible by next_n = {next_n}, got {m}")
    g = m // next_n
    i = torch.arange(next_n, device=device).repeat(g)
    if context_lens is not None:
        if cu_seq_len_k_start is not None or cu_seq_len_k_end is not None:
            raise ValueError("context_lens: pass either context_lens or cu_seq_len_k_start/cu_seq_len_k_end, not both")
        ctx = _check("context_lens", context_lens, dtypes=(torch.int32,), ndim=(1, 2), device=device)
        if ctx.dim() == 1:
            _check("context_lens", ctx, shape=(g,))
            hi = ctx.long().repeat_interleave(next_n) - next_n + 1 + i
        else:
            _check("context_lens", ctx, shape=(g, next_n))
            hi = ctx.long().reshape(-1)
        lo = torch.zeros(m, dtype=torch.long, device=device)
    else:
        if cu_seq_len_k_end is None:
            raise ValueError("cu_seq_len_k_end: required when context_lens is not given")
        ke = _check("cu_seq_len_k_end", cu_seq_len_k_end, dtypes=(torch.int32,), shape=(g,), device=device)
        hi = ke.long().repeat_interleave(next_n) - next_n + 1 + i
        if cu_seq_len_k_start is None:
            lo = torch.zeros(m, dtype=torch.long, device=device)
        else:
            ks = _check("cu_seq_len_k_start", cu_seq_len_k_start, dtypes=(torch.int32,), shape=(g,), device=device)
            lo = ks.long().repeat_interleave(next_n)
    lo = lo.clamp(0, n)
    hi = torch.maximum(hi.clamp(max=n), lo)
    return lo, hi


@_op(REFERENCE["clean_logits"], checks=False)
def clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n):
    """In place (docs/api.md): write -inf outside each row's valid range, leave the inside untouched.

    logits [M, N] (float32/bfloat16, stride(1) == 1, row stride free); ks/ke int32 [M // next_n]
    (ks None = 0). Row r, group g = r // next_n, i = r % next_n, is valid for
    max(ks[g], 0) <= j < min(ke[g] - next_n + i + 1, N). Returns logits.
    """
    lg = _check("logits", logits, dtypes=_LOGITS_DTYPES, ndim=2)
    m, n = lg.shape
    if n > 1 and m > 0 and lg.stride(1) != 1:
        raise ValueError(f"logits: expected stride(1) == 1, got strides {list(lg.stride())}")
    dev = lg.device
    start, end = row_ranges(m, n, cu_seq_len_k_start, cu_seq_len_k_end, None, next_n, dev)
    rc = max(1, _CHUNK_BYTES // max(1, 8 * n))
    cols = torch.arange(n, device=dev).unsqueeze(0)
    for r0 in range(0, m, rc):
        r1 = min(m, r0 + rc)
        mask = (cols < start[r0:r1, None]) | (cols >= end[r0:r1, None])
        lg[r0:r1].masked_fill_(mask, _NEG_INF)
    return logits


@_op(REFERENCE["paged_mqa_logits_metadata"], checks=False)
def paged_mqa_logits_metadata(context_lens, block_kv, num_sms, split_kv, indices):
    """Decode work split (the contract the GPU metadata kernel reproduces bit for bit).

    len_b = context_lens[b] (or max over next_n for [B, next_n]), clamped >= 0;
    segs_b = ceil(len_b / split_kv); P = exclusive prefix sums of segs, T = P[B].
    Entry i in 0..num_sms: s_i = i * (T // num_sms) + min(i, T % num_sms); (B, 0) if s_i == T,
    else (b, s_i - P[b]) for the b with P[b] <= s_i < P[b + 1]. SM i owns segments [s_i, s_{i+1}).
    Returns int32 [num_sms + 1, 2] on the CPU. With indices (varlen, int32 [R], context_lens [R] or
    [R, 1]) every row is a sequence of its own length: the same split.
    """
    ctx = _check("context_lens", context_lens, dtypes=(torch.int32,), ndim=(1, 2))
    if indices is not None:
        _check("indices", indices, dtypes=(torch.int32,), shape=(ctx.shape[0],))
        if ctx.dim() == 2 and ctx.shape[1] != 1:
            raise ValueError(f"context_lens: expected shape [R] or [R, 1] with indices, got {list(ctx.shape)}")
    if ctx.dim() == 2 and ctx.shape[1] < 1:
        raise ValueError(f"context_lens: expected shape [B] or [B, next_n >= 1], got {list(ctx.shape)}")
    _check_int("block_kv", block_kv, min_value=1)
    _check_int("num_sms", num_sms, min_value=1)
    _check_int("split_kv", split_kv, min_value=1)
    if split_kv % block_kv:
        raise ValueError(f"split_kv: expected a positive multiple of block_kv = {block_kv}, got {split_kv}")
    lens = ctx.cpu().long()
    if lens.dim() == 2:
        lens = lens.amax(dim=1)
    segs = (lens.clamp_min(0) + split_kv - 1) // split_kv
    ends = torch.cumsum(segs, 0)  # P[1:]
    total = int(ends[-1]) if ends.numel() else 0
    i = torch.arange(num_sms + 1, dtype=torch.long)
    starts = i * (total // num_sms) + torch.clamp(i, max=total % num_sms)
    b = torch.searchsorted(ends, starts, right=True)
    prefix = torch.cat([torch.zeros(1, dtype=torch.long), ends])
    return torch.stack([b, starts - prefix[b]], dim=1).to(torch.int32)


# ------------------------------------------------------------------------------------ top-k
TOPK_MAX_K = 2048
TOPK_INDEX_MODES = ("relative", "absolute", "slot")


def _table_rows(rows: int, next_n: int, indices: torch.Tensor | None, dev) -> list:
    """The block-table row of each of `rows` rows: r // next_n, or with varlen `indices` (int32 [rows]) the
    first row of the run of equal ids that holds r."""
    table_row = [r // next_n for r in range(rows)]
    if indices is not None:
        ids = _check("indices", indices, dtypes=(torch.int32,), shape=(rows,), device=dev).cpu().tolist()
        for r in range(1, rows):
            table_row[r] = table_row[r - 1] if ids[r] == ids[r - 1] else r
    return table_row


def topk_keys(x: torch.Tensor) -> torch.Tensor:
    """The order-preserving unsigned key of every logit, as int64 (the kernels' key transform).

    float32 -> 32-bit key, bfloat16 -> 16-bit key; a larger key is a larger value: sign + bits for a
    positive value, sign - |bits| for a negative one (sign: the sign bit's value), so -0.0 and +0.0
    share a key; every NaN (any sign or payload) maps to key 0, below -inf.
    """
    if x.dtype == torch.float32:
        bits, sign, full = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF, 0x80000000, 0xFFFFFFFF
    elif x.dtype == torch.bfloat16:
        bits, sign, full = x.contiguous().view(torch.int16).long() & 0xFFFF, 0x8000, 0xFFFF
    else:
        raise TypeError(f"logits: expected dtype torch.float32 or torch.bfloat16, got {x.dtype}")
    key = torch.where((bits & sign) != 0, full - bits + 1, bits | sign)
    return torch.where(torch.isnan(x), torch.zeros_like(key), key)


@_op(REFERENCE["topk_indices"], checks=False)
def topk_indices(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode, block_table,
                 block_size, row_offset, return_values, indices):
    """Exact top-k of every row's valid range (the rule deep_indexer.topk_indices implements).

    Selected: the k largest keys (see `topk_keys`; NaN ranks below -inf), ties to the smaller
    column. Order: ascending column (sorted=False) or key descending then column ascending
    (sorted=True). Rows with n < k valid keys return all n, then -1 (values -inf). Index p of
    column j in a row [lo, hi) of group g = r // next_n: relative j - lo, absolute j, slot
    block_table[g, p // bs] * bs + p % bs with p = j - lo (-1 when p // bs is past the table);
    then + row_offset[r] (int32 arithmetic) for every index != -1. indices (varlen, next_n = 1): int32
    [M] request ids; the slot of row r uses the block-table row of the first row of its run of equal ids.
    """
    lg = _check("logits", logits, dtypes=_LOGITS_DTYPES, ndim=2)
    m, n = lg.shape
    _check_int("k", k, min_value=1)
    if k > TOPK_MAX_K:
        raise ValueError(f"k: expected 1 <= k <= {TOPK_MAX_K}, got {k}")
    if index_mode not in TOPK_INDEX_MODES:
        raise ValueError(f"index_mode: expected one of {TOPK_INDEX_MODES}, got {index_mode!r}")
    dev = lg.device
    lo, hi = row_ranges(m, n, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, dev)
    if index_mode == "slot":
        if block_table is None or block_size is None:
            raise ValueError("block_table/block_size: required with index_mode='slot'")
        bt = _check("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
        _check("block_table", bt, shape=(m // next_n, None))
        _check_int("block_size", block_size, min_value=1)
    if row_offset is not None:
        _check("row_offset", row_offset, dtypes=(torch.int32,), shape=(m,), device=dev)
    if indices is not None and next_n != 1:
        raise ValueError(f"next_n: expected 1 with indices (varlen), got {next_n}")
    table_row = _table_rows(m, next_n, indices, dev)
    idx_out = torch.full((m, k), -1, dtype=torch.int32, device=dev)
    val_out = torch.full((m, k), _NEG_INF, dtype=lg.dtype, device=dev)
    for r in range(m):
        a, b = int(lo[r]), int(hi[r])
        if b <= a:
            continue
        vals = lg[r, a:b]
        key = topk_keys(vals)
        order = torch.sort(key, descending=True, stable=True).indices[:k]  # ties: smaller column first
        if not sorted:
            order = torch.sort(order).values
        p = order
        if index_mode == "relative":
            idx = p
        elif index_mode == "absolute":
            idx = p + a
        else:
            blk = p // block_size
            ok = blk < bt.shape[1]
            phys = bt[table_row[r], blk.clamp(max=max(bt.shape[1] - 1, 0))].long() if bt.shape[1] else torch.zeros_like(p)
            idx = torch.where(ok, phys * block_size + p % block_size, torch.full_like(p, -1))
        if row_offset is not None:
            idx = torch.where(idx != -1, idx + int(row_offset[r]), idx)
        idx = ((idx + 2**31) % 2**32 - 2**31).to(torch.int32)
        idx_out[r, : p.numel()] = idx
        val_out[r, : p.numel()] = vals[order]
    return (idx_out, val_out) if return_values else idx_out
