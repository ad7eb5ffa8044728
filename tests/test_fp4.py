"""CPU tests of the FP4 helpers in deep_indexer.quant and the FP4 paths of deep_indexer.reference.

The format (DeepGEMM's fp4 indexer inputs): per token, groups of 32 values along D, one ue8m0 exponent
per group (ceil_pow2(max(amax, 1e-4) / 6), clamped to [1, 254]), packed little-endian 4 per int32
(padded with 127); e2m1 codes two per byte, element 2i in the low nibble. Everything below is checked
against slow scalar Python written from that description, byte by byte.
"""
from __future__ import annotations

import contextlib
import math
import struct

import pytest
import torch

from conftest import naive_logits
from deep_indexer import quant, reference

FP8 = torch.float8_e4m3fn
NEG_INF = float("-inf")
VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
THRESH = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


pytestmark = pytest.mark.usefixtures("fresh_seed")


# ---------------------------------------------------------------------------------------------
# slow scalar model of the format


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def scalar_exponent(amax: float) -> int:
    """Biased exponent of ceil_pow2(float32(max(amax, 1e-4)) / 6), clamped to [1, 254], in exact arithmetic."""
    a = f32(max(f32(amax), f32(1e-4)))
    r = f32(a / 6.0)
    if math.isinf(r):
        return 254
    m, e = math.frexp(r)  # r = m * 2^e, 0.5 <= m < 1
    p = e - 1 if m == 0.5 else e  # smallest p with 2^p >= r
    return min(max(p + 127, 1), 254)


def scalar_code(x: float, e: int) -> int:
    y = x / 2.0 ** (e - 127)
    mag = sum(abs(y) > t for t in THRESH)
    return mag | (8 if (y < 0 and mag) else 0)


