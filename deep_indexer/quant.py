"""Quantization helpers: per-token fp8 casts and the fused paged KV cache layout.

Paged cache layout (vLLM / SGLang): uint8 ``[num_blocks, block_kv, 1, D + 4]``. Inside each
physical block the first ``block_kv * D`` bytes are the fp8 keys (token-major), followed by
``block_kv`` little-endian fp32 scales. ``stride(0)`` (bytes between blocks) may exceed
``block_kv * (D + 4)``. A slot is ``physical_block * block_kv + offset``.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_EPS = 1e-10

__all__ = [
    "per_token_cast_to_fp8",
    "pack_paged_kv_cache",
    "write_paged_kv_cache",
    "dequantize_paged_kv_cache",
]


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


def _kv_cache_views(kv_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a fused paged cache; return byte views (keys [nb, block_kv, D], scales [nb, block_kv, 4])."""
    kv = _check("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=4)
    nb, bkv, one, dp4 = kv.shape
    if one != 1 or dp4 <= 4 or bkv < 1:
        raise ValueError(
            f"kv_cache: expected shape [num_blocks, block_kv >= 1, 1, D + 4 > 4], got {list(kv.shape)}")
    d = dp4 - 4
    row = bkv * dp4
    if kv.stride(3) != 1 or (bkv > 1 and kv.stride(1) != dp4):
        raise ValueError(
            f"kv_cache: expected strides [>= {row}, {dp4}, *, 1] (each block's bytes contiguous), "
            f"got {list(kv.stride())}")
    s0 = kv.stride(0) if nb > 1 else row
    if s0 < row:
        raise ValueError(f"kv_cache: expected stride(0) >= block_kv * (D + 4) = {row} bytes, got {s0}")
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


def write_paged_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Quantize k [T, D] per token and store token t in slot slot_mapping[t] of kv_cache, in place.

    Slots < 0 are skipped (padding tokens). Returns kv_cache.
    """
    k_bytes, s_bytes = _kv_cache_views(kv_cache)
    nb, bkv, d = k_bytes.shape
    dev = kv_cache.device
    k = _check("k", k, dtypes=_FLOATS, shape=(None, d), device=dev)
    slots = _check("slot_mapping", slot_mapping, dtypes=_SLOT_DTYPES, shape=(k.shape[0],), device=dev)
    if k.shape[0] == 0:
        return kv_cache
    slots = slots.long()
    smax = int(slots.max())
    if smax >= nb * bkv:
        raise ValueError(f"slot_mapping: expected slots < num_blocks * block_kv = {nb * bkv}, got {smax}")
    keep = slots >= 0
    if not bool(keep.all()):
        k, slots = k[keep], slots[keep]
    x_fp8, scale = per_token_cast_to_fp8(k)
    blk, off = slots // bkv, slots % bkv
    k_bytes[blk, off] = x_fp8.view(torch.uint8)
    s_bytes[blk, off] = scale.contiguous().view(torch.uint8).view(-1, 4)
    return kv_cache


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
    for i, s in enumerate(seqs):
        _check(f"k_list_or_tensor[{i}]", s, dtypes=_FLOATS, shape=(None, d), device=dev)
    lens = [s.shape[0] for s in seqs]
    nblk = [math.ceil(n / block_kv) for n in lens]
    total = sum(nblk)
    if num_blocks is None:
        num_blocks = max(total, 1)
    _check_int("num_blocks", num_blocks, min_value=max(total, 1))
    row = block_kv * (d + 4)
    if block_stride is None:
        block_stride = row
    _check_int("block_stride", block_stride, min_value=row)

    g = generator
    flat = torch.randint(0, 256, (num_blocks * block_stride,), generator=g, dtype=torch.uint8).to(dev)
    kv_cache = flat.as_strided((num_blocks, block_kv, 1, d + 4), (block_stride, d + 4, d + 4, 1))
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
    write_paged_kv_cache(kv_cache, keys, torch.cat(slots).to(dev))
    ctx = torch.tensor(lens, dtype=torch.int32)
    return kv_cache, table.to(dev), ctx.to(dev)
