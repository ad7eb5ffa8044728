"""Quantization helpers: per-token fp8 and fp4 casts and the fused paged KV cache layouts.

FP8 paged cache (vLLM / SGLang): uint8 ``[num_blocks, block_kv, 1, D + 4]``. Inside each
physical block the first ``block_kv * D`` bytes are the fp8 keys (token-major), followed by
``block_kv`` little-endian fp32 scales. ``stride(0)`` (bytes between blocks) may exceed
``block_kv * (D + 4)``. A slot is ``physical_block * block_kv + offset``.

FP4 (DeepGEMM's / DeepSeek-V4's indexer format, docs/fp4.md): per token, groups of 32 values
along D (D in {32, 64, 96, 128}); each group has a ue8m0 scale 2^(e - 127) with
e = biased exponent of ceil_pow2(max(amax, 1e-4) / 6), clamped to [1, 254]; values are e2m1
codes (sign bit 3, magnitude index 0..7 -> {0, .5, 1, 1.5, 2, 3, 4, 6}), two per byte (element
2i in the low nibble, 2i + 1 in the high nibble). A token's D / 32 exponent bytes, padded to 4
with 127 (scale 1.0), form one little-endian int32 scale word (byte g = group g). FP4 paged
cache: uint8 ``[num_blocks, block_kv, 1, D / 2 + 4]``: ``block_kv * D / 2`` code bytes
(token-major), then ``block_kv`` int32 scale words (68 bytes per key at D = 128). Code tensors
are returned as uint8 (the cache's byte type; ``.view(torch.int8)`` is free) and accepted as
uint8 or int8. The host is assumed little-endian (as torch's dtype views are).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

import deep_indexer._C as _C

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_EPS = 1e-10

__all__ = [
    "per_token_cast_to_fp8",
    "pack_paged_kv_cache",
    "write_paged_kv_cache",
    "dequantize_paged_kv_cache",
    "per_token_cast_to_fp4",
    "fp4_to_float",
    "fp4_to_e4m3_folded",
    "fold_fp4_to_e4m3",
    "fold_fp4_to_e4m3_torch",
    "exp2_int",
    "pack_paged_kv_cache_fp4",
    "write_paged_kv_cache_fp4",
    "dequantize_paged_kv_cache_fp4",
    "paged_kv_slots",
    "write_paged_kv_step",
]

FP4_GROUP = 32  # values per ue8m0 scale
FP4_MAX = 6.0
FP4_AMAX_EPS = 1e-4
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitude of codes 0..7
FP4_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # |x / scale| > t_i -> code >= i + 1 (ties down)
FP4_CODE_DTYPES = (torch.uint8, torch.int8)
UE8M0_ONE = 127  # biased exponent of 1.0 (the padding of the scale word)


def _check(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    ndim: int | Sequence[int] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Validate a tensor argument; raise TypeError/ValueError naming `name`, expected and actual."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        exp = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {exp}, got {t.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            exp = " or ".join(f"{n}-D" for n in allowed)
            raise ValueError(f"{name}: expected a {exp} tensor, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(e is not None and e != a for e, a in zip(shape, t.shape)):
            exp = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{name}: expected shape {exp}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    return t


def _check_int(name: str, v: object, *, min_value: int | None = None) -> int:
    """Validate a Python int argument (bool rejected)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if min_value is not None and v < min_value:
        raise ValueError(f"{name}: expected an int >= {min_value}, got {v}")
    return v


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_SLOT_DTYPES = (torch.int32, torch.int64)


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (x_fp8 [..., D] float8_e4m3fn, scale [...] float32) with x ~= x_fp8 * scale.

    scale = max(amax(|x|, D) / 448, 1e-10), so all-zero rows quantize to zeros.
    """
    _check("x", x, dtypes=_FLOATS)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x: expected shape [..., D] with D >= 1, got {list(x.shape)}")
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(SCALE_EPS)
    x_fp8 = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x_fp8, scale


def _kv_cache_views(kv_cache: object, *, fp4: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a fused paged cache; return byte views (keys [nb, block_kv, C], scales [nb, block_kv, 4]).

    C = D for the fp8 cache (fp8 bytes, fp32 scales), D / 2 for the fp4 cache (code bytes, int32 words)."""
    row_name = "D / 2 + 4" if fp4 else "D + 4"
    kv = _check("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=4)
    nb, bkv, one, dp4 = kv.shape
    if one != 1 or dp4 <= 4 or bkv < 1:
        raise ValueError(
            f"kv_cache: expected shape [num_blocks, block_kv >= 1, 1, {row_name} > 4], got {list(kv.shape)}")
    d = dp4 - 4
    row = bkv * dp4
    if kv.stride(3) != 1 or (bkv > 1 and kv.stride(1) != dp4):
        raise ValueError(
            f"kv_cache: expected strides [>= {row}, {dp4}, *, 1] (each block's bytes contiguous), "
            f"got {list(kv.stride())}")
    s0 = kv.stride(0) if nb > 1 else row
    if s0 < row:
        raise ValueError(f"kv_cache: expected stride(0) >= block_kv * ({row_name}) = {row} bytes, got {s0}")
    raw = kv.as_strided((nb, row), (s0, 1), kv.storage_offset())
    k_bytes = raw[:, : bkv * d].view(nb, bkv, d)
    s_bytes = raw[:, bkv * d:].view(nb, bkv, 4)
    return k_bytes, s_bytes


def dequantize_paged_kv_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """Fused paged cache -> float32 [num_blocks, block_kv, D] holding k_fp8 * scale for every slot."""
    k_bytes, s_bytes = _kv_cache_views(kv_cache)
    k = k_bytes.view(FP8).float()
    scale = s_bytes.contiguous().view(torch.float32)  # [nb, bkv, 1]
    return k * scale


def _scatter_slots(
    k_bytes: torch.Tensor,
    s_bytes: torch.Tensor,
    rows: torch.Tensor,
    words: torch.Tensor,
    slots: torch.Tensor,
    check_slots: bool,
) -> None:
    """k_bytes[slot] = rows[t], s_bytes[slot] = words[t] for every token t with 0 <= slots[t] < num_slots.

    rows uint8 [T, C], words uint8 [T, 4], slots int64 [T] (T >= 1). Without check_slots nothing syncs with
    the host (graph-capturable): a skipped token rewrites what the first kept token writes (or, with none
    kept, slot 0's current bytes), so duplicate indices only ever carry identical bytes.
    With check_slots a slot >= num_slots raises a ValueError (one host sync)."""
    nb, bkv = k_bytes.shape[0], k_bytes.shape[1]
    n_slots = nb * bkv
    if check_slots:
        smax = int(slots.max())
        if smax >= n_slots:
            raise ValueError(f"slot_mapping: expected slots < num_blocks * block_kv = {n_slots}, got {smax}")
    keep = (slots >= 0) & (slots < n_slots)
    first = keep.to(torch.int32).argmax().reshape(1)  # first kept token (0 when none)
    any_kept = keep.any()
    zero = torch.zeros(1, dtype=torch.long, device=slots.device)
    fb_slot = torch.where(any_kept, slots.index_select(0, first), zero)
    fb_row = torch.where(any_kept, rows.index_select(0, first), k_bytes[0, 0].unsqueeze(0))
    fb_word = torch.where(any_kept, words.index_select(0, first), s_bytes[0, 0].unsqueeze(0))
    k2 = keep.unsqueeze(1)
    tgt = torch.where(keep, slots, fb_slot)
    blk, off = tgt // bkv, tgt % bkv
    k_bytes[blk, off] = torch.where(k2, rows, fb_row)
    s_bytes[blk, off] = torch.where(k2, words, fb_word)


def _write_slots(kv_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, fp4: bool,
                 check_slots: bool) -> torch.Tensor:
    k_bytes, s_bytes = _kv_cache_views(kv_cache, fp4=fp4)
    c = k_bytes.shape[2]
    d = 2 * c if fp4 else c
    dev = kv_cache.device
    k = _check("k", k, dtypes=_FLOATS, shape=(None, d), device=dev)
    slots = _check("slot_mapping", slot_mapping, dtypes=_SLOT_DTYPES, shape=(k.shape[0],), device=dev)
    if not isinstance(check_slots, bool):
        raise TypeError(f"check_slots: expected a bool, got {type(check_slots).__name__}")
    if k.shape[0] == 0:
        return kv_cache
    if fp4:
        codes, sf = per_token_cast_to_fp4(k)
        rows, words = codes, _sf_bytes(sf)
    else:
        x_fp8, scale = per_token_cast_to_fp8(k)
        rows, words = x_fp8.view(torch.uint8), scale.contiguous().view(torch.uint8).view(-1, 4)
    _scatter_slots(k_bytes, s_bytes, rows, words, slots.long(), check_slots)
    return kv_cache


def write_paged_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, *,
                         check_slots: bool = True) -> torch.Tensor:
    """Quantize k [T, D] per token (fp8) and store token t in slot slot_mapping[t] of kv_cache, in place.

    Slots < 0 are skipped (padding tokens); slots must be distinct. check_slots=True raises a ValueError
    for a slot >= num_blocks * block_kv (one host sync); check_slots=False skips such slots instead and
    never syncs (CUDA-graph capturable). Returns kv_cache.
    """
    return _write_slots(kv_cache, k, slot_mapping, False, check_slots)


