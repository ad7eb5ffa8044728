"""Hopper (SM90) fast path of the training ops: the warm-up loss's `mean` target and the indexer logits backward.

Kernels (include/deep_indexer/training_*.cuh), per chunk of query rows (chunk buffers [rows, N] fp32 of at most
`_CHUNK_BYTES`, written only at valid (row, key) pairs, never read elsewhere):

  (no lse) training_target (lse)   the attention LSE per (row, head) when the caller passes none
  forward   training_target         p = mean_h exp(scale q.k - lse) (bf16 WGMMA, q in registers, 2-CTA multicast
                                    of the key tiles), and per row sum p log p, sum p
            training_logits_stats   per row logsumexp_s I and sum_s p I (I recomputed from q_I, k_I, w)
            loss[t] = sum p log p - sum p I + mass * lse_I   (the portable formula, reference.warmup_kl_fwd)
  backward  training_target         p again
            training_indexer_dk     I again, dI = g (mass softmax(I) - p) (written to a chunk buffer), dk_I
                                    partials per row range (summed here, in a fixed order)
            training_indexer_dq     dq_I and dw from dI

indexer logits backward (logits_bwd), per chunk of rows:
            training_indexer_dk     S, dS, dk_I partials, and the signs [S > 0] as a bit mask
            training_indexer_dq     (masked form) dq_I = w G', dw = q_I . G' with G' = sum_s bf16(dI) [S > 0] k_I
                                    from the mask: no second S

Everything accumulates in fp32; the only rounding beyond fp32 is dS = dI w [S > 0] (or dI alone, in the masked dq)
rounded to bf16 as the operand of the dq_I / dk_I WGMMAs (as in flash-attention backwards). No atomics: bitwise reproducible run to run.
Supported (else the portable path runs): CUDA SM90, bf16 q_I, k_I, q, k; target "mean": up to 128 attention heads
(fewer, e.g. a tensor-parallel rank's share, are padded to 128 per row block: the time of 128) with one key head of
dim 64..576 (multiple of 64), 64 indexer heads of dim 64 or 128. Target "per_head" (below): any
head count, one or H_kv key heads, attention dims 64 / 128 / 192 with indexer dim 64.

per_head (training_per_head.cuh), flash-attention style, no chunk buffers:
  forward   training_per_head_rows   per (row tile, head): P and I_h recomputed per key tile, the loss term, the
                                     indexer LSE and the target mass per (row, head)
  backward  training_per_head_rows   dq_I and dw (row-major, P and I_h again)
            training_per_head_dk     dk_I partials per head group (key-major, P and I_h again), summed here
"""
from __future__ import annotations

import torch

import deep_indexer._C as _C
from ..reference import row_chunks

_CHUNK_BYTES = 1 << 30  # one [rows, N] fp32 chunk buffer (the backward holds two)
_MASK_BYTES = 1 << 30  # the logits backward's sign mask: at least this much (or a quarter of the gradient's bytes)
MASKED_ROWS_PER_CTA = 4  # TrainingIndexerBwdLayout::kMaskedRowsPerCta


def mask_words_per_row(num_keys: int) -> int:
    """TrainingIndexerBwdLayout::mask_words_per_row: 128 int32 words per 64-key tile, whole 128-key blocks."""
    return (num_keys + 127) // 128 * 256
TARGET_HEADS = 128
_ABSENT_LSE = 1e30  # a padded head's LSE (finite: the kernel reads LSE values as given)
INDEXER_HEADS = 64
INDEXER_DIMS = (64, 128)
_SM90: dict = {}