def scalar_cast(row: list[float]) -> tuple[bytes, bytes]:
    """One token -> (code bytes, 4 scale-word bytes)."""
    d = len(row)
    exps, codes = [], []
    for g in range(d // 32):
        grp = [f32(v) for v in row[32 * g: 32 * g + 32]]
        e = scalar_exponent(max(abs(v) for v in grp))
        exps.append(e)
        codes += [scalar_code(v, e) for v in grp]
    cb = bytes(codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(d // 2))
    return cb, bytes(exps + [127] * (4 - len(exps)))


def sf_bytes(sf: torch.Tensor) -> torch.Tensor:
    return sf.contiguous().unsqueeze(-1).view(torch.uint8)


def dequant_scalar(cb: bytes, sb: bytes) -> list[float]:
    out = []
    for i, byte in enumerate(cb):
        for code in (byte & 15, byte >> 4):
            v = VALUES[code & 7] * 2.0 ** (sb[(2 * i) // 32] - 127)
            out.append(-v if code & 8 else v)
    return out


# ---------------------------------------------------------------------------------------------
# layout


def test_nibble_order_and_scale_packing_d64():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 0.5, 6.0, -1.0, 3.0  # group 0: amax 6 -> scale 1 (e = 127)
    x[0, 32], x[0, 33] = -1.0, 12.0  # group 1: amax 12 -> scale 2 (e = 128): -0.5 and 6 in units
    codes, sf = quant.per_token_cast_to_fp4(x)
    assert codes.dtype == torch.uint8 and codes.shape == (1, 32) and sf.dtype == torch.int32 and sf.shape == (1,)
    assert codes[0, 0].item() == 0x71  # element 0 (0.5 -> code 1) low nibble, element 1 (6 -> code 7) high
    assert codes[0, 1].item() == 0x5A  # -1 -> 8 | 2 low, 3 -> 5 high
    assert codes[0, 16].item() == 0x79  # -0.5 -> 8 | 1, 6 -> 7
    assert (codes[0, 2:16] == 0).all() and (codes[0, 17:] == 0).all()
    assert sf_bytes(sf)[0].tolist() == [127, 128, 127, 127]  # little-endian, padded to 4 with 127 (1.0)
    assert sf.item() == 127 | 128 << 8 | 127 << 16 | 127 << 24
    cb, sb = scalar_cast(x[0].tolist())
    assert bytes(codes[0].tolist()) == cb and bytes(sf_bytes(sf)[0].tolist()) == sb


def test_scale_word_d128_and_d32():
    x = torch.zeros(2, 128)
    for g, amax in enumerate([6.0, 0.75, 96.0, 6.0 * 2.0**-20]):
        x[:, 32 * g + 5] = amax
    _, sf = quant.per_token_cast_to_fp4(x)
    assert sf_bytes(sf).tolist() == [[127, 124, 131, 112]] * 2  # 2^-20 * 6 -> clamped amax 1e-4 -> 2^-15
    _, sf32 = quant.per_token_cast_to_fp4(torch.full((3, 32), 3.0))  # amax 3 -> scale 0.5 (126)
    assert sf_bytes(sf32).tolist() == [[126, 127, 127, 127]] * 3


@pytest.mark.parametrize("shape", [(7, 64), (5, 3, 128), (2, 3, 4, 64), (9, 96), (4, 32)])
def test_random_shapes_match_scalar_model(shape):
    x = torch.randn(*shape) * torch.exp(torch.randn(*shape[:-1], 1) * 3)
    x[..., :5] *= 40  # some outlier channels
    codes, sf = quant.per_token_cast_to_fp4(x)
    d = shape[-1]
    assert codes.shape == (*shape[:-1], d // 2) and sf.shape == shape[:-1]
    flat_x, flat_c, flat_s = x.reshape(-1, d), codes.reshape(-1, d // 2), sf_bytes(sf).reshape(-1, 4)
    for r in range(flat_x.shape[0]):
        cb, sb = scalar_cast(flat_x[r].tolist())
        assert bytes(flat_c[r].tolist()) == cb, r
        assert bytes(flat_s[r].tolist()) == sb, r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_input_dtypes(dtype):
    x = torch.randn(6, 128).to(dtype)
    codes, sf = quant.per_token_cast_to_fp4(x)
    c2, s2 = quant.per_token_cast_to_fp4(x.float())
    assert torch.equal(codes, c2) and torch.equal(sf, s2)


# ---------------------------------------------------------------------------------------------
# rounding


def f32_next(v: float, toward: float) -> float:
    return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(toward, dtype=torch.float32)).item()


@pytest.mark.parametrize("k", [-14, -3, 0, 5, 60])
def test_every_threshold_ties_down(k):
    """Group pinned to scale 2^k by a value 6 * 2^k; each threshold exactly, one float32 ulp above and below."""
    vals = []
    for t in THRESH:
        vals += [t, f32_next(t, math.inf), f32_next(t, -math.inf)]
    vals += [0.0, 6.0, 5.999, 0.1]
    vals += [-v for v in vals]
    vals += [6.0] * (64 - len(vals))
    x = torch.tensor(vals, dtype=torch.float64).mul(2.0**k).float().view(1, 64)
    assert torch.equal(x.double() / 2.0**k, torch.tensor(vals, dtype=torch.float64).float().double().view(1, 64))
    codes, sf = quant.per_token_cast_to_fp4(x)
    assert sf_bytes(sf)[0, :2].tolist() == [127 + k, 127 + k]
    got = quant._unpack_codes(codes)[0].tolist()
    for i, v in enumerate(x[0].double().div(2.0**k).tolist()):
        mag = sum(abs(v) > t for t in THRESH)
        assert got[i] == (mag | (8 if v < 0 and mag else 0)), (i, v, got[i])
    for i, t in enumerate(THRESH):  # explicit: a tie stays at code i, one ulp above goes to i + 1
        assert got[3 * i] == i and got[3 * i + 1] == i + 1 and got[3 * i + 2] == i


def test_signs_and_zeros():
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([-0.0, 0.0, -0.2, -6.0, -0.26, 6.0])
    codes, _ = quant.per_token_cast_to_fp4(x)
    c = quant._unpack_codes(codes)[0].tolist()
    assert c[:6] == [0, 0, 0, 8 | 7, 8 | 1, 7]  # -0.0 and negatives rounding to 0 get no sign bit
    deq = quant.fp4_to_float(codes, quant.per_token_cast_to_fp4(x)[1])
    assert not torch.signbit(deq[0, :3]).any()  # never a negative zero


def test_extreme_exponents():
    # all-zero and tiny groups: amax clamped at 1e-4 -> e = 112 (2^-15 >= 1e-4 / 6 > 2^-16)
    x = torch.zeros(3, 128)
    x[1, 32:64] = 1e-6
    x[1, 64] = 5e-5  # below the clamp too: 5e-5 / 2^-15 = 1.64 -> code 3 (1.5)
    x[2] = torch.randn(128) * 1e-30
    codes, sf = quant.per_token_cast_to_fp4(x)
    assert (sf_bytes(sf)[:, :4] == 112).all()
    assert (codes[0] == 0).all() and (codes[2] == 0).all()
    assert quant._unpack_codes(codes)[1, 64].item() == 3 and (quant._unpack_codes(codes)[1, :64] == 0).all()
    # huge: amax 3e38 -> 5e37 -> 2^126 (e = 253); inf -> clamp 254; the scale word still packs
    y = torch.zeros(2, 64)
    y[0, 0], y[0, 1] = 3e38, -1e38
    y[1, 0], y[1, 1], y[1, 40] = float("inf"), 1e38, -float("inf")
    codes, sf = quant.per_token_cast_to_fp4(y)
    b = sf_bytes(sf).tolist()
    assert b[0] == [253, 112, 127, 127] and b[1] == [254, 254, 127, 127]
    c = quant._unpack_codes(codes)
    assert c[0, 0].item() == 6 and c[0, 1].item() == 8 | 2  # 3e38 / 2^126 = 3.53 -> 4; 1e38 / 2^126 = 1.18 -> 1
    assert c[1, 0].item() == 7 and c[1, 1].item() == 1 and c[1, 40].item() == 15  # 1e38 / 2^127 = 0.59 -> 0.5
    for r in range(2):
        cb, sb = scalar_cast(y[r].tolist())
        assert bytes(codes[r].tolist()) == cb and bytes(sf_bytes(sf)[r].tolist()) == sb
    # float64 dequant is exact even where float32 overflows (4 * 2^126 = 2^128)
    deq64 = quant.fp4_to_float(codes, sf, torch.float64)
    assert deq64[0, 0].item() == 2.0**128 and torch.isinf(quant.fp4_to_float(codes, sf)[0, 0])


def test_exponent_rounds_up_exactly():
    """amax / 6 an exact power of two keeps its exponent; one ulp above rounds up."""
    for p in (-14, -1, 0, 3, 100):
        a = 6.0 * 2.0**p
        for amax, e in ((a, 127 + p), (f32_next(f32(a), math.inf), 128 + p), (f32(a) * 0.75, 127 + p)):
            x = torch.zeros(1, 32)
            x[0, 0] = amax
            assert sf_bytes(quant.per_token_cast_to_fp4(x)[1])[0, 0].item() == e, (p, amax)
            assert scalar_exponent(float(x[0, 0])) == e


# ---------------------------------------------------------------------------------------------
# dequantization and round trips


def test_dequant_every_byte_and_exponent():
    codes = torch.arange(256, dtype=torch.uint8).view(4, 64)
    exps = torch.randint(1, 255, (4, 4), dtype=torch.uint8)
    exps[0] = torch.tensor([1, 254, 127, 112], dtype=torch.uint8)
    sf = exps.contiguous().view(torch.int32).squeeze(-1)
    got = quant.fp4_to_float(codes, sf, torch.float64)
    for r in range(4):
        assert got[r].tolist() == dequant_scalar(bytes(codes[r].tolist()), bytes(exps[r].tolist()))
    assert torch.equal(quant.fp4_to_float(codes.view(torch.int8), sf, torch.float64), got)  # int8 codes accepted
    f = quant.fp4_to_float(codes, sf)  # float32: exact where representable
    fin = got.abs() < 2.0**128
    assert f.dtype == torch.float32 and torch.equal(f.double()[fin], got[fin])


@pytest.mark.parametrize("d", [32, 64, 128])
def test_round_trip_on_the_grid(d):
    x = torch.randn(50, 3, d) * torch.exp(torch.randn(50, 3, 1) * 4)
    codes, sf = quant.per_token_cast_to_fp4(x)
    deq = quant.fp4_to_float(codes, sf)
    # dequantized values are code value x 2^(e - 127), exactly
    c = quant._unpack_codes(codes)
    e = sf_bytes(sf)[..., : d // 32].long().repeat_interleave(32, dim=-1)
    v = torch.tensor(VALUES, dtype=torch.float64)[(c & 7).long()] * torch.pow(2.0, (e - 127).double())
    assert torch.equal(deq.double(), torch.where((c & 8) != 0, -v, v))
    # the grid is a fixed point: re-quantizing dequantized values gives the same values ...
    c2, s2 = quant.per_token_cast_to_fp4(deq)
    assert torch.equal(quant.fp4_to_float(c2, s2), deq)
    # ... and the same bytes for every group whose largest code is 4 or 6 (a largest 3 re-codes at half scale)
    top = (c & 7).unflatten(-1, (d // 32, 32)).amax(-1)  # [..., G]
    same_groups = (top >= 6)
    eq_e = sf_bytes(s2)[..., : d // 32] == sf_bytes(sf)[..., : d // 32]
    eq_c = (quant._unpack_codes(c2) == c).unflatten(-1, (d // 32, 32)).all(-1)
    assert (eq_e & eq_c)[same_groups].all()


def test_dequant_error_bound():
    x = torch.randn(64, 128) * 5
    codes, sf = quant.per_token_cast_to_fp4(x)
    err = (quant.fp4_to_float(codes, sf) - x).abs().unflatten(-1, (4, 32))
    scale = torch.pow(2.0, sf_bytes(sf)[:, :4].float() - 127).unsqueeze(-1)
    assert (err <= scale + 1e-6).all()  # half of the widest step (6 - 4 = 2 units)


# ---------------------------------------------------------------------------------------------
# paged cache


@pytest.mark.parametrize("d,block_kv", [(128, 4), (64, 16), (128, 64)])
def test_paged_cache_layout_bytes(d, block_kv):
    lens = [3 * block_kv + 1, block_kv, 0, 2]
    keys = [torch.randn(n, d) * 3 for n in lens]
    pad = 40
    row = block_kv * (d // 2 + 4)
    cache, table, ctx = quant.pack_paged_kv_cache_fp4(keys, block_kv, block_stride=row + pad, num_blocks=9)
    assert cache.dtype == torch.uint8 and cache.shape == (9, block_kv, 1, d // 2 + 4) and cache.stride(0) == row + pad
    if d == 128:
        assert cache.shape[-1] == 68  # 64 B of codes + 4 B of scales per key
    assert ctx.tolist() == lens
    raw = cache.as_strided((9, row + pad), (row + pad, 1))
    for b, k in enumerate(keys):
        codes, sf = quant.per_token_cast_to_fp4(k)
        for t in range(k.shape[0]):
            blk, off = int(table[b, t // block_kv]), t % block_kv
            base = raw[blk]
            assert torch.equal(base[off * d // 2: (off + 1) * d // 2], codes[t])  # codes: token-major
            w0 = block_kv * d // 2 + 4 * off  # then block_kv int32 words
            assert torch.equal(base[w0: w0 + 4], sf_bytes(sf[t]))
            assert int.from_bytes(bytes(base[w0: w0 + 4].tolist()), "little", signed=True) == int(sf[t])
    deq = quant.dequantize_paged_kv_cache_fp4(cache)
    for b, k in enumerate(keys):
        slots = table[b, torch.arange(k.shape[0]) // block_kv].long() * block_kv + torch.arange(k.shape[0]) % block_kv
        assert torch.equal(deq.view(-1, d)[slots], quant.fp4_to_float(*quant.per_token_cast_to_fp4(k)))


def test_pack_is_reproducible_and_validates():
    keys = [torch.randn(20, 64), torch.randn(5, 64)]
    a = quant.pack_paged_kv_cache_fp4(keys, 8, num_blocks=10, generator=torch.Generator().manual_seed(3))
    b = quant.pack_paged_kv_cache_fp4(keys, 8, num_blocks=10, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    with pytest.raises(ValueError, match=r"^k_list_or_tensor\[0\].*32, 64, 96, 128"):
        quant.pack_paged_kv_cache_fp4([torch.randn(5, 48)], 8)
    with pytest.raises(ValueError, match=r"^block_stride"):
        quant.pack_paged_kv_cache_fp4([torch.randn(5, 64)], 8, block_stride=8 * 36 - 1)


def _slots_for(table, lens, block_kv):
    out = []
    for b, n in enumerate(lens):
        t = torch.arange(n)
        out.append(table[b, t // block_kv].long() * block_kv + t % block_kv)
    return torch.cat(out)


@pytest.mark.parametrize("fp4", [True, False])
def test_writer_matches_builder(fp4):
    pack = quant.pack_paged_kv_cache_fp4 if fp4 else quant.pack_paged_kv_cache
    views = (lambda c: quant._kv_cache_views(c, fp4=True)) if fp4 else quant._kv_cache_views
    write = quant.write_paged_kv_cache_fp4 if fp4 else quant.write_paged_kv_cache
    lens, d, block_kv = [45, 3, 0, 64], 128, 16
    keys = [torch.randn(n, d) for n in lens]
    cache, table, ctx = pack(keys, block_kv, num_blocks=16)
    slots = _slots_for(table, lens, block_kv)
    occupied = torch.zeros(16, block_kv, dtype=torch.bool)
    occupied.view(-1)[slots] = True
    k_all = torch.cat(keys + [torch.randn(3, d)])
    s_all = torch.cat([slots, torch.tensor([-1, -5, 16 * block_kv])])  # padding and one out-of-range slot
    perm = torch.randperm(k_all.shape[0])
    # slot writer (graph-capturable form: out-of-range slots skipped, no error)
    fresh = torch.full_like(cache, 7)
    assert write(fresh, k_all[perm], s_all[perm].to(torch.int32), check_slots=False) is fresh
    (fk, fs), (pk, ps) = views(fresh), views(cache)
    assert torch.equal(fk[occupied], pk[occupied]) and torch.equal(fs[occupied], ps[occupied])
    assert (fk[~occupied] == 7).all() and (fs[~occupied] == 7).all()
    with pytest.raises(ValueError, match=r"^slot_mapping"):
        write(fresh, k_all, s_all)  # check_slots=True (default) rejects the out-of-range slot
    # step writer: decode-style steps, one token per sequence, padding rows with position -1
    step = torch.full_like(cache, 7)
    b_sz = len(lens)
    for t in range(max(lens)):
        pos = torch.tensor([t if t < n else -1 for n in lens], dtype=torch.int32)
        k = torch.stack([keys[b][t] if t < lens[b] else torch.randn(d) for b in range(b_sz)])
        quant.write_paged_kv_step(step, k, table, pos, fmt="fp4" if fp4 else "fp8")
    sk, ss = views(step)
    assert torch.equal(sk[occupied], pk[occupied]) and torch.equal(ss[occupied], ps[occupied])
    assert (sk[~occupied] == 7).all() and (ss[~occupied] == 7).all()
    # prefill-style step: all tokens at once with seq_ids
    pre = torch.full_like(cache, 7)
    sid = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    quant.write_paged_kv_step(pre, torch.cat(keys), table, pos, seq_ids=sid, fmt="fp4" if fp4 else "fp8")
    assert torch.equal(views(pre)[0][occupied], pk[occupied]) and (views(pre)[0][~occupied] == 7).all()


@contextlib.contextmanager
def no_host_sync():
    """Make every Tensor -> Python conversion raise (a CPU stand-in for a CUDA host sync)."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(*a, **k):
        raise AssertionError("host sync")
    try:
        for n in names:
            setattr(torch.Tensor, n, boom)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_step_writer_never_syncs(fmt):
    d, block_kv = 64, 8
    width = d // 2 + 4 if fmt == "fp4" else d + 4
    cache = torch.zeros(6, block_kv, 1, width, dtype=torch.uint8)
    table = torch.tensor([[2, 4], [5, -1], [0, 1]], dtype=torch.int32)
    pos = torch.tensor([9, 7, -1], dtype=torch.int64)
    k = torch.randn(3, d)
    with no_host_sync():
        quant.write_paged_kv_step(cache, k, table, pos, fmt=fmt)
        none = torch.full((3,), -1)
        quant.write_paged_kv_step(cache.clone(), k, table, none, fmt=fmt)  # nothing valid: slot 0 rewritten as is
    ref = torch.zeros_like(cache)
    write = quant.write_paged_kv_cache_fp4 if fmt == "fp4" else quant.write_paged_kv_cache
    write(ref, k[:2], torch.tensor([4 * block_kv + 1, 5 * block_kv + 7]))
    assert torch.equal(cache, ref)
    c2 = torch.randint(0, 256, cache.shape, dtype=torch.uint8)
    c3 = c2.clone()
    quant.write_paged_kv_step(c3, k, table, torch.full((3,), -1), fmt=fmt)
    assert torch.equal(c2, c3)


def test_paged_kv_slots():
    table = torch.tensor([[3, 1, -1], [7, 100, 2]], dtype=torch.int32)
    pos = torch.tensor([0, 5, 9, -1, 4, 8, 100])
    sid = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    got = quant.paged_kv_slots(table, pos, 4, seq_ids=sid, num_blocks=8).tolist()
    assert got == [12, 5, -1, -1, -1, 8, -1]  # table -1 -> -1; 100 >= num_blocks -> -1; past the table -> -1
    assert quant.paged_kv_slots(table, pos, 4, seq_ids=sid)[4].item() == 400  # no num_blocks: not checked
    assert quant.paged_kv_slots(table, torch.tensor([6, 3], dtype=torch.int32), 4).tolist() == [6, 31]
    with pytest.raises(ValueError, match=r"^positions"):
        quant.paged_kv_slots(table, pos, 4)
    with pytest.raises(TypeError, match=r"^block_table"):
        quant.paged_kv_slots(table.long(), pos, 4, seq_ids=sid)
    with pytest.raises(ValueError, match=r"^fmt"):
        quant.write_paged_kv_step(torch.zeros(2, 4, 1, 36, dtype=torch.uint8), torch.randn(1, 64), table[:1],
                                  torch.zeros(1), fmt="nvfp4")


def test_validation_messages():
    with pytest.raises(ValueError, match=r"^x: expected head_dim D in \(32, 64, 96, 128\).*got D = 48"):
        quant.per_token_cast_to_fp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match=r"^x.*D = 256"):
        quant.per_token_cast_to_fp4(torch.randn(2, 256))
    with pytest.raises(TypeError, match=r"^x"):
        quant.per_token_cast_to_fp4(torch.ones(2, 64, dtype=torch.int32))
    codes, sf = quant.per_token_cast_to_fp4(torch.randn(4, 64))
    with pytest.raises(TypeError, match=r"^codes: expected dtype torch.uint8 or torch.int8, got torch.float32"):
        quant.fp4_to_float(codes.float(), sf)
    with pytest.raises(ValueError, match=r"^sf: expected shape \[4\], got \[3\]"):
        quant.fp4_to_float(codes, sf[:3])
    with pytest.raises(TypeError, match=r"^sf"):
        quant.fp4_to_float(codes, sf.float())
    cache = quant.pack_paged_kv_cache_fp4([torch.randn(5, 64)], 8)[0]
    with pytest.raises(ValueError, match=r"^k"):
        quant.write_paged_kv_cache_fp4(cache, torch.randn(2, 128), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^kv_cache.*D / 2 \+ 4"):
        quant.dequantize_paged_kv_cache_fp4(torch.zeros(2, 4, 1, 3, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# reference logits on FP4 inputs


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("accum", [torch.float64, torch.float32])
def test_reference_prefill_fp4(d, accum):
    s_len, h, skv = 13, 8, 70
    q = quant.per_token_cast_to_fp4(torch.randn(s_len, h, d))
    k = quant.per_token_cast_to_fp4(torch.randn(skv, d) * 3)
    w = torch.randn(s_len, h)
    ks = torch.randint(-3, 40, (s_len,), dtype=torch.int32)
    ke = (ks + torch.randint(-2, 50, (s_len,), dtype=torch.int32)).to(torch.int32)
    out = reference.mqa_logits((q[0].view(torch.int8), q[1]), k, w, ks, ke, accum_dtype=accum, chunk=4)
    ranges = [(max(int(a), 0), min(max(int(b), 0), skv)) for a, b in zip(ks, ke)]
    exp = naive_logits(quant.fp4_to_float(*q, torch.float64), quant.fp4_to_float(*k, torch.float64), w, ranges, skv)
    assert out.shape == (s_len, skv) and out.dtype == torch.float32
    assert torch.equal(torch.isinf(out), torch.isinf(exp))
    fin = torch.isfinite(exp)
    tol = dict(rtol=1e-6, atol=1e-5) if accum == torch.float64 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(out[fin].double(), exp[fin], **tol)
    comp = reference.mqa_logits(q, k, w, ks, ke, max_seqlen_k=16, accum_dtype=accum)
    for r, (a, b) in enumerate(ranges):
        n = min(max(b - a, 0), 16)
        torch.testing.assert_close(comp[r, :n], out[r, a:a + n], rtol=1e-6, atol=1e-5)
        assert torch.isinf(comp[r, n:]).all()


@pytest.mark.parametrize("ctx2d", [False, True])
def test_reference_paged_fp4(ctx2d):
    b_sz, next_n, h, d, block_kv = 3, 2, 8, 128, 16
    lens = [37, 2, 64]
    keys = [torch.randn(n, d) * 2 for n in lens]
    cache, table, ctx = quant.pack_paged_kv_cache_fp4(keys, block_kv, num_blocks=12)
    q = quant.per_token_cast_to_fp4(torch.randn(b_sz, next_n, h, d))
    w = torch.randn(b_sz * next_n, h)
    mcl = 70
    if ctx2d:
        context = torch.stack([ctx - 1, ctx], dim=1).clamp_min(0).to(torch.int32)
    else:
        context = ctx
    out = reference.paged_mqa_logits(q, cache, w, context, table, mcl, accum_dtype=torch.float64)
    qd = quant.fp4_to_float(*q, torch.float64)
    for b in range(b_sz):
        kd = quant.fp4_to_float(*quant.per_token_cast_to_fp4(keys[b]), torch.float64)
        for i in range(next_n):
            end = int(context[b, i]) if ctx2d else int(ctx[b]) - next_n + 1 + i
            exp = naive_logits(qd[b, i:i + 1], kd, w[b * next_n + i: b * next_n + i + 1], [(0, max(end, 0))], mcl)
            r = b * next_n + i
            fin = torch.isfinite(exp[0])
            assert torch.equal(torch.isinf(out[r]), ~fin)
            torch.testing.assert_close(out[r][fin].double(), exp[0][fin], rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match=r"^kv_cache: expected shape \[\*, \*, 1, 132\] \(the FP8 cache, D \+ 4\) or "
                                         r"\[\*, \*, 1, 68\] \(the FP4 cache, D / 2 \+ 4\) for D = 128"):
        reference.paged_mqa_logits(q, torch.zeros(12, block_kv, 1, 100, dtype=torch.uint8), w, ctx, table, mcl)
    with pytest.raises(ValueError, match=r"^q\[1\] \(sf\)"):
        reference.paged_mqa_logits((q[0], q[1][:, :1]), cache, w, ctx, table, mcl)


def test_reference_prefill_fp4_validation():
    q = quant.per_token_cast_to_fp4(torch.randn(4, 2, 64))
    k = quant.per_token_cast_to_fp4(torch.randn(9, 128))
    ks = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^kv\[0\] \(codes\): expected shape \[\*, 32\]"):
        reference.mqa_logits(q, k, torch.randn(4, 2), ks, ks + 9)
    with pytest.raises(TypeError, match=r"^kv: expected a tuple"):
        reference.mqa_logits(q, k[0], torch.randn(4, 2), ks, ks + 9)


# ---------------------------------------------------------------------------------------------
# folding FP4 into e4m3 (the SM90 kernel plan)


def test_fold_shift_range_is_exact():
    """Every e2m1 value x 2^s is an exact e4m3 value iff -8 <= s <= 6."""
    v = torch.tensor(VALUES[1:], dtype=torch.float64)
    for s in range(-12, 10):
        want = v * 2.0**s
        ok = torch.equal(want.clamp(max=448).to(FP8).double(), want)
        assert ok == (-8 <= s <= 6), s


def _fold_check(codes, sf):
    vals, base, exact = quant.fp4_to_e4m3_folded(codes, sf)
    deq = quant.fp4_to_float(codes, sf, torch.float64)
    rebuilt = vals.double() * torch.pow(2.0, (base - 127).double()).unsqueeze(-1)
    assert torch.equal((rebuilt == deq).all(-1), exact)  # the mask is the truth
    return vals, base, exact


def test_fold_exact_on_random_inputs():
    x = torch.randn(40, 16, 128) * torch.exp(torch.randn(40, 16, 1) * 5)
    x[..., :3] *= 30  # outlier channels widen a token's group span a little
    vals, base, exact = _fold_check(*quant.per_token_cast_to_fp4(x))
    assert vals.dtype == FP8 and base.dtype == torch.int32 and exact.all()


def test_fold_span_limits():
    def token(exps, codes_per_group):
        c = torch.zeros(1, 128, dtype=torch.uint8)
        for g, code in enumerate(codes_per_group):
            c[0, 32 * g: 32 * g + 32] = code
        packed = c[:, 0::2] | (c[:, 1::2] << 4)
        sf = torch.tensor([exps], dtype=torch.uint8).view(torch.int32).squeeze(-1)
        return packed, sf

    # span 14 with every code present in the lowest group: exact
    c = torch.tensor([1, 3, 9, 15, 7, 2, 4, 5] * 16, dtype=torch.uint8).view(1, 128)
    packed = c[:, 0::2] | (c[:, 1::2] << 4)
    for span, want in ((14, True), (15, False)):
        sf = torch.tensor([[140, 140 - span, 135, 140]], dtype=torch.uint8).view(torch.int32).squeeze(-1)
        _, base, exact = _fold_check(packed, sf)
        assert exact.item() == want and base.item() == 134
    # span 15 where the low group's codes still fit (1.0 x 2^-9): exact; 0.5 x 2^-9: not
    _, _, ex = _fold_check(*token([140, 125, 140, 140], [7, 2, 0, 0]))
    assert ex.item()
    _, _, ex = _fold_check(*token([140, 125, 140, 140], [7, 1, 0, 0]))
    assert not ex.item()
    # all-zero groups (exponent 112 from the clamp) never limit the span; neither do the padding bytes
    _, base, ex = _fold_check(*token([250, 112, 112, 112], [7, 0, 0, 0]))
    assert ex.item() and base.item() == 244
    q = quant.per_token_cast_to_fp4(torch.randn(5, 64) * 1e20)
    assert _fold_check(*q)[2].all()


@pytest.mark.parametrize("accum", [torch.float64, torch.float32])
def test_fold_gives_the_fp4_logits_through_the_fp8_path(accum):
    """The SM90 plan end to end: folded e4m3 q/k, k's base exponent as the fp32 k_scale and q's per-head base
    folded into the weights give the FP4 logits bit for bit through the FP8 reference."""
    s_len, h, d, skv = 9, 16, 128, 300
    q = torch.randn(s_len, h, d) * torch.exp(torch.randn(s_len, h, 1) * 2)
    k = torch.randn(skv, d) * torch.exp(torch.randn(skv, 1) * 2)
    q[..., 7] *= 25
    k[:, 7] *= 25
    w = torch.randn(s_len, h)
    q4, k4 = quant.per_token_cast_to_fp4(q), quant.per_token_cast_to_fp4(k)
    qv, qb, qe = quant.fp4_to_e4m3_folded(*q4)
    kv, kb, ke = quant.fp4_to_e4m3_folded(*k4)
    assert qe.all() and ke.all()
    ks = torch.zeros(s_len, dtype=torch.int32)
    kend = torch.full((s_len,), skv, dtype=torch.int32)
    want = reference.mqa_logits(q4, k4, w, ks, kend, accum_dtype=accum)
    k_scale = torch.pow(2.0, (kb - 127).double()).float()
    w_folded = (w.double() * torch.pow(2.0, (qb - 127).double())).float()
    got = reference.mqa_logits(qv, (kv, k_scale), w_folded, ks, kend, accum_dtype=accum)
    assert torch.equal(got, want)