def write_paged_kv_cache_fp4(kv_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, *,
                             check_slots: bool = True) -> torch.Tensor:
    """The fp4 twin of write_paged_kv_cache: quantize k [T, D] per token (per_token_cast_to_fp4) into an
    fp4 paged cache uint8 [num_blocks, block_kv, 1, D / 2 + 4], in place. Same slot rules. Returns kv_cache.
    """
    return _write_slots(kv_cache, k, slot_mapping, True, check_slots)


def paged_kv_slots(
    block_table: torch.Tensor,
    positions: torch.Tensor,
    block_kv: int,
    *,
    seq_ids: torch.Tensor | None = None,
    num_blocks: int | None = None,
) -> torch.Tensor:
    """Cache slot of every new token: int64 [T], block_table[b, pos // block_kv] * block_kv + pos % block_kv.

    block_table int32 [B, max_blocks]; positions int32/int64 [T] (the token's position in its sequence);
    seq_ids int32/int64 [T] (the token's block-table row; None: token t is row t, T == B). A token whose
    position is < 0, whose seq_id is outside [0, B), whose block index is past the table, or whose table
    entry is < 0 (or >= num_blocks when given) gets slot -1 (skipped by the writers). No host sync.
    """
    bt = _check("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    dev = bt.device
    pos = _check("positions", positions, dtypes=_SLOT_DTYPES, ndim=1, device=dev)
    _check_int("block_kv", block_kv, min_value=1)
    if num_blocks is not None:
        _check_int("num_blocks", num_blocks, min_value=0)
    b_sz, width = bt.shape
    t = pos.shape[0]
    if seq_ids is None:
        if t != b_sz:
            raise ValueError(f"positions: expected shape [{b_sz}] (one token per block-table row) without "
                             f"seq_ids, got {list(pos.shape)}")
        sid = torch.arange(t, device=dev)
    else:
        sid = _check("seq_ids", seq_ids, dtypes=_SLOT_DTYPES, shape=(t,), device=dev).long()
    pos = pos.long()
    if width == 0 or b_sz == 0:
        return torch.full((t,), -1, dtype=torch.long, device=dev)
    col = torch.div(pos, block_kv, rounding_mode="floor")
    ok = (pos >= 0) & (col < width) & (sid >= 0) & (sid < b_sz)
    phys = bt[sid.clamp(0, b_sz - 1), col.clamp(0, width - 1)].long()
    ok &= phys >= 0
    if num_blocks is not None:
        ok &= phys < num_blocks
    return torch.where(ok, phys * block_kv + pos % block_kv, torch.full_like(pos, -1))


def write_paged_kv_step(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    *,
    seq_ids: torch.Tensor | None = None,
    fmt: str = "fp8",
) -> torch.Tensor:
    """One engine step: quantize the new keys k [T, D] and store them in their paged-cache slots, in place.

    fmt "fp8" (cache [num_blocks, block_kv, 1, D + 4]) or "fp4" ([..., D / 2 + 4]). Slots come from
    paged_kv_slots(block_table, positions, block_kv, seq_ids=seq_ids, num_blocks=num_blocks): tokens with
    no valid slot (position -1 for padding, a block past the table or a negative table entry) are skipped.
    Plain torch ops, no host sync: runs on CPU and CUDA and can be captured in a CUDA graph. Returns kv_cache.
    """
    if fmt not in ("fp8", "fp4"):
        raise ValueError(f"fmt: expected 'fp8' or 'fp4', got {fmt!r}")
    k_bytes, _ = _kv_cache_views(kv_cache, fp4=fmt == "fp4")
    nb, bkv = k_bytes.shape[0], k_bytes.shape[1]
    slots = paged_kv_slots(block_table, positions, bkv, seq_ids=seq_ids, num_blocks=nb)
    return _write_slots(kv_cache, k, slots, fmt == "fp4", False)


def _pack_paged(k_list_or_tensor, block_kv, num_blocks, block_stride, shuffle, generator, fp4: bool):
    if isinstance(k_list_or_tensor, torch.Tensor):
        _check("k_list_or_tensor", k_list_or_tensor, dtypes=_FLOATS, ndim=3)
        seqs = list(k_list_or_tensor.unbind(0))
    elif isinstance(k_list_or_tensor, (list, tuple)):
        seqs = list(k_list_or_tensor)
    else:
        raise TypeError(
            f"k_list_or_tensor: expected a list of [len, D] tensors or a [B, L, D] tensor, "
            f"got {type(k_list_or_tensor).__name__}")
    if not seqs:
        raise ValueError("k_list_or_tensor: expected at least one sequence, got 0")
    _check_int("block_kv", block_kv, min_value=1)
    first = _check("k_list_or_tensor[0]", seqs[0], dtypes=_FLOATS, ndim=2)
    d, dev = first.shape[1], first.device
    if d < 1:
        raise ValueError(f"k_list_or_tensor[0]: expected D >= 1, got shape {list(first.shape)}")
    if fp4:
        _check_fp4_dim("k_list_or_tensor[0]", d)
    for i, s in enumerate(seqs):
        _check(f"k_list_or_tensor[{i}]", s, dtypes=_FLOATS, shape=(None, d), device=dev)
    lens = [s.shape[0] for s in seqs]
    nblk = [math.ceil(n / block_kv) for n in lens]
    total = sum(nblk)
    if num_blocks is None:
        num_blocks = max(total, 1)
    _check_int("num_blocks", num_blocks, min_value=max(total, 1))
    width = (d // 2 if fp4 else d) + 4
    row = block_kv * width
    if block_stride is None:
        block_stride = row
    _check_int("block_stride", block_stride, min_value=row)

    g = generator
    flat = torch.randint(0, 256, (num_blocks * block_stride,), generator=g, dtype=torch.uint8).to(dev)
    kv_cache = flat.as_strided((num_blocks, block_kv, 1, width), (block_stride, width, width, 1))
    perm = torch.randperm(num_blocks, generator=g) if shuffle else torch.arange(num_blocks)
    table = torch.randint(-(2**31), 2**31, (len(seqs), max(1, max(nblk))), generator=g, dtype=torch.int32)
    slots = []
    cur = 0
    for b, (n, nbk) in enumerate(zip(lens, nblk)):
        table[b, :nbk] = perm[cur: cur + nbk].to(torch.int32)
        cur += nbk
        pos = torch.arange(n)
        slots.append(table[b, pos // block_kv].long() * block_kv + pos % block_kv)
    keys = torch.cat([s.float() for s in seqs])
    _write_slots(kv_cache, keys, torch.cat(slots).to(dev), fp4, True)
    ctx = torch.tensor(lens, dtype=torch.int32)
    return kv_cache, table.to(dev), ctx.to(dev)


def pack_paged_kv_cache(
    k_list_or_tensor: Sequence[torch.Tensor] | torch.Tensor,
    block_kv: int,
    *,
    num_blocks: int | None = None,
    block_stride: int | None = None,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize per-sequence keys and pack them into a fused paged cache.

    k_list_or_tensor: list of [len_b, D] float tensors, or a [B, L, D] tensor (all lengths L).
    Returns (kv_cache uint8 [num_blocks, block_kv, 1, D + 4] (stride(0) = block_stride bytes),
    block_table int32 [B, max(1, max_b ceil(len_b / block_kv))], context_lens int32 [B]), all on
    the keys' device. Physical blocks are a random permutation when shuffle=True; unused
    block_table entries are random int32 (often out of range) and unused cache bytes are random.
    generator (a CPU torch.Generator) makes all of this reproducible.
    """
    return _pack_paged(k_list_or_tensor, block_kv, num_blocks, block_stride, shuffle, generator, False)


def pack_paged_kv_cache_fp4(
    k_list_or_tensor: Sequence[torch.Tensor] | torch.Tensor,
    block_kv: int,
    *,
    num_blocks: int | None = None,
    block_stride: int | None = None,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_paged_kv_cache for the fp4 cache: keys quantized by per_token_cast_to_fp4 (D in {32, 64, 96, 128}).

    Returns (kv_cache uint8 [num_blocks, block_kv, 1, D / 2 + 4], block_table, context_lens); inside each
    block the block_kv * D / 2 code bytes (token-major) come first, then block_kv int32 scale words.
    Same options and randomness as pack_paged_kv_cache.
    """
    return _pack_paged(k_list_or_tensor, block_kv, num_blocks, block_stride, shuffle, generator, True)


# ------------------------------------------------------------------------------------ fp4
def _check_fp4_dim(name: str, d: int) -> None:
    if d % FP4_GROUP or not FP4_GROUP <= d <= 4 * FP4_GROUP:
        raise ValueError(f"{name}: expected head_dim D in (32, 64, 96, 128) for fp4 (groups of 32, at most "
                         f"4 scales per int32 word), got D = {d}")


def _sf_bytes(sf: torch.Tensor) -> torch.Tensor:
    """int32 scale words [...] -> their little-endian bytes uint8 [..., 4] (byte g = exponent of group g)."""
    return sf.contiguous().unsqueeze(-1).view(torch.uint8)


def per_token_cast_to_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D / 2], sf int32 [...]): DeepGEMM's fp4 format, bit for bit.

    Per group of 32 values along D: amax = max(max |x|, 1e-4); e = biased exponent of amax / 6 rounded up
    to a power of two, clamped to [1, 254]; scale = 2^(e - 127); |x| / scale is coded by the thresholds
    0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0 (strictly above a threshold -> the next code: ties round down,
    anything above 5 -> 6); bit 3 (sign) only on a nonzero code of a negative value (so -0.0 -> code 0).
    Element 2i goes to the low nibble of byte i, 2i + 1 to the high nibble. sf packs the D / 32 exponents
    little-endian (byte g = group g), padded to 4 bytes with 127 (1.0). Computed in float32 (x.float());
    D in {32, 64, 96, 128}. NaN inputs give unspecified codes. Any leading shape: q [S, H, D] -> sf [S, H], k [SKV, D] -> sf [SKV].
    """
    _check("x", x, dtypes=_FLOATS)
    if x.dim() < 1:
        raise ValueError(f"x: expected shape [..., D], got {list(x.shape)}")
    d = x.shape[-1]
    _check_fp4_dim("x", d)
    lead = x.shape[:-1]
    ng = d // FP4_GROUP
    xg = x.float().reshape(*lead, ng, FP4_GROUP)
    amax = xg.abs().amax(dim=-1).clamp_min(FP4_AMAX_EPS)
    bits = (amax / FP4_MAX).view(torch.int32)  # positive: sign bit clear
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # round up to a power of two
    e = e.clamp(1, 254)
    inv = ((254 - e) << 23).view(torch.float32)  # 2^(127 - e) = 1 / scale, exact (a normal or subnormal float)
    inv = torch.where(e == 254, torch.full_like(inv, 2.0 ** -127), inv)  # 254 - 254 = 0 bits would read as 0
    y = xg * inv.unsqueeze(-1)
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=x.device)
    ay = y.abs()
    for t in FP4_THRESHOLDS:
        mag += (ay > t).to(torch.uint8)
    code = mag | (((y < 0) & (mag != 0)).to(torch.uint8) << 3)
    code = code.reshape(*lead, d // 2, 2)
    codes = code[..., 0] | (code[..., 1] << 4)
    sfb = torch.full((*lead, 4), UE8M0_ONE, dtype=torch.uint8, device=x.device)
    sfb[..., :ng] = e.to(torch.uint8)
    sf = sfb.view(torch.int32).squeeze(-1)
    return codes.contiguous(), sf


def _fp4_checked(codes: object, sf: object, codes_name: str = "codes", sf_name: str = "sf"):
    """Validate (codes [..., D / 2] uint8/int8, sf [...] int32); return (codes as uint8, sf). No device work."""
    c = _check(codes_name, codes, dtypes=FP4_CODE_DTYPES)
    if c.dim() < 1:
        raise ValueError(f"{codes_name}: expected shape [..., D / 2], got {list(c.shape)}")
    _check_fp4_dim(codes_name + " (D = 2 * last dim)", 2 * c.shape[-1])
    s = _check(sf_name, sf, dtypes=(torch.int32,), shape=tuple(c.shape[:-1]), device=c.device)
    return (c.view(torch.uint8) if c.dtype == torch.int8 else c), s


def _fp4_inputs(codes: object, sf: object, codes_name: str = "codes", sf_name: str = "sf"):
    """Validate (codes [..., D / 2] uint8/int8, sf [...] int32); return (codes as uint8, exponents int32 [..., D / 32])."""
    c, s = _fp4_checked(codes, sf, codes_name, sf_name)
    exps = _sf_bytes(s)[..., : 2 * c.shape[-1] // FP4_GROUP].to(torch.int32)
    return c, exps


def _unpack_codes(c: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 2] -> 4-bit codes uint8 [..., D] (element 2i from the low nibble)."""
    return torch.stack([c & 0x0F, c >> 4], dim=-1).flatten(-2)


def _code_values(code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """4-bit codes -> e2m1 values (bit 3 negates; code 8 = -0 reads as 0)."""
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=code.device)
    v = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -v, v)


def fp4_to_float(codes: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize: (codes uint8/int8 [..., D / 2], sf int32 [...]) -> [..., D] with value e2m1(code) * 2^(e_g - 127).

    Exact in float64 (the cast only makes exponent bytes 1..254; 0 and 255 read as 2^-127 and 2^128). In
    float32 it is exact except where a value overflows (|value| >= 2^128: exponent bytes >= 253 only).
    """
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    return _fp4_dequant(*_fp4_inputs(codes, sf), dtype)


def _fp4_dequant(c: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Validated (codes uint8 [..., D / 2], exponents int32 [..., D / 32]) -> dequantized [..., D] in dtype."""
    vals = _code_values(_unpack_codes(c), torch.float64)
    scale = torch.pow(2.0, (exps - 127).to(torch.float64))
    out = vals.unflatten(-1, (exps.shape[-1], FP4_GROUP)) * scale.unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def dequantize_paged_kv_cache_fp4(kv_cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP4 paged cache uint8 [num_blocks, block_kv, 1, D / 2 + 4] -> [num_blocks, block_kv, D] dequantized."""
    k_bytes, s_bytes = _kv_cache_views(kv_cache, fp4=True)
    _check_fp4_dim("kv_cache (D = 2 * (last dim - 4))", 2 * k_bytes.shape[2])
    return fp4_to_float(k_bytes, s_bytes.contiguous().view(torch.int32).squeeze(-1), dtype)


E4M3_FOLD_MIN_SHIFT = -8  # e2m1 value * 2^s is exactly an e4m3 value for every code iff -8 <= s <= 6
E4M3_FOLD_MAX_SHIFT = 6


def fp4_to_e4m3_folded(codes: torch.Tensor, sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold each group's scale into e4m3 values relative to a per-token power of two (the SM90 kernel plan).

    Returns (vals float8_e4m3fn [..., D], base int32 [...], exact bool [...]) with, where exact,
    vals * 2^(base - 127) == fp4_to_float(codes, sf) element for element. base = (largest exponent among
    the token's groups that hold a nonzero code, or of all groups when none does) - 6, so the largest group
    is shifted by 2^6 (6 * 64 = 384 <= 448). Every e2m1 value times 2^s is exact in e4m3 for -8 <= s <= 6
    (normals down to 2^-6, subnormals k * 2^-9), so a token is exact whenever its nonzero groups span at
    most 14 exponents; otherwise `exact` is False unless all its out-of-range values happen to fit anyway.
    Values of an inexact token are rounded to e4m3 (saturated at +-448).
    """
    c, exps = _fp4_inputs(codes, sf)
    code = _unpack_codes(c).unflatten(-1, (exps.shape[-1], FP4_GROUP))  # [..., G, 32]
    nonzero = (code & 7).amax(dim=-1) != 0  # [..., G]
    e_top = torch.where(nonzero, exps, torch.full_like(exps, -1)).amax(dim=-1)
    e_top = torch.where(e_top < 0, exps.amax(dim=-1), e_top)
    base = e_top - E4M3_FOLD_MAX_SHIFT
    shift = (exps - base.unsqueeze(-1)).to(torch.float64)  # [..., G]
    want = _code_values(code, torch.float64) * torch.pow(2.0, shift).unsqueeze(-1)
    vals = want.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    exact = (vals.double() == want).flatten(-2).all(dim=-1)
    return vals.flatten(-2), base, exact


# The fast fold (what the ops run before the FP8 kernel): one table lookup per code byte. A byte holds two
# codes of the same group, and its two e4m3 bytes depend only on (byte, group shift s = e_g - base), with s
# clamped to [E4M3_FOLD_TABLE_MIN_SHIFT, 6]: a group with s > 6 holds only zero codes (base comes from the
# largest nonzero group), and below -30 every code rounds to +-0 (6 x 2^-30 < 2^-10, half of e4m3's smallest
# subnormal) exactly as at -30. The table is fp4_to_e4m3_folded's own rounding (clamp to +-448, then
# float8_e4m3fn), computed once per device from exact float32 values (e2m1 x 2^s, |s| <= 30).
E4M3_FOLD_TABLE_MIN_SHIFT = -30
_FOLD_TABLES: dict = {}


def _fold_table(device: torch.device) -> torch.Tensor:
    """int16 [37 * 256]: entry (s + 30) * 256 + byte = the e4m3 bytes of its two codes times 2^s (low byte:
    the low nibble's code). Built on `device` from torch ops (no host copy: safe inside CUDA-graph capture)."""
    key = str(device)
    table = _FOLD_TABLES.get(key)
    if table is None:
        n_shift = E4M3_FOLD_MAX_SHIFT - E4M3_FOLD_TABLE_MIN_SHIFT + 1
        byte = torch.arange(256, dtype=torch.int32, device=device)
        code = torch.stack([byte & 0x0F, byte >> 4], dim=-1)  # [256, 2]
        m = code & 7
        # e2m1 magnitude of index m: 0, 0.5 for m < 2 (m / 2), else (1 + (m & 1) / 2) * 2^((m >> 1) - 1)
        mag = torch.where(m < 2, m.float() * 0.5, (1.0 + (m & 1).float() * 0.5) * torch.pow(2.0, ((m >> 1) - 1).float()))
        val = torch.where((code & 8) != 0, -mag, mag)  # code 8: -0.0, as _code_values gives
        shift = torch.arange(E4M3_FOLD_TABLE_MIN_SHIFT, E4M3_FOLD_MAX_SHIFT + 1, dtype=torch.float32, device=device)
        want = val.unsqueeze(0) * torch.pow(2.0, shift).view(n_shift, 1, 1)  # exact in float32
        e4m3 = want.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8).to(torch.int32)  # [n_shift, 256, 2]
        table = (e4m3[..., 0] | (e4m3[..., 1] << 8)).to(torch.int16).reshape(-1)  # wraps to int16: same bits
        _FOLD_TABLES[key] = table
    return table


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as float32, exactly, for int32 e in [-22, 254] (subnormals below e = 1), by its bit pattern."""
    e = e.to(torch.int32)
    normal = e.clamp(1, 254) << 23
    sub = torch.ones_like(e) << (e.clamp(-22, 0) + 22)  # 2^(e - 127) = 2^(e + 22) x 2^-149
    return torch.where(e >= 1, normal, sub).view(torch.float32)


def fold_fp4_to_e4m3(codes: torch.Tensor, sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4_to_e4m3_folded's (vals, base), bit for bit, fast: plain torch ops on the inputs' device, no host
    sync (CUDA-graph capturable, traceable by torch.compile), no float64, no exact mask.

    codes uint8/int8 [..., D / 2], sf int32 [...] -> (vals float8_e4m3fn [..., D], base int32 [...]) with
    vals x 2^(base - 127) == fp4_to_float(codes, sf) wherever the token's nonzero groups span at most 14
    exponents (always for per_token_cast_to_fp4 of real activations); beyond that the small groups' values
    are rounded to nearest e4m3 (see fp4_to_e4m3_folded).

    On an SM90 GPU (eager mode) this is one fused kernel (deep_indexer._C.fp4_fold, fp4_fold.cuh); on the CPU,
    other GPUs and under torch.compile tracing it is fold_fp4_to_e4m3_torch."""
    c, s = _fp4_checked(codes, sf)
    if c.is_cuda and not torch.compiler.is_compiling() and _fold_kernel_ok(c.device):
        lead = c.shape[:-1]
        c2 = c.reshape(-1, c.shape[-1])
        if not c2.is_contiguous() or c2.data_ptr() % 16:
            c2 = c2.clone(memory_format=torch.contiguous_format)  # the kernel's 16-byte loads need an aligned start
        vals, base = _C.fp4_fold(c2, s.reshape(-1).contiguous())
        return vals.reshape(*lead, 2 * c.shape[-1]), base.reshape(lead)
    return fold_fp4_to_e4m3_torch(c, s)


_FOLD_KERNEL_OK: dict = {}


def _fold_kernel_ok(device: torch.device) -> bool:
    """Whether `device` runs the fused fold kernel (SM90); cached per device."""
    ok = _FOLD_KERNEL_OK.get(device.index)
    if ok is None:
        ok = torch.cuda.get_device_capability(device) == (9, 0)
        _FOLD_KERNEL_OK[device.index] = ok
    return ok


def fold_fp4_to_e4m3_torch(codes: torch.Tensor, sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fold_fp4_to_e4m3 in plain torch ops on the inputs' device (any device, traceable, CUDA-graph capturable):
    one any-nonzero reduction per group, one index computation and one table gather (2 output bytes per
    code byte). The fused kernel's reference."""
    c, exps = _fp4_inputs(codes, sf)
    ng = exps.shape[-1]
    lead = c.shape[:-1]
    cg = c.reshape(*lead, ng, FP4_GROUP // 2)  # [..., G, 16] bytes of each group
    nonzero = (cg & 0x77).amax(dim=-1) != 0  # [..., G]
    e_top = torch.where(nonzero, exps, torch.full_like(exps, -1)).amax(dim=-1)
    e_top = torch.where(e_top < 0, exps.amax(dim=-1), e_top)
    base = e_top - E4M3_FOLD_MAX_SHIFT
    shift = (exps - base.unsqueeze(-1)).clamp(E4M3_FOLD_TABLE_MIN_SHIFT, E4M3_FOLD_MAX_SHIFT)
    offset = (shift - E4M3_FOLD_TABLE_MIN_SHIFT) * 256  # int32 [..., G]
    idx = torch.add(cg, offset.unsqueeze(-1))  # uint8 + int32 -> int32 in one pass
    pairs = _fold_table(c.device).index_select(0, idx.reshape(-1))
    vals = pairs.view(torch.uint8).view(FP8).reshape(*lead, 2 * c.shape[-1])
    return vals, base