def _is_sm90(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM90:
        _SM90[idx] = torch.cuda.get_device_capability(idx) == (9, 0)
    return _SM90[idx]


def logits_unsupported(q_i: torch.Tensor, k_i: torch.Tensor) -> str | None:
    """Why the indexer logits backward cannot run on the SM90 kernels (None: it can)."""
    if not _is_sm90(q_i.device):
        return f"needs an SM90 (Hopper) CUDA device, got {q_i.device}"
    if q_i.dtype != torch.bfloat16 or k_i.dtype != torch.bfloat16:
        return f"needs bfloat16 q_I and k_I, got {q_i.dtype} and {k_i.dtype}"
    if q_i.shape[1] != INDEXER_HEADS or q_i.shape[2] not in INDEXER_DIMS:
        return (f"supports {INDEXER_HEADS} indexer heads of dim {' or '.join(map(str, INDEXER_DIMS))}, got "
                f"{q_i.shape[1]} heads of dim {q_i.shape[2]}")
    if q_i.shape[0] >= 1 << 24 or k_i.shape[0] >= (1 << 31) - 256:
        return "supports fewer than 2^24 rows and 2^31 - 256 keys"
    return None


def loss_unsupported(q_i, k_i, q, k, per_head: bool) -> str | None:
    """Why the warm-up loss cannot run on the SM90 kernels (None: it can)."""
    return per_head_unsupported(q_i, k_i, q, k) if per_head else mean_unsupported(q_i, k_i, q, k)


def per_head_unsupported(q_i, k_i, q, k) -> str | None:
    """Why the `per_head` warm-up loss cannot run on the SM90 kernels (None: it can)."""
    if not _is_sm90(q_i.device):
        return f"needs an SM90 (Hopper) CUDA device, got {q_i.device}"
    if any(x.dtype != torch.bfloat16 for x in (q_i, k_i, q, k)):
        return f"needs bfloat16 q_I, k_I, q and k, got {q_i.dtype}, {k_i.dtype}, {q.dtype} and {k.dtype}"
    if not _C.training_per_head_supported(q.shape[2], q_i.shape[2]):
        return (f"per_head supports indexer dim 64 with attention dims 64, 128 or 192, got indexer dim "
                f"{q_i.shape[2]} and attention dim {q.shape[2]}")
    if q.shape[0] >= 1 << 24 or k.shape[0] >= (1 << 31) - 256 or q.shape[1] > 1024:
        return "supports fewer than 2^24 rows, 2^31 - 256 keys and at most 1024 heads"
    return None


def mean_unsupported(q_i, k_i, q, k) -> str | None:
    """Why the `mean` warm-up loss cannot run on the SM90 kernels (None: it can)."""
    return logits_unsupported(q_i, k_i) or lse_unsupported(q, k)


def lse_unsupported(q, k) -> str | None:
    """Why the `mean` target kernel (also the attention LSE kernel) cannot run on q, k (None: it can)."""
    if not _is_sm90(q.device):
        return f"needs an SM90 (Hopper) CUDA device, got {q.device}"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        return f"needs bfloat16 q and k, got {q.dtype} and {k.dtype}"
    if k.dim() != 2:
        return "needs one key head (k of shape [N, Dqk])"
    dqk = q.shape[2]
    if not 1 <= q.shape[1] <= TARGET_HEADS or dqk % 64 != 0 or not 64 <= dqk <= 576:
        return (f"supports 1 to {TARGET_HEADS} attention heads of dim 64..576 (a multiple of 64), got {q.shape[1]} of "
                f"dim {dqk}")
    return None


def _rows_per_chunk(rows: int, n_keys: int) -> int:
    rc = max(2, min(rows, _CHUNK_BYTES // (4 * max(n_keys, 1))))
    return rc + (rc & 1)


def _chunk_buffer(rc: int, n_keys: int, device) -> torch.Tensor:
    cols = max(4, (n_keys + 3) // 4 * 4)  # 16-byte aligned rows
    return torch.empty((rc, cols), dtype=torch.float32, device=device)


def _common(q_i, k_i, w, ks, ke):
    return (_C, q_i.contiguous(), k_i.contiguous(), w.float().contiguous(), ks.int().contiguous(),
            ke.int().contiguous())


def _safe(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _padded_blocks(q: torch.Tensor, r0: int, r1: int):
    """(a, b) row blocks of [r0, r1) for calls on q padded to TARGET_HEADS heads: a copy of at most _CHUNK_BYTES."""
    step = max(1, _CHUNK_BYTES // (TARGET_HEADS * q.shape[2] * q.element_size()))
    return [(a, min(r1, a + step)) for a in range(r0, r1, step)]


def _pad_heads(x: torch.Tensor, value: float) -> torch.Tensor:
    """x [rows, H, ...] or [rows, H] -> TARGET_HEADS heads, the added ones filled with `value`."""
    out = x.new_full((x.shape[0], TARGET_HEADS) + tuple(x.shape[2:]), value)
    out[:, : x.shape[1]] = x
    return out


def _target(_C, q, k, lse, ks32, ke32, p, plogp, mass, r0, r1, scale, inv_heads):
    """The target kernel over rows [r0, r1) (p's row 0 = row r0). NOTES: the kernel is built for TARGET_HEADS heads;
    fewer (a tensor-parallel rank's share) are padded per row block with zero q and an LSE of _ABSENT_LSE, so that
    exp(scale q.k - lse) = 0: a padded head adds nothing to p, and the kernel's time is that of TARGET_HEADS heads."""
    if q.shape[1] == TARGET_HEADS:
        _C.bf16_training_target(q, k, lse, ks32, ke32, p, plogp, mass, r0, r1, scale, inv_heads)
        return
    for a, b in _padded_blocks(q, r0, r1):
        _C.bf16_training_target(_pad_heads(q[a:b], 0.0), k, _pad_heads(lse[a:b], _ABSENT_LSE), ks32[a:b], ke32[a:b],
                                p[a - r0:], None if plogp is None else plogp[a:b], None if mass is None else mass[a:b],
                                0, b - a, scale, inv_heads)


def attention_lse(q, k, scale, ks, ke):
    """lse [T, H] fp32 of the attention logits over each row's valid keys (-inf for an empty row), on the target
    kernel's structure (an online max / sum per (row, head)): for callers that pass no attn_lse."""
    q, k = q.contiguous(), k.contiguous()
    ks32, ke32 = ks.int().contiguous(), ke.int().contiguous()
    heads = q.shape[1]
    lse = torch.full((q.shape[0], heads), float("-inf"), dtype=torch.float32, device=q.device)
    if heads == TARGET_HEADS:
        _C.bf16_attention_lse(q, k, ks32, ke32, lse, 0, q.shape[0], scale)
        return lse
    for a, b in _padded_blocks(q, 0, q.shape[0]):
        part = torch.empty((b - a, TARGET_HEADS), dtype=torch.float32, device=q.device)
        _C.bf16_attention_lse(_pad_heads(q[a:b], 0.0), k, ks32[a:b], ke32[a:b], part, 0, b - a, scale)
        lse[a:b] = part[:, :heads]
    return lse


def mean_fwd(q_i, k_i, w, q, k, scale, lse_att, ks, ke, ks_cpu, ke_cpu, total_heads, partial):
    """(per-token loss, indexer_lse, target_mass), fp32 [T] each: reference.warmup_kl_fwd for target="mean"."""
    _C, q_i, k_i, w, ks32, ke32 = _common(q_i, k_i, w, ks, ke)
    q, k = q.contiguous(), k.contiguous()
    rows, n_keys, dev = q.shape[0], k.shape[0], q.device
    lse = _safe(lse_att.float()).contiguous()
    plogp = torch.zeros(rows, dtype=torch.float32, device=dev)
    mass = torch.zeros_like(plogp)
    pi = torch.zeros_like(plogp)
    lse_i = torch.full_like(plogp, float("-inf"))
    rc = _rows_per_chunk(rows, n_keys)
    p = None
    for r0, r1, _lo, _hi in row_chunks(ks_cpu, ke_cpu, rc):
        if p is None:
            p = _chunk_buffer(rc, n_keys, dev)
        _target(_C, q, k, lse, ks32, ke32, p, plogp, mass, r0, r1, scale, 1.0 / total_heads)
        _C.bf16_indexer_logits_stats(q_i, k_i, w, ks32, ke32, p, lse_i, pi, r0, r1)
    entropy = torch.zeros_like(plogp) if partial else plogp
    loss = entropy - pi + mass * _safe(lse_i)
    return loss, lse_i, mass


def mean_bwd(grad, q_i, k_i, w, q, k, scale, lse_att, lse_i, mass, ks, ke, ks_cpu, ke_cpu, total_heads):
    """(dq_I, dk_I, dw) in fp32 for the per-token loss gradient `grad` [T]: reference.warmup_kl_bwd for "mean"."""
    _C, q_i, k_i, w, ks32, ke32 = _common(q_i, k_i, w, ks, ke)
    q, k = q.contiguous(), k.contiguous()
    rows, n_keys, dev = q.shape[0], k.shape[0], q.device
    lse = _safe(lse_att.float()).contiguous()
    g = grad.float().contiguous()
    lse_i = _safe(lse_i.float()).contiguous()
    mass = mass.float().contiguous()
    dq = torch.zeros(q_i.shape, dtype=torch.float32, device=dev)
    dk = torch.zeros(k_i.shape, dtype=torch.float32, device=dev)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=dev)
    rc = _rows_per_chunk(rows, n_keys)
    p = di = None
    for r0, r1, lo, hi in row_chunks(ks_cpu, ke_cpu, rc):
        if p is None:
            p, di = _chunk_buffer(rc, n_keys, dev), _chunk_buffer(rc, n_keys, dev)
        _target(_C, q, k, lse, ks32, ke32, p, None, None, r0, r1, scale, 1.0 / total_heads)
        part = _C.bf16_indexer_logits_bwd_dk(q_i, k_i, w, ks32, ke32, p, r0, g, mass, lse_i, di, r0, r1, lo, hi)
        dk[lo:hi] += part.sum(0)[: hi - lo]
        _C.bf16_indexer_logits_bwd_dq(q_i, k_i, w, ks32, ke32, di, r0, dq, dw, r0, r1)
    return dq, dk, dw


def _logits_bwd_plan(ks_cpu, ke_cpu, rows, n_keys, grad_bytes):
    """(mask words per row, [(r0, r1, c_lo, c_hi)] row chunks with their key ranges) of logits_bwd, or None
    without a valid key. NOTES: cached on ks_cpu (keyed by both tensors' identities and versions): the bounds
    of an op come from _bounds' cache, and boolean indexing of [T] CPU tensors cost ~1 ms of host time per call."""
    key = (id(ke_cpu), ks_cpu._version, ke_cpu._version, rows, n_keys, grad_bytes, _MASK_BYTES)
    hit = getattr(ks_cpu, "_di_logits_bwd_plan", None)
    if hit is not None and hit[0] == key:
        return hit[1]
    ks_c, ke_c = ks_cpu.clamp(0, n_keys), ke_cpu.clamp(0, n_keys)
    live = ks_c < ke_c
    plan = None
    if rows and n_keys and bool(live.any()):
        big = torch.iinfo(ks_c.dtype).max
        lo_of = torch.where(live, ks_c, torch.full_like(ks_c, big))
        hi_of = torch.where(live, ke_c, torch.zeros_like(ke_c))
        lo, hi = int(lo_of.min()), int(hi_of.max())
        words = mask_words_per_row(hi - lo)
        budget = max(_MASK_BYTES, grad_bytes // 4)
        chunk = max(MASKED_ROWS_PER_CTA, min(rows, budget // (4 * words)))
        chunks = []
        for r0 in range(0, rows, chunk):
            r1 = min(rows, r0 + chunk)
            c_lo, c_hi = int(lo_of[r0:r1].min()), int(hi_of[r0:r1].max())
            chunks.append((r0, r1, c_lo, c_hi) if c_lo < c_hi else (r0, r1, lo, lo))
        plan = (words, chunks)
    ks_cpu._di_logits_bwd_plan = (key, plan)
    return plan


def logits_bwd(grad, q_i, k_i, w, ks, ke, ks_cpu, ke_cpu):
    """(dq_I in bf16, dk_I and dw in fp32) of the indexer logits for the incoming gradient grad [T, N] (read at
    valid keys). Per chunk of rows: the dk kernel (S, dS, dk_I partials) also writes the signs [S > 0] as a bit
    mask (8 bytes per (row, key)); the masked dq kernel reads them instead of computing S again, so the backward
    costs 3 GEMMs' work rather than 4. The mask takes at most max(_MASK_BYTES, a quarter of grad's bytes)."""
    _C, q_i, k_i, w, ks32, ke32 = _common(q_i, k_i, w, ks, ke)
    rows, n_keys, dev = q_i.shape[0], k_i.shape[0], q_i.device
    plan = _logits_bwd_plan(ks_cpu, ke_cpu, rows, n_keys, grad.numel() * grad.element_size())
    if plan is None:
        return (torch.zeros(q_i.shape, dtype=q_i.dtype, device=dev),
                torch.zeros(k_i.shape, dtype=torch.float32, device=dev),
                torch.zeros(w.shape, dtype=torch.float32, device=dev))
    words, chunks = plan
    g = grad.float()
    if g.stride(-1) != 1 or g.stride(0) < g.shape[1] or g.data_ptr() % 16:
        g = g.contiguous()
    mask = torch.empty((chunks[0][1] - chunks[0][0], words), dtype=torch.int32, device=dev)
    # the masked dq kernel writes dq and dw of every row (zeros where a row has no keys)
    dq = torch.empty(q_i.shape, dtype=torch.bfloat16, device=dev)
    dw = torch.empty(w.shape, dtype=torch.float32, device=dev)
    dk = None
    for r0, r1, c_lo, c_hi in chunks:
        if c_lo < c_hi:
            part = _C.bf16_indexer_logits_bwd_dk(q_i, k_i, w, ks32, ke32, g, 0, None, None, None, None, r0, r1, c_lo,
                                                 c_hi, mask, r0)
            if dk is None and c_lo == 0 and c_hi == n_keys and r1 == rows:
                dk = part.sum(0)[:n_keys]
            else:
                if dk is None:
                    dk = torch.zeros(k_i.shape, dtype=torch.float32, device=dev)
                dk[c_lo:c_hi] += part.sum(0)[: c_hi - c_lo]
        _C.bf16_indexer_logits_bwd_dq(q_i, k_i, w, ks32, ke32, g, 0, dq, dw, r0, r1, mask, r0, c_lo, c_hi)
    return dq, dk, dw


# ---------------------------------------------------------------------------------------------- per_head
def per_head_fwd(q_i, k_i, w, q, k, scale, lse_att, ks, ke, total_heads):
    """(per-token loss [T], indexer_lse [T, H], target_mass [T, H]): reference.warmup_kl_fwd for "per_head"."""
    _C, q_i, k_i, w, ks32, ke32 = _common(q_i, k_i, w, ks, ke)
    q, k = q.contiguous(), k.contiguous()
    rows, heads = q.shape[0], q.shape[1]
    kl, lse_i, mass = (torch.empty((rows, heads), dtype=torch.float32, device=q.device) for _ in range(3))
    _C.bf16_per_head_fwd(q, k, q_i, k_i, ks32, ke32, lse_att.float().contiguous(), w, kl, lse_i, mass, scale)
    return kl.sum(-1) / total_heads, lse_i, mass


def per_head_bwd(grad, q_i, k_i, w, q, k, scale, lse_att, lse_i, mass, ks, ke, total_heads):
    """(dq_I, dk_I, dw) in fp32: reference.warmup_kl_bwd for "per_head"."""
    _C, q_i, k_i, w, ks32, ke32 = _common(q_i, k_i, w, ks, ke)
    q, k = q.contiguous(), k.contiguous()
    dq = torch.empty(q_i.shape, dtype=torch.float32, device=q.device)
    dw = torch.empty(w.shape, dtype=torch.float32, device=q.device)
    dk = _C.bf16_per_head_bwd(q, k, q_i, k_i, ks32, ke32, lse_att.float().contiguous(), w, lse_i.float().contiguous(),
                              mass.float().contiguous(), (grad.float() / total_heads).contiguous(), dq, dw, scale)
    return dq, dk, dw
