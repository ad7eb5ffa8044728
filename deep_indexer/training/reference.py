"""Chunked plain-PyTorch compute for training the lightning indexer (CPU or CUDA).

This is the portable implementation behind `deep_indexer.training`'s autograd ops, and the reference
that any fused kernel is compared with. Inputs are assumed validated (see `ops.py`); every function
here works on row chunks of the queries and tiles of the keys, so no [T, T] or [heads, T, T] tensor
is ever formed: a chunk's temporaries are [rows, heads, keys_per_tile].

Notation (T query rows, N keys):
    S[t, h, s] = q_I[t, h] . k_I[s]                        indexer scores
    I[t, s]    = sum_h w[t, h] relu(S[t, h, s])            indexer logits (`mean` target)
    I_h[t, s]  = w[t, h] relu(S[t, h, s])                  per-head logits (`per_head` target)
    A[t, h, s] = scale * q[t, h] . k[s, h // (H / H_kv)]   attention logits (H_kv = 1: one key head)
    P[t, h, s] = exp(A[t, h, s] - lse[t, h])               attention probabilities
Row t sees the keys ks[t] <= s < ke[t] (empty when ks >= ke). Losses use the valid keys only.

Every accumulation over key tiles and row chunks runs in a fixed order, so results are bitwise
reproducible run to run on the same device (no atomics) with one exception: the sparse-stage
gradient of k_I scatters into key rows; `deterministic=True` uses a sorted accumulation there.
"""
from __future__ import annotations

import torch

from ..reference import row_chunks

# Budget for one [rows, heads, keys] temporary and the key tile, per device type: GPUs take larger
# tiles (fewer kernel launches; a step keeps about 6 such temporaries alive).
_TILE_BYTES = {"cpu": 32 << 20, "cuda": 128 << 20}
_KEY_TILE = {"cpu": 512, "cuda": 1024}
_SPARSE_BYTES = 256 << 20  # budget for one row chunk's gathered keys [rows, K, Dqk + D_I] (sparse)
_NEG_INF = float("-inf")


def accum_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _plan(rows: int, keys: int, heads: int, dtype: torch.dtype, chunk_rows: int | None, chunk_keys: int | None,
          device: torch.device):
    esize = torch.finfo(dtype).bits // 8
    kind = "cuda" if device.type == "cuda" else "cpu"
    kc = max(1, chunk_keys or min(max(keys, 1), _KEY_TILE[kind]))
    rc = max(1, chunk_rows or min(max(rows, 1), _TILE_BYTES[kind] // (heads * kc * esize)))
    return rc, kc


def _valid(ks: torch.Tensor, ke: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """[rows, c1 - c0] bool: key c0 + j is inside the row's [ks, ke)."""
    cols = torch.arange(c0, c1, device=ks.device).unsqueeze(0)
    return (cols >= ks.unsqueeze(1)) & (cols < ke.unsqueeze(1))


_LOW = (torch.bfloat16, torch.float16)
_FAST_GEMM: dict = {}


def _fast_gemm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether a @ b can run on 16-bit inputs with fp32 output (CUDA `out_dtype`): the products of 16-bit
    values are exact in fp32, so this equals the fp32 GEMM of the upcast inputs up to summation order.
    Probed (and checked against the upcast GEMM) once per device and dtype; otherwise inputs are upcast."""
    if not (a.is_cuda and acc == torch.float32 and a.dtype in _LOW and b.dtype == a.dtype):
        return False
    key = (a.device, a.dtype)
    if key not in _FAST_GEMM:
        ok = False
        try:
            g = torch.Generator(device=a.device).manual_seed(0)
            # the operand layouts gemm_nt / bmm_nt pass: contiguous A, transposed views of contiguous B
            x = torch.randn(2, 64, 32, device=a.device, generator=g).to(a.dtype)
            y = torch.randn(2, 48, 32, device=a.device, generator=g).to(a.dtype)
            ref = torch.bmm(x.double(), y.double().transpose(1, 2)).float()
            got_b = torch.bmm(x, y.transpose(1, 2), out_dtype=torch.float32)
            got_m = torch.mm(x[0], y[0].t(), out_dtype=torch.float32)
            ok = (got_b.dtype == torch.float32 and torch.allclose(got_b, ref, rtol=1e-5, atol=1e-5)
                  and torch.allclose(got_m, ref[0], rtol=1e-5, atol=1e-5))
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _FAST_GEMM[key] = ok
    return _FAST_GEMM[key]


def _mm_fp32_out(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """16-bit a [M, K] @ b_t [K, N] -> fp32 (the CUDA-only `out_dtype` GEMM; tests stand in an emulation)."""
    return torch.mm(a, b_t, out_dtype=torch.float32)


def _bmm_fp32_out(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """16-bit a [B, M, K] @ b_t [B, K, N] -> fp32 (as `_mm_fp32_out`)."""
    return torch.bmm(a, b_t, out_dtype=torch.float32)


def gemm_nt(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a [..., M, K] @ b[N, K]^T -> [..., M, N] in acc."""
    if _fast_gemm(a, b, acc):
        out = _mm_fp32_out(a.reshape(-1, a.shape[-1]), b.contiguous().t())
        return out.view(*a.shape[:-1], b.shape[0])
    return torch.matmul(a.to(acc), b.to(acc).t())


def bmm_nt(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a [B, M, K] @ b[B, N, K]^T -> [B, M, N] in acc."""
    if _fast_gemm(a, b, acc):
        return _bmm_fp32_out(a.contiguous(), b.contiguous().transpose(1, 2))
    return torch.bmm(a.to(acc), b.to(acc).transpose(1, 2))


def _head_sum(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_h r[:, h, :] * w[:, h] -> [rows, keys], consuming r (overwritten).

    NOTES: an elementwise product and a sum, not a GEMM: with TF32 enabled for fp32 matmuls on CUDA
    (torch.backends.cuda.matmul), a GEMM would round relu(S) to 10 mantissa bits (logit errors ~1e-3)."""
    return r.mul_(w.unsqueeze(-1)).sum(1)


def attention_scores(q: torch.Tensor, k: torch.Tensor, scale: float, acc: torch.dtype) -> torch.Tensor:
    """A [r, H, c] (acc) from q [r, H, D] and k [c, D] (one key head) or [c, H_kv, D] (query head h reads
    key head h // (H / H_kv))."""
    if k.dim() == 2:
        return gemm_nt(q, k, acc).mul_(scale)
    r, heads, d = q.shape
    c, hkv = k.shape[0], k.shape[1]
    # one GEMM per key head, batched over key heads (no broadcast copy of k over the rows)
    qh = q.reshape(r, hkv, heads // hkv, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)  # [Hkv, r G, D]
    a = bmm_nt(qh, k.permute(1, 0, 2), acc)  # [Hkv, r G, c]
    return a.view(hkv, r, heads // hkv, c).permute(1, 0, 2, 3).reshape(r, heads, c).mul_(scale)


def gathered_attention_scores(q: torch.Tensor, kg: torch.Tensor, scale: float, acc: torch.dtype) -> torch.Tensor:
    """A [r, H, K] (acc) from q [r, H, D] and per-row gathered keys kg [r, K, D] or [r, K, H_kv, D]."""
    if kg.dim() == 3:
        return bmm_nt(q, kg, acc).mul_(scale)
    r, heads, d = q.shape
    kk, hkv = kg.shape[1], kg.shape[2]
    qh = q.reshape(r * hkv, heads // hkv, d)  # [r Hkv, G, D]
    a = bmm_nt(qh, kg.permute(0, 2, 1, 3).reshape(r * hkv, kk, d), acc)  # [r Hkv, G, K]
    return a.view(r, heads, kk).mul_(scale)


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """-inf (a row with no valid key) -> 0, so exp(x - lse) stays finite; masked anyway."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


# ----------------------------------------------------------------------------------------------
# Indexer logits
# ----------------------------------------------------------------------------------------------


def indexer_logits_fwd(q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunk_rows=None, chunk_keys=None) -> torch.Tensor:
    """I [T, N] in the accumulation dtype; exactly -inf outside each row's [ks, ke)."""
    acc = accum_dtype(q_i, k_i, w)
    rows, heads = q_i.shape[0], q_i.shape[1]
    n = k_i.shape[0]
    out = torch.full((rows, n), _NEG_INF, dtype=acc, device=q_i.device)
    rc, kc = _plan(rows, n, heads, acc, chunk_rows, chunk_keys, q_i.device)
    for r0, r1, lo, hi in row_chunks(ks_cpu, ke_cpu, rc):
        q = q_i[r0:r1]
        wr = w[r0:r1].to(acc)
        for c0 in range(lo, hi, kc):
            c1 = min(hi, c0 + kc)
            s = gemm_nt(q, k_i[c0:c1], acc)  # [r, H, c]
            blk = _head_sum(s.relu_(), wr)
            out[r0:r1, c0:c1] = blk.masked_fill_(~_valid(ks[r0:r1], ke[r0:r1], c0, c1), _NEG_INF)
    return out


def _indexer_grads_tile(d_i, s, q, w, k_t, dq, dw, dk_t):
    """Accumulate the grads of one tile. d_i: dL/dI [r, c] (`mean`) or dL/dI_h [r, H, c] (`per_head`)."""
    pos = s > 0
    r_ = s.clamp_min(0)
    d3 = d_i.unsqueeze(1) if d_i.dim() == 2 else d_i
    dw += (d3 * r_).sum(-1)
    ds = (d3 * w.unsqueeze(-1)).mul_(pos)  # [r, H, c]
    dq += torch.matmul(ds, k_t)
    r, heads, c = ds.shape
    dk_t += torch.matmul(ds.reshape(r * heads, c).t(), q.reshape(r * heads, -1))


def indexer_logits_bwd(grad, q_i, k_i, w, ks, ke, ks_cpu, ke_cpu, chunk_rows=None, chunk_keys=None):
    """(dq_I, dk_I, dw) in the accumulation dtype; entries of grad outside [ks, ke) are ignored."""
    acc = accum_dtype(q_i, k_i, w)
    rows, heads = q_i.shape[0], q_i.shape[1]
    n = k_i.shape[0]
    dq = torch.zeros(q_i.shape, dtype=acc, device=q_i.device)
    dk = torch.zeros(k_i.shape, dtype=acc, device=q_i.device)
    dw = torch.zeros(w.shape, dtype=acc, device=q_i.device)
    rc, kc = _plan(rows, n, heads, acc, chunk_rows, chunk_keys, q_i.device)
    for r0, r1, lo, hi in row_chunks(ks_cpu, ke_cpu, rc):
        q_raw = q_i[r0:r1]
        q = q_raw.to(acc)
        wr = w[r0:r1].to(acc)
        for c0 in range(lo, hi, kc):
            c1 = min(hi, c0 + kc)
            k_t = k_i[c0:c1].to(acc)
            s = gemm_nt(q_raw, k_i[c0:c1], acc)
            g = grad[r0:r1, c0:c1].to(acc).masked_fill(~_valid(ks[r0:r1], ke[r0:r1], c0, c1), 0)
            _indexer_grads_tile(g, s, q, wr, k_t, dq[r0:r1], dw[r0:r1], dk[c0:c1])
    return dq, dk, dw


# ----------------------------------------------------------------------------------------------
# Warm-up (dense) KL loss
# ----------------------------------------------------------------------------------------------


def attention_lse(q, k, scale, ks, ke, ks_cpu, ke_cpu, chunk_rows=None, chunk_keys=None) -> torch.Tensor:
    """lse [T, H] of the attention logits over each row's valid keys (-inf for an empty row); online over key tiles."""
    acc = accum_dtype(q, k)
    rows, heads = q.shape[0], q.shape[1]
    lse = torch.full((rows, heads), _NEG_INF, dtype=acc, device=q.device)
    rc, kc = _plan(rows, k.shape[0], heads, acc, chunk_rows, chunk_keys, q.device)
    for r0, r1, lo, hi in row_chunks(ks_cpu, ke_cpu, rc):
        qr = q[r0:r1]
        m = lse[r0:r1]
        for c0 in range(lo, hi, kc):
            c1 = min(hi, c0 + kc)
            a = attention_scores(qr, k[c0:c1], scale, acc)
            a.masked_fill_(~_valid(ks[r0:r1], ke[r0:r1], c0, c1).unsqueeze(1), _NEG_INF)
            m.copy_(torch.logaddexp(m, torch.logsumexp(a, dim=-1)))
    return lse


def _warmup_tile(qr, k_t, scale, lse_safe, qir, ki_t, wr, valid, per_head, total_heads, acc):
    """Everything one (row chunk, key tile) step needs: (P or p, log P, S, I or I_h) with P/p zero outside
    valid. qr, k_t, qir, ki_t: the inputs' slices in their own dtype; wr, lse_safe in acc."""
    a = attention_scores(qr, k_t, scale, acc)
    a.sub_(lse_safe.unsqueeze(-1))  # log P
    prob = torch.exp(a).mul_(valid.unsqueeze(1))  # P [r, H, c], zero outside valid
    s = gemm_nt(qir, ki_t, acc)  # [r, H_I, c]
    if per_head:
        logits = s.clamp_min(0).mul_(wr.unsqueeze(-1))  # I_h [r, H, c]
        return prob, a, s, logits
    target = prob.sum(1).div_(total_heads)  # p [r, c]
    logits = _head_sum(s.clamp_min(0), wr)
    return target, a, s, logits


def warmup_kl_fwd(q_i, k_i, w, q, k, scale, lse_att, ks, ke, ks_cpu, ke_cpu, per_head, total_heads, partial,
                  chunk_rows=None, chunk_keys=None):
    """Per-token loss [T] and the saved statistics (indexer_lse, target_mass), both in the accumulation dtype.

    `mean`: loss[t] = sum_s p log p - sum_s p I + m lse_I, with p = sum_h P / total_heads, m = sum_s p
    (1 when the attention LSE is its own), lse_I = logsumexp_s I: this is sum_s p log(p / softmax(I)).
    With `partial` (the heads are a tensor-parallel slice), the entropy term sum_s p log p is left out:
    the loss is this slice's share of the cross-entropy, which sums over slices to the full one.
    `per_head`: loss[t] = sum_h (sum_s P_h log P_h - sum_s P_h I_h + m_h lse_I_h) / total_heads, exact per
    slice. indexer_lse is [T] (`mean`) or [T, H] (`per_head`); target_mass likewise.
    """
    acc = accum_dtype(q_i, k_i, w, q, k)
    rows, heads, hi_heads = q.shape[0], q.shape[1], q_i.shape[1]
    dev = q.device
    stat_shape = (rows, heads) if per_head else (rows,)
    lse_i = torch.full(stat_shape, _NEG_INF, dtype=acc, device=dev)
    plogp = torch.zeros(stat_shape, dtype=acc, device=dev)
    p_i = torch.zeros(stat_shape, dtype=acc, device=dev)
    mass = torch.zeros(stat_shape, dtype=acc, device=dev)
    rc, kc = _plan(rows, k.shape[0], max(heads, hi_heads), acc, chunk_rows, chunk_keys, q_i.device)
    lse_safe_all = _safe(lse_att.to(acc))
    for r0, r1, lo, hi in row_chunks(ks_cpu, ke_cpu, rc):
        qr, qir, wr = q[r0:r1], q_i[r0:r1], w[r0:r1].to(acc)
        lse_safe = lse_safe_all[r0:r1]
        for c0 in range(lo, hi, kc):
            c1 = min(hi, c0 + kc)
            valid = _valid(ks[r0:r1], ke[r0:r1], c0, c1)
            tgt, a, _, logits = _warmup_tile(qr, k[c0:c1], scale, lse_safe, qir, k_i[c0:c1], wr, valid, per_head,
                                             total_heads, acc)
            vmask = valid.unsqueeze(1) if per_head else valid
            lse_i[r0:r1] = torch.logaddexp(lse_i[r0:r1], logits.masked_fill(~vmask, _NEG_INF).logsumexp(-1))
            if per_head:
                plogp[r0:r1] += (tgt * a).sum(-1)  # a = A - lse = log P (finite); P = 0 outside valid
            elif not partial:
                plogp[r0:r1] += torch.xlogy(tgt, tgt).sum(-1)
            p_i[r0:r1] += (tgt * logits).sum(-1)
            mass[r0:r1] += tgt.sum(-1)
    term = plogp - p_i + mass * _safe(lse_i)
    loss = term.sum(-1) / total_heads if per_head else term
    return loss, lse_i, mass


def warmup_kl_bwd(grad, q_i, k_i, w, q, k, scale, lse_att, lse_i, mass, ks, ke, ks_cpu, ke_cpu, per_head,
                  total_heads, chunk_rows=None, chunk_keys=None):
    """(dq_I, dk_I, dw) for the per-token loss gradient grad [T]: dL/dI = grad * (m softmax(I) - p)."""
    acc = accum_dtype(q_i, k_i, w, q, k)
    rows, heads, hi_heads = q.shape[0], q.shape[1], q_i.shape[1]
    dq = torch.zeros(q_i.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k_i.shape, dtype=acc, device=q.device)
    dw = torch.zeros(w.shape, dtype=acc, device=q.device)
    rc, kc = _plan(rows, k.shape[0], max(heads, hi_heads), acc, chunk_rows, chunk_keys, q_i.device)
    lse_safe_all, lse_i_safe = _safe(lse_att.to(acc)), _safe(lse_i)
    g_all = grad.to(acc) / total_heads if per_head else grad.to(acc)
    for r0, r1, lo, hi in row_chunks(ks_cpu, ke_cpu, rc):
        qr, qi_raw, wr = q[r0:r1], q_i[r0:r1], w[r0:r1].to(acc)
        qir = qi_raw.to(acc)
        g, m, li = g_all[r0:r1].unsqueeze(-1), mass[r0:r1].unsqueeze(-1), lse_i_safe[r0:r1].unsqueeze(-1)
        if per_head:
            g = g.unsqueeze(-1)
        for c0 in range(lo, hi, kc):
            c1 = min(hi, c0 + kc)
            valid = _valid(ks[r0:r1], ke[r0:r1], c0, c1)
            ki_t = k_i[c0:c1].to(acc)
            tgt, _, s, logits = _warmup_tile(qr, k[c0:c1], scale, lse_safe_all[r0:r1], qi_raw, k_i[c0:c1], wr,
                                             valid, per_head, total_heads, acc)
            soft = torch.exp_(logits.sub_(li))
            d_i = soft.mul_(m).sub_(tgt).mul_(g).mul_(valid.unsqueeze(1) if per_head else valid)
            _indexer_grads_tile(d_i, s, qir, wr, ki_t, dq[r0:r1], dw[r0:r1], dk[c0:c1])
    return dq, dk, dw


# ----------------------------------------------------------------------------------------------
# Sparse-stage KL loss over given top-k sets
# ----------------------------------------------------------------------------------------------


def _sparse_chunk(q_i, k_i, w, q, k, scale, lse_att, idx, ks, ke, r0, r1, per_head, total_heads, acc):
    """One row chunk of the sparse loss: everything the forward and the backward need, all [r, (H,) K]."""
    ids = idx[r0:r1].long()
    sel = ids >= 0
    if ks is not None:
        sel &= (ids >= ks[r0:r1].unsqueeze(1)) & (ids < ke[r0:r1].unsqueeze(1))
    ids = torch.where(sel, ids, torch.zeros_like(ids))
    qi_raw, wr = q_i[r0:r1], w[r0:r1].to(acc)
    kig_raw = k_i[ids]  # [r, K, D_I]
    s = bmm_nt(qi_raw, kig_raw, acc)  # [r, H_I, K]
    qir, kig = qi_raw.to(acc), kig_raw.to(acc)
    a = gathered_attention_scores(q[r0:r1], k[ids], scale, acc)  # [r, H, K]
    a.masked_fill_(~sel.unsqueeze(1), _NEG_INF)
    lse_set = a.logsumexp(-1)  # [r, H]: the attention restricted to the set
    log_p_h = a - _safe(lse_set).unsqueeze(-1)  # log softmax over the set, -inf outside
    if per_head:
        tgt = log_p_h.exp()  # [r, H, K]
        logits = s.clamp_min(0).mul_(wr.unsqueeze(-1))
        vmask = sel.unsqueeze(1)
    else:
        if lse_att is not None:
            # head h weighs by its mass on the set under the given LSE: exp(lse_set - lse)
            log_wt = (lse_set - lse_att[r0:r1].to(acc)).masked_fill(~torch.isfinite(lse_set), _NEG_INF)
            log_wt = log_wt - _safe(log_wt.logsumexp(-1, keepdim=True))
            tgt = (log_p_h + log_wt.unsqueeze(-1)).logsumexp(1).exp()
        else:
            tgt = log_p_h.exp().sum(1).div_(total_heads)
        logits = _head_sum(s.clamp_min(0), wr)
        vmask = sel
    tgt = torch.nan_to_num_(tgt, nan=0.0).mul_(vmask)
    lse_i = logits.masked_fill(~vmask, _NEG_INF).logsumexp(-1)
    return dict(sel=sel, ids=ids, qir=qir, wr=wr, kig=kig, s=s, tgt=tgt, logits=logits, vmask=vmask,
                lse_i=lse_i, lse_set=lse_set, log_p_h=log_p_h)


def _sparse_rows_per_chunk(q_i, k_i, q, k, kk, acc, chunk_rows):
    """Query rows per chunk of the sparse loss: its gathered [rows, k, ...] tensors stay within _SPARSE_BYTES."""
    if chunk_rows:
        return max(1, chunk_rows)
    dk_row = k.shape[-1] * (k.shape[1] if k.dim() == 3 else 1) + k_i.shape[-1]
    return max(1, _SPARSE_BYTES // max(1, kk * max(q.shape[1], q_i.shape[1], dk_row) * (torch.finfo(acc).bits // 8)))


def sparse_kl_fwd(q_i, k_i, w, q, k, scale, lse_att, idx, ks, ke, per_head, total_heads, partial,
                  chunk_rows=None):
    """Per-token loss [T], indexer_lse over the set ([T] or [T, H]), the attention LSE over the set [T, H] and
    the target mass ([T] or [T, H]); the loss terms are those of `warmup_kl_fwd` restricted to the set."""
    acc = accum_dtype(q_i, k_i, w, q, k)
    rows, heads, kk = q.shape[0], q.shape[1], idx.shape[1]
    dev = q.device
    loss = torch.zeros(rows, dtype=acc, device=dev)
    lse_i = torch.full((rows, heads) if per_head else (rows,), _NEG_INF, dtype=acc, device=dev)
    lse_set = torch.full((rows, heads), _NEG_INF, dtype=acc, device=dev)
    mass = torch.zeros(lse_i.shape, dtype=acc, device=dev)
    rc = _sparse_rows_per_chunk(q_i, k_i, q, k, kk, acc, chunk_rows)
    for r0 in range(0, rows, rc):
        r1 = min(rows, r0 + rc)
        c = _sparse_chunk(q_i, k_i, w, q, k, scale, lse_att, idx, ks, ke, r0, r1, per_head, total_heads, acc)
        tgt, logits, li = c["tgt"], c["logits"], c["lse_i"]
        p_i = (tgt * logits).sum(-1)
        m = tgt.sum(-1)
        if per_head:
            plogp = (tgt * c["log_p_h"].masked_fill(~c["vmask"], 0)).sum(-1)
        elif partial:
            plogp = torch.zeros_like(p_i)
        else:
            plogp = torch.xlogy(tgt, tgt).sum(-1)
        term = plogp - p_i + m * _safe(li)
        loss[r0:r1] = term.sum(-1) / total_heads if per_head else term
        lse_i[r0:r1] = li
        lse_set[r0:r1] = c["lse_set"]
        mass[r0:r1] = m
    return loss, lse_i, lse_set, mass


def sparse_kl_bwd(grad, q_i, k_i, w, q, k, scale, lse_att, idx, ks, ke, per_head, total_heads, deterministic,
                  chunk_rows=None):
    """(dq_I, dk_I, dw): dL/dI on the set = grad * (m softmax_set(I) - p), scattered into k_I's rows."""
    acc = accum_dtype(q_i, k_i, w, q, k)
    rows, heads, kk = q.shape[0], q.shape[1], idx.shape[1]
    dq = torch.zeros(q_i.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k_i.shape, dtype=acc, device=q.device)
    dw = torch.zeros(w.shape, dtype=acc, device=q.device)
    g_all = grad.to(acc) / total_heads if per_head else grad.to(acc)
    rc = _sparse_rows_per_chunk(q_i, k_i, q, k, kk, acc, chunk_rows)
    for r0 in range(0, rows, rc):
        r1 = min(rows, r0 + rc)
        c = _sparse_chunk(q_i, k_i, w, q, k, scale, lse_att, idx, ks, ke, r0, r1, per_head, total_heads, acc)
        tgt, logits, vmask = c["tgt"], c["logits"], c["vmask"]
        m = tgt.sum(-1, keepdim=True)
        g = g_all[r0:r1].unsqueeze(-1)
        if per_head:
            g = g.unsqueeze(-1)
        soft = torch.exp(logits - _safe(c["lse_i"]).unsqueeze(-1))
        d_i = (soft * m - tgt).mul_(g).mul_(vmask)  # [r, K] or [r, H, K]
        s, wr, qir = c["s"], c["wr"], c["qir"]
        d3 = d_i.unsqueeze(1) if d_i.dim() == 2 else d_i
        dw[r0:r1] += (d3 * s.clamp_min(0)).sum(-1)
        ds = (d3 * wr.unsqueeze(-1)).mul_(s > 0)  # [r, H_I, K]
        dq[r0:r1] += torch.matmul(ds, c["kig"])
        u = torch.matmul(ds.transpose(1, 2), qir)  # [r, K, D_I]: contribution to k_I[ids]
        # NOTES: every slot is scattered (unselected ones carry zeros into key 0, ids = 0 there): a boolean
        # selection would copy its count to the host (a sync) on CUDA.
        u = u.mul_(c["sel"].unsqueeze(-1)).reshape(-1, u.shape[-1])
        ids = c["ids"].reshape(-1)
        if deterministic and dk.is_cuda:
            dk.index_put_((ids,), u, accumulate=True)  # sort-based on CUDA: order-independent
        else:
            dk.index_add_(0, ids, u)  # CPU: sequential; CUDA: atomics (order-dependent rounding)
    return dq, dk, dw
