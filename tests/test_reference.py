"""CPU tests of deep_indexer.reference and deep_indexer.quant against naive fp64 formulas."""
from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import calc_diff
from conftest import naive_logits
from deep_indexer import quant, reference

FP8 = torch.float8_e4m3fn
NEG_INF = float("-inf")


pytestmark = pytest.mark.usefixtures("fresh_seed")


# ---------------------------------------------------------------------------------------------
# naive fp64 formulas


def naive_rows(qd: torch.Tensor, kd: torch.Tensor, w: torch.Tensor, ranges, ncols: int) -> torch.Tensor:
    """qd [R, H, D], kd [N, D] dequantized fp64; ranges[r] = (start, end) already clipped."""
    out = torch.full((qd.shape[0], ncols), NEG_INF, dtype=torch.float64)
    for r, (s, e) in enumerate(ranges):
        for j in range(s, e):
            dots = (qd[r] * kd[j]).sum(-1)  # [H]
            out[r, j] = (w[r].double() * dots.clamp_min(0)).sum()
    return out


def rand_fp8(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(FP8)


def rand_k(skv: int, d: int):
    return quant.per_token_cast_to_fp8(torch.randn(skv, d) * 3)


def check_close(actual: torch.Tensor, expected: torch.Tensor, accum=torch.float32):
    tol = dict(rtol=1e-4, atol=1e-3) if accum == torch.float32 else dict(rtol=2e-7, atol=1e-9)  # fp32 output rounding only
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    torch.testing.assert_close(actual.double(), expected, **tol)


# ---------------------------------------------------------------------------------------------
# mqa_logits (prefill)


def random_ranges(s: int, skv: int):
    ks = torch.randint(-5, skv + 3, (s,), dtype=torch.int32)
    ke = ks + torch.randint(-4, skv + 6, (s,), dtype=torch.int32)  # ks > ke and ke > skv appear
    ks[0], ke[0] = -3, skv + 10  # negative ks, ke past the end
    return ks, ke


def prefill_expected(q, k, k_scale, w, ks, ke):
    skv = k.shape[0]
    kd = k.double() * k_scale.double()[:, None]
    ranges = [(max(a, 0), max(min(b, skv), 0)) for a, b in zip(ks.tolist(), ke.tolist())]
    return naive_logits(q.double(), kd, w, ranges, skv)


@pytest.mark.parametrize("heads,dim", [(16, 32), (32, 64), (64, 128), (128, 64)])
@pytest.mark.parametrize("accum", [torch.float32, torch.float64])
def test_mqa_logits_matches_naive(heads, dim, accum):
    s, skv = random.randint(5, 17), random.randint(40, 90)
    q, (k, k_scale), w = rand_fp8(s, heads, dim), rand_k(skv, dim), torch.randn(s, heads)
    ks, ke = random_ranges(s, skv)
    out = reference.mqa_logits(q, (k, k_scale), w, ks, ke, accum_dtype=accum)
    assert out.shape == (s, skv) and out.dtype == torch.float32
    check_close(out, prefill_expected(q, k, k_scale, w, ks, ke), accum)


def test_mqa_logits_loop_formula_small():
    s, h, d, skv = 4, 16, 32, 9
    q, (k, k_scale), w = rand_fp8(s, h, d), rand_k(skv, d), torch.randn(s, h)
    ks = torch.tensor([0, 2, -1, 5], dtype=torch.int32)
    ke = torch.tensor([9, 7, 3, 5], dtype=torch.int32)
    kd = k.double() * k_scale.double()[:, None]
    expected = naive_rows(q.double(), kd, w, [(0, 9), (2, 7), (0, 3), (5, 5)], skv)
    check_close(reference.mqa_logits(q, (k, k_scale), w, ks, ke, clean_logits=False), expected)


def test_mqa_logits_chunking(monkeypatch):
    s, h, d, skv = 13, 16, 32, 70
    q, (k, k_scale), w = rand_fp8(s, h, d), rand_k(skv, d), torch.randn(s, h)
    ks, ke = random_ranges(s, skv)
    expected = prefill_expected(q, k, k_scale, w, ks, ke)
    for c in (1, 3, 100):
        check_close(reference.mqa_logits(q, (k, k_scale), w, ks, ke, chunk=c), expected)
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 3000)  # forces column chunks too
    check_close(reference.mqa_logits(q, (k, k_scale), w, ks, ke), expected)


def test_mqa_logits_causal_bf16():
    s, h, d, skv = 16, 32, 64, 48
    q, (k, k_scale), w = rand_fp8(s, h, d), rand_k(skv, d), torch.randn(s, h)
    ks = torch.zeros(s, dtype=torch.int32)
    ke = torch.arange(skv - s + 1, skv + 1, dtype=torch.int32)
    out = reference.mqa_logits(q, (k, k_scale), w, ks, ke, logits_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    expected = prefill_expected(q, k, k_scale, w, ks, ke)
    assert torch.equal(torch.isneginf(out), torch.isneginf(expected))
    torch.testing.assert_close(out, expected.to(torch.bfloat16))


@pytest.mark.parametrize("max_seqlen_k", [1, 9, 40, 100])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_mqa_logits_compressed(max_seqlen_k, wdtype):
    # Column c of row i holds key max(ks[i], 0) + c for c < min(min(ke[i], SKV) - max(ks[i], 0), M);
    # -inf after (rows longer than M keep their first M keys); bf16 weights enter exactly.
    s, h, d, skv = 11, 16, 32, 70
    q, (k, k_scale), w = rand_fp8(s, h, d), rand_k(skv, d), torch.randn(s, h).to(wdtype)
    ks, ke = random_ranges(s, skv)
    ks[1], ke[1] = -20, 5  # negative start: counts from key 0
    expected = prefill_expected(q, k, k_scale, w.float(), ks, ke)
    for chunk in (None, 2):
        out = reference.mqa_logits(q, (k, k_scale), w, ks, ke, max_seqlen_k=max_seqlen_k, chunk=chunk,
                                   accum_dtype=torch.float64)
        assert out.shape == (s, max_seqlen_k) and out.dtype == torch.float32
        for i in range(s):
            lo, hi = max(int(ks[i]), 0), min(int(ke[i]), skv)
            n = max(0, min(hi - lo, max_seqlen_k))
            check_close(out[i, :n], expected[i, lo:lo + n], torch.float64)
            assert torch.isneginf(out[i, n:]).all()


def test_mqa_logits_compressed_rejects_bad_max_seqlen_k():
    q, (k, k_scale), w = rand_fp8(2, 16, 32), rand_k(8, 32), torch.randn(2, 16)
    z = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_k: expected an int >= 0, got -1"):
        reference.mqa_logits(q, (k, k_scale), w, z, z + 8, max_seqlen_k=-1)
    with pytest.raises(TypeError, match=r"max_seqlen_k: expected an int"):
        reference.mqa_logits(q, (k, k_scale), w, z, z + 8, max_seqlen_k=2.0)


def test_mqa_logits_empty_shapes():
    h, d = 16, 32
    k, k_scale = rand_k(10, d)
    e = torch.empty(0, dtype=torch.int32)
    out = reference.mqa_logits(rand_fp8(0, h, d), (k, k_scale), torch.randn(0, h), e, e)
    assert out.shape == (0, 10)
    k0, s0 = rand_k(0, d)
    z = torch.zeros(3, dtype=torch.int32)
    out = reference.mqa_logits(rand_fp8(3, h, d), (k0, s0), torch.randn(3, h), z, z + 4)
    assert out.shape == (3, 0)
    # every row empty -> all -inf
    out = reference.mqa_logits(rand_fp8(3, h, d), (k, k_scale), torch.randn(3, h),
                               torch.tensor([5, 9, 20], dtype=torch.int32), torch.tensor([5, 2, 30], dtype=torch.int32))
    assert torch.isneginf(out).all()


# ---------------------------------------------------------------------------------------------
# paged_mqa_logits (decode)


def make_paged(lens, d, block_kv, **kw):
    keys = [torch.randn(n, d) * 2 for n in lens]
    kv_cache, bt, ctx = quant.pack_paged_kv_cache(keys, block_kv, **kw)
    deq = [quant.per_token_cast_to_fp8(k) for k in keys]
    kd = [(f.double() * s.double()[:, None]) for f, s in deq]
    return kv_cache, bt, ctx, kd


def paged_expected(q, w, kd, ends, mcl):
    """ends[b][i]: exclusive end of row (b, i) before clipping."""
    b_sz, next_n = q.shape[:2]
    out = []
    for b in range(b_sz):
        ranges = [(0, max(0, min(e, mcl))) for e in ends[b]]
        need = max(r[1] for r in ranges)
        out.append(naive_logits(q[b].double(), kd[b][:need], w[b * next_n:(b + 1) * next_n], ranges, mcl))
    return torch.cat(out)


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("heads,dim,block_kv", [(16, 32, 16), (32, 64, 64), (64, 128, 64), (128, 32, 16)])
def test_paged_matches_naive(next_n, heads, dim, block_kv):
    lens = [random.randint(0, 150) for _ in range(3)] + [0, 1]
    kv_cache, bt, ctx, kd = make_paged(lens, dim, block_kv, num_blocks=40)
    b_sz = len(lens)
    q, w = rand_fp8(b_sz, next_n, heads, dim), torch.randn(b_sz * next_n, heads)
    mcl = max(lens) + 5
    out = reference.paged_mqa_logits(q, kv_cache, w, ctx, bt, mcl)
    assert out.shape == (b_sz * next_n, mcl)
    ends = [[n - next_n + i + 1 for i in range(next_n)] for n in lens]
    check_close(out, paged_expected(q, w, kd, ends, mcl))
    # [B, next_n] context lens with independent per-row ends
    ctx2 = torch.tensor([[random.randint(0, n) for _ in range(next_n)] for n in lens], dtype=torch.int32)
    out2 = reference.paged_mqa_logits(q, kv_cache, w, ctx2, bt, mcl, accum_dtype=torch.float64)
    check_close(out2, paged_expected(q, w, kd, ctx2.tolist(), mcl), torch.float64)


@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_paged_context_lens_1d_2d_equivalent(next_n):
    lens = [37, 64, 5, 130]
    kv_cache, bt, ctx, _ = make_paged(lens, 64, 64)
    q, w = rand_fp8(4, next_n, 32, 64), torch.randn(4 * next_n, 32)
    ctx2 = ctx[:, None] - next_n + 1 + torch.arange(next_n, dtype=torch.int32)
    a = reference.paged_mqa_logits(q, kv_cache, w, ctx, bt, 140)
    b = reference.paged_mqa_logits(q, kv_cache, w, ctx2, bt, 140)
    assert torch.equal(a, b)


@pytest.mark.parametrize("pad", [13, 64])
def test_paged_padded_stride_garbage_table_and_clipping(pad):
    lens = [70, 0, 129, 16]
    block_kv, d = 16, 32
    kv_cache, bt, ctx, kd = make_paged(lens, d, block_kv, num_blocks=30, block_stride=block_kv * (d + 4) + pad)
    assert kv_cache.stride(0) == block_kv * (d + 4) + pad
    q, w = rand_fp8(4, 2, 16, d), torch.randn(8, 16)
    ref = reference.paged_mqa_logits(q, kv_cache, w, ctx, bt, 140)
    check_close(ref, paged_expected(q, w, kd, [[n - 1, n] for n in lens], 140))
    # entries past each sequence's blocks are never read, whatever they hold
    bt2 = bt.clone()
    for b, n in enumerate(lens):
        used = math.ceil(n / block_kv)
        bt2[b, used:] = torch.tensor([2**31 - 1, -(2**31), 30, -1] * 9, dtype=torch.int32)[: bt.shape[1] - used]
    assert torch.equal(reference.paged_mqa_logits(q, kv_cache, w, ctx, bt2, 140), ref)
    # max_context_len clips the ranges (and the blocks read); larger pads with -inf
    small = reference.paged_mqa_logits(q, kv_cache, w, ctx, bt2[:, :3], 40)
    torch.testing.assert_close(small, ref[:, :40])
    big = reference.paged_mqa_logits(q, kv_cache, w, ctx, bt2, 200)
    torch.testing.assert_close(big[:, :140], ref)
    assert torch.isneginf(big[:, 140:]).all()


def test_paged_chunking(monkeypatch):
    lens = [100, 57]
    kv_cache, bt, ctx, kd = make_paged(lens, 32, 16)
    q, w = rand_fp8(2, 3, 16, 32), torch.randn(6, 16)
    expected = paged_expected(q, w, kd, [[n - 2, n - 1, n] for n in lens], 100)
    check_close(reference.paged_mqa_logits(q, kv_cache, w, ctx, bt, 100, chunk=1), expected)
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 2000)
    check_close(reference.paged_mqa_logits(q, kv_cache, w, ctx, bt, 100), expected)


def test_paged_bad_block_table():
    kv_cache, bt, ctx, _ = make_paged([40, 20], 32, 16)
    q, w = rand_fp8(2, 1, 16, 32), torch.randn(2, 16)
    bad = bt.clone()
    bad[1, 0] = 1000
    with pytest.raises(ValueError, match=r"^block_table"):
        reference.paged_mqa_logits(q, kv_cache, w, ctx, bad, 40)
    with pytest.raises(ValueError, match=r"^block_table"):
        reference.paged_mqa_logits(q, kv_cache, w, ctx, bt[:, :2], 40)


# ---------------------------------------------------------------------------------------------
# clean_logits


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_ks", [True, False])
def test_clean_logits(next_n, dtype, with_ks):
    g, n, pad = 9, 50, 7
    m = g * next_n
    wide = torch.randn(m, n + pad).to(dtype)
    original = wide.clone()
    logits = wide[:, :n]
    ks = torch.randint(-5, n, (g,), dtype=torch.int32) if with_ks else None
    ke = torch.randint(-3, n + 8, (g,), dtype=torch.int32)
    res = reference.clean_logits(logits, ks, ke, next_n)
    assert res.data_ptr() == logits.data_ptr()
    assert torch.equal(wide[:, n:], original[:, n:])  # padding untouched
    for r in range(m):
        grp, i = divmod(r, next_n)
        lo = max(int(ks[grp]), 0) if with_ks else 0
        hi = min(int(ke[grp]) - next_n + i + 1, n)
        for j in range(n):
            if lo <= j < hi:
                assert wide[r, j] == original[r, j]
            else:
                assert wide[r, j] == NEG_INF


def test_clean_logits_degenerate(monkeypatch):
    e = torch.empty(0, dtype=torch.int32)
    assert reference.clean_logits(torch.randn(0, 5), e, e).shape == (0, 5)
    x = torch.randn(4, 0)
    assert reference.clean_logits(x, None, torch.ones(2, dtype=torch.int32), 2).shape == (4, 0)
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 64)  # row chunking
    x = torch.randn(6, 20)
    ref = x.clone()
    ke = torch.tensor([2**31 - 1, 10, 0], dtype=torch.int32)  # huge ke must not overflow
    reference.clean_logits(x, torch.tensor([3, -2, 0], dtype=torch.int32), ke, 2)
    assert torch.isneginf(x[0:2, :3]).all() and torch.equal(x[0:2, 3:], ref[0:2, 3:])
    assert torch.equal(x[2, :9], ref[2, :9]) and torch.isneginf(x[2, 9:]).all()  # ke - next_n + 0 + 1
    assert torch.equal(x[3, :10], ref[3, :10]) and torch.isneginf(x[3, 10:]).all()
    assert torch.isneginf(x[4:]).all()  # ke = 0: ends -1 and 0


# ---------------------------------------------------------------------------------------------
# paged_mqa_logits_metadata


def meta(lens, num_sms, block_kv=64, split_kv=256):
    return reference.paged_mqa_logits_metadata(torch.tensor(lens, dtype=torch.int32), block_kv, num_sms, split_kv).tolist()


def test_metadata_hand_checked():
    # segs = [2, 0, 3] -> P = [0, 2, 2, 5], T = 5
    assert meta([300, 0, 513], 2) == [[0, 0], [2, 1], [3, 0]]
    assert meta([300, 0, 513], 4) == [[0, 0], [2, 0], [2, 1], [2, 2], [3, 0]]
    assert meta([300, 0, 513], 8) == [[0, 0], [0, 1], [2, 0], [2, 1], [2, 2]] + [[3, 0]] * 4
    assert meta([300, 0, 513], 1) == [[0, 0], [3, 0]]
    assert meta([0, 0], 3) == [[2, 0]] * 4  # T = 0
    assert meta([], 2) == [[0, 0]] * 3  # B = 0
    assert meta([-7, 256, 257], 2, split_kv=256) == [[1, 0], [2, 1], [3, 0]]  # segs [0, 1, 2]
    assert meta([[100, 300], [0, 0], [64, 1]], 2, block_kv=64, split_kv=128) == [[0, 0], [0, 2], [3, 0]]
    out = reference.paged_mqa_logits_metadata(torch.tensor([5], dtype=torch.int32), 64, 2)
    assert out.dtype == torch.int32 and out.shape == (3, 2) and out.device.type == "cpu"


def test_metadata_balance_property():
    for _ in range(200):
        b_sz = random.randint(1, 12)
        split_kv = 64 * random.randint(1, 4)
        lens = [random.choice([0, random.randint(1, 3000)]) for _ in range(b_sz)]
        num_sms = random.randint(1, 40)
        m = meta(lens, num_sms, 64, split_kv)
        segs = [math.ceil(n / split_kv) for n in lens]
        items = [(b, s) for b in range(b_sz) for s in range(segs[b])]  # sorted, every segment once
        flat_index = {it: i for i, it in enumerate(items)}
        total = len(items)
        assert m[-1] == [b_sz, 0]
        starts = [total if tuple(e) == (b_sz, 0) else flat_index[tuple(e)] for e in m]
        assert starts[0] == 0 and starts == sorted(starts)  # contiguous shares, in order
        sizes = [starts[i + 1] - starts[i] for i in range(num_sms)]
        assert sum(sizes) == total and max(sizes) - min(sizes) <= 1


def test_metadata_validation():
    ctx = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^split_kv"):
        reference.paged_mqa_logits_metadata(ctx, 64, 4, split_kv=96)
    with pytest.raises(ValueError, match=r"^num_sms"):
        reference.paged_mqa_logits_metadata(ctx, 64, 0)
    with pytest.raises(TypeError, match=r"^context_lens"):
        reference.paged_mqa_logits_metadata(ctx.long(), 64, 4)


# ---------------------------------------------------------------------------------------------
# quant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_cast_round_trip(dtype):
    x = (torch.randn(3, 5, 64) * torch.rand(3, 5, 1) * 100).to(dtype)
    x[1, 2] = 0  # an all-zero row
    x_fp8, scale = quant.per_token_cast_to_fp8(x)
    assert x_fp8.dtype == FP8 and x_fp8.shape == x.shape and scale.shape == (3, 5) and scale.dtype == torch.float32
    assert torch.isfinite(scale).all() and (scale > 0).all()
    deq = x_fp8.float() * scale[..., None]
    assert not torch.isnan(deq).any() and torch.equal(deq[1, 2], torch.zeros(64))
    xf = x.float()
    bound = xf.abs() * 2.0**-4 + scale[..., None] * 2.0**-10 + 1e-30  # e4m3: 3 mantissa bits
    assert ((deq - xf).abs() <= bound).all()
    assert torch.allclose(x_fp8.float().abs().amax(-1)[scale > 1e-10], torch.tensor(448.0))


def raw_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(kv_cache.untyped_storage())


@pytest.mark.parametrize("pad", [0, 20])
def test_pack_layout_and_dequantize(pad):
    lens, d, block_kv = [33, 0, 16, 50], 64, 16
    keys = [torch.randn(n, d).to(torch.bfloat16) for n in lens]
    kv_cache, bt, ctx = quant.pack_paged_kv_cache(keys, block_kv, num_blocks=12,
                                                  block_stride=block_kv * (d + 4) + pad)
    assert kv_cache.shape == (12, block_kv, 1, d + 4) and kv_cache.dtype == torch.uint8
    assert ctx.tolist() == lens and bt.dtype == torch.int32 and bt.shape == (4, 4)
    used = [bt[b, : math.ceil(n / block_kv)].tolist() for b, n in enumerate(lens)]
    flat_used = sum(used, [])
    assert len(set(flat_used)) == len(flat_used) and all(0 <= p < 12 for p in flat_used)
    raw, deq = raw_bytes(kv_cache), quant.dequantize_paged_kv_cache(kv_cache)
    assert deq.shape == (12, block_kv, d) and deq.dtype == torch.float32
    torch.testing.assert_close(quant.dequantize_paged_kv_cache(kv_cache[3:]), deq[3:],  # storage offset
                               rtol=0, atol=0, equal_nan=True)  # unused blocks hold random bytes
    for b, n in enumerate(lens):
        x_fp8, scale = quant.per_token_cast_to_fp8(keys[b])
        for t in range(n):
            p, o = used[b][t // block_kv], t % block_kv
            base = kv_cache.storage_offset() + p * kv_cache.stride(0)
            assert torch.equal(raw[base + o * d: base + (o + 1) * d], x_fp8[t].view(torch.uint8))
            s_off = base + block_kv * d + 4 * o
            assert torch.equal(raw[s_off: s_off + 4], scale[t: t + 1].view(torch.uint8))
            torch.testing.assert_close(deq[p, o], x_fp8[t].float() * scale[t])
            xf = keys[b][t].float()
            assert ((deq[p, o] - xf).abs() <= xf.abs() / 16 + scale[t] / 1024).all()


def test_pack_shuffle_and_garbage():
    lens = [100, 100]
    _, bt, _ = quant.pack_paged_kv_cache([torch.randn(n, 32) for n in lens], 16, shuffle=False, num_blocks=20)
    assert bt[0, :7].tolist() == list(range(7)) and bt[1, :7].tolist() == list(range(7, 14))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    keys = [torch.randn(n, 32) for n in (10, 200)]
    a = quant.pack_paged_kv_cache(keys, 16, num_blocks=64, generator=g1)
    b = quant.pack_paged_kv_cache(keys, 16, num_blocks=64, generator=g2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # reproducible with a generator
    kv_cache, bt, _ = a
    garbage = bt[0, 1:]
    assert ((garbage < 0) | (garbage >= 64)).any()  # random int32: some out of range
    assert bt[1, :13].tolist() != sorted(bt[1, :13].tolist())  # shuffled
    used = set(bt[0, :1].tolist() + bt[1, :13].tolist())
    unused = [p for p in range(64) if p not in used]
    assert kv_cache[unused].float().std() > 50  # random bytes, not zeros


def test_write_matches_pack():
    lens, d, block_kv = [45, 3, 0, 64], 32, 16
    keys = [torch.randn(n, d) for n in lens]
    kv_cache, bt, ctx = quant.pack_paged_kv_cache(keys, block_kv, num_blocks=16)
    fresh = torch.full_like(kv_cache, 7)
    slots = []
    for b, n in enumerate(lens):
        t = torch.arange(n)
        slots.append(bt[b, t // block_kv].long() * block_kv + t % block_kv)
    k_all, slot_all = torch.cat(keys), torch.cat(slots)
    # padding tokens (slot -1) are skipped; int32 slots accepted
    k_all = torch.cat([k_all, torch.randn(2, d)])
    slot_all = torch.cat([slot_all, torch.tensor([-1, -1])]).to(torch.int32)
    perm = torch.randperm(k_all.shape[0])
    assert quant.write_paged_kv_cache(fresh, k_all[perm], slot_all[perm]) is fresh
    occupied = torch.zeros(16, block_kv, dtype=torch.bool)
    occupied.view(-1)[slot_all[slot_all >= 0].long()] = True
    (fk, fs), (pk, ps) = quant._kv_cache_views(fresh), quant._kv_cache_views(kv_cache)
    assert torch.equal(fk[occupied], pk[occupied]) and torch.equal(fs[occupied], ps[occupied])
    assert (fk[~occupied] == 7).all() and (fs[~occupied] == 7).all()
    deq_f, deq_p = quant.dequantize_paged_kv_cache(fresh), quant.dequantize_paged_kv_cache(kv_cache)
    assert torch.equal(deq_f[occupied], deq_p[occupied])
    with pytest.raises(ValueError, match=r"^slot_mapping"):
        quant.write_paged_kv_cache(fresh, torch.randn(1, d), torch.tensor([16 * block_kv]))


# ---------------------------------------------------------------------------------------------
# input validation


def _prefill_args(s=4, h=16, d=32, skv=20):
    q, kv, w = rand_fp8(s, h, d), rand_k(skv, d), torch.randn(s, h)
    z = torch.zeros(s, dtype=torch.int32)
    return dict(q=q, kv=kv, weights=w, cu_seq_len_k_start=z, cu_seq_len_k_end=z + skv)


def _paged_args():
    kv_cache, bt, ctx, _ = make_paged([20, 5], 32, 16)
    return dict(q=rand_fp8(2, 1, 16, 32), kv_cache=kv_cache, weights=torch.randn(2, 16),
                context_lens=ctx, block_table=bt, max_context_len=20)


@pytest.mark.parametrize("key,bad,exc,name", [
    ("q", lambda a: a["q"].float(), TypeError, r"q"),
    ("q", lambda a: a["q"][0], ValueError, r"q"),
    ("kv", lambda a: a["kv"][0], TypeError, r"kv"),
    ("kv", lambda a: (a["kv"][0][:, :16], a["kv"][1]), ValueError, r"kv\[0\]"),
    ("kv", lambda a: (a["kv"][0], a["kv"][1][:5]), ValueError, r"kv\[1\]"),
    ("kv", lambda a: (a["kv"][0], a["kv"][1].double()), TypeError, r"kv\[1\]"),
    ("weights", lambda a: a["weights"].half(), TypeError, r"weights"),
    ("weights", lambda a: a["weights"][:, :8], ValueError, r"weights"),
    ("max_seqlen_k", lambda a: -1, ValueError, r"max_seqlen_k"),
    ("cu_seq_len_k_start", lambda a: a["cu_seq_len_k_start"].long(), TypeError, r"cu_seq_len_k_start"),
    ("cu_seq_len_k_end", lambda a: a["cu_seq_len_k_end"][:2], ValueError, r"cu_seq_len_k_end"),
    ("logits_dtype", lambda a: torch.float16, TypeError, r"logits_dtype"),
    ("clean_logits", lambda a: 1, TypeError, r"clean_logits"),
])
def test_mqa_logits_validation(key, bad, exc, name):
    args = _prefill_args()
    args[key] = bad(args)
    with pytest.raises(exc, match=rf"^{name}") as info:
        reference.mqa_logits(**args)
    assert "expected" in str(info.value) and "got" in str(info.value)


@pytest.mark.parametrize("key,bad,exc,name", [
    ("q", lambda a: a["q"][0], ValueError, r"q"),
    ("kv_cache", lambda a: a["kv_cache"].view(torch.int8), TypeError, r"kv_cache"),
    ("kv_cache", lambda a: a["kv_cache"][..., :30], ValueError, r"kv_cache"),
    ("kv_cache", lambda a: a["kv_cache"][:, ::2], ValueError, r"kv_cache"),
    ("weights", lambda a: a["weights"][:1], ValueError, r"weights"),
    ("context_lens", lambda a: a["context_lens"].long(), TypeError, r"context_lens"),
    ("context_lens", lambda a: a["context_lens"][:, None].expand(2, 3).contiguous(), ValueError, r"context_lens"),
    ("block_table", lambda a: a["block_table"][:1], ValueError, r"block_table"),
    ("block_table", lambda a: a["block_table"].long(), TypeError, r"block_table"),
    ("max_context_len", lambda a: -1, ValueError, r"max_context_len"),
    ("max_context_len", lambda a: 2.5, TypeError, r"max_context_len"),
])
def test_paged_validation(key, bad, exc, name):
    args = _paged_args()
    args[key] = bad(args)
    with pytest.raises(exc, match=rf"^{name}") as info:
        reference.paged_mqa_logits(**args)
    assert "expected" in str(info.value) and "got" in str(info.value)


def test_clean_and_quant_validation():
    ke = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^logits"):
        reference.clean_logits(torch.randn(4, 8).half(), None, ke)
    with pytest.raises(ValueError, match=r"^logits"):
        reference.clean_logits(torch.randn(8, 4).t(), None, ke)
    with pytest.raises(ValueError, match=r"^logits"):
        reference.clean_logits(torch.randn(5, 8), None, ke, next_n=2)
    with pytest.raises(ValueError, match=r"^cu_seq_len_k_end"):
        reference.clean_logits(torch.randn(4, 8), None, ke, next_n=2)
    with pytest.raises(TypeError, match=r"^cu_seq_len_k_start"):
        reference.clean_logits(torch.randn(4, 8), ke.float(), ke)
    with pytest.raises(TypeError, match=r"^x"):
        quant.per_token_cast_to_fp8(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^block_stride"):
        quant.pack_paged_kv_cache([torch.randn(5, 32)], 16, block_stride=100)
    with pytest.raises(ValueError, match=r"^num_blocks"):
        quant.pack_paged_kv_cache([torch.randn(50, 32)], 16, num_blocks=2)
    with pytest.raises(ValueError, match=r"^k_list_or_tensor\[1\]"):
        quant.pack_paged_kv_cache([torch.randn(5, 32), torch.randn(5, 16)], 16)
    kv_cache = quant.pack_paged_kv_cache([torch.randn(5, 32)], 16)[0]
    with pytest.raises(ValueError, match=r"^k"):
        quant.write_paged_kv_cache(kv_cache, torch.randn(2, 16), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"^slot_mapping"):
        quant.write_paged_kv_cache(kv_cache, torch.randn(2, 32), torch.zeros(2))


@pytest.mark.parametrize("spread", [0.0, 2.0, 6.0])
def test_split_relu_pieces_reconstruct_and_give_the_logits(spread):
    # The kernels' relu(x) = (|x| + x) / 2 form with the linear half from 4 fp8 pieces of
    # q~ = sum_h w q: the pieces rebuild q~ to ~2^-16 of its largest entry, and the logits so formed
    # match the direct formula far below the kernels' tolerance, also for wide dynamic ranges.
    g = torch.Generator().manual_seed(int(spread * 10))
    T, H, D, N = 6, 64, 128, 300
    q = (torch.randn(T, H, D, generator=g) * torch.exp(spread * torch.randn(T, H, 1, generator=g))).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn).double()
    k = torch.randn(N, D, generator=g).to(torch.float8_e4m3fn).double()
    w = torch.randn(T, H, generator=g).double()
    q_tilde = torch.einsum("th,thd->td", w, q).float()
    pieces, scales = reference.split_relu_pieces(q_tilde)
    rebuilt = (scales[:, :, None].double() * pieces.double()).sum(0)
    err = (rebuilt - q_tilde.double()).abs().amax(-1) / q_tilde.double().abs().amax(-1)
    assert float(err.max()) < 2.0 ** -13, float(err.max())
    x = torch.einsum("thd,nd->thn", q, k)
    direct = (w[:, :, None] * x.clamp(min=0)).sum(1)
    split = 0.5 * ((w[:, :, None] * x.abs()).sum(1) + rebuilt @ k.T)
    assert calc_diff(split, direct) < 1e-9
    zero_p, zero_s = reference.split_relu_pieces(torch.zeros(2, D))
    assert not zero_p.float().any() and not zero_s.any()


@pytest.mark.parametrize("next_n", [5, 6, 7, 8])
def test_paged_long_mtp_matches_naive(next_n):
    lens = [random.randint(0, 150) for _ in range(3)] + [0, next_n - 2, 1]
    kv_cache, bt, ctx, kd = make_paged(lens, 64, 32, num_blocks=40)
    b_sz = len(lens)
    q, w = rand_fp8(b_sz, next_n, 16, 64), torch.randn(b_sz * next_n, 16)
    mcl = max(lens) + 5
    out = reference.paged_mqa_logits(q, kv_cache, w, ctx, bt, mcl)
    check_close(out, paged_expected(q, w, kd, [[n - next_n + i + 1 for i in range(next_n)] for n in lens], mcl))
    ctx2 = torch.tensor([[random.randint(0, n) for _ in range(next_n)] for n in lens], dtype=torch.int32)
    out2 = reference.paged_mqa_logits(q, kv_cache, w, ctx2, bt, mcl)
    check_close(out2, paged_expected(q, w, kd, ctx2.tolist(), mcl))


def test_paged_varlen_reads_the_run_start_row():
    """indices: every row of a run of equal consecutive ids reads the block-table row of the run's first
    row (the other rows' entries are garbage and never read); each row sees its own length; equal ids
    that are not adjacent are separate runs; id values are arbitrary int32."""
    req_lens = [50, 130, 7, 90]
    kv_cache, bt_req, _, kd = make_paged(req_lens, 32, 16, num_blocks=40)
    runs = [(0, 3), (1, 1), (2, 2), (0, 2), (3, 4)]  # (request, rows); request 0 appears twice, apart
    ids_of_run = [-5, 2**31 - 1, 7, -5, 0]
    R = sum(n for _, n in runs)
    bt = torch.full((R, bt_req.shape[1]), -12345, dtype=torch.int32)  # garbage everywhere...
    ids, ctx, expect_ranges, expect_keys, r = [], [], [], [], 0
    for (req, n), rid in zip(runs, ids_of_run):
        bt[r] = bt_req[req]  # ...except at the run's first row
        for j in range(n):
            L = random.randint(0, req_lens[req])
            ids.append(rid)
            ctx.append(L)
            expect_keys.append(req)
        r += n
    q, w = rand_fp8(R, 1, 16, 32), torch.randn(R, 16)
    idx = torch.tensor(ids, dtype=torch.int32)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    mcl = max(req_lens) + 3
    for c in (ctx_t, ctx_t[:, None].contiguous()):
        out = reference.paged_mqa_logits(q, kv_cache, w, c, bt, mcl, indices=idx, accum_dtype=torch.float64)
        want = torch.cat([naive_logits(q[i].double(), kd[expect_keys[i]][: ctx[i]], w[i:i + 1], [(0, ctx[i])], mcl)
                          for i in range(R)])
        check_close(out, want, torch.float64)


def test_paged_varlen_reference_validation():
    kv_cache, bt, ctx, _ = make_paged([10, 20], 32, 16)
    q, w = rand_fp8(2, 2, 16, 32), torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"q: expected shape \[R, 1, H, D\] with indices"):
        reference.paged_mqa_logits(q, kv_cache, w, ctx, bt, 30, indices=torch.zeros(2, dtype=torch.int32))
    q, w = rand_fp8(2, 1, 16, 32), torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"indices: expected shape \[2\], got \[3\]"):
        reference.paged_mqa_logits(q, kv_cache, w, ctx, bt, 30, indices=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"indices: expected dtype torch.int32"):
        reference.paged_mqa_logits(q, kv_cache, w, ctx, bt, 30, indices=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"context_lens: expected shape \[R\] or \[R, 1\] with indices"):
        reference.paged_mqa_logits_metadata(torch.zeros(2, 2, dtype=torch.int32), 64, 4,
                                            indices=torch.zeros(2, dtype=torch.int32))
    lens = torch.tensor([0, 300, 5, 0], dtype=torch.int32)
    assert torch.equal(reference.paged_mqa_logits_metadata(lens, 64, 3, indices=torch.tensor([1, 1, 2, 2], dtype=torch.int32)),
                       reference.paged_mqa_logits_metadata(lens, 64, 3))


@pytest.mark.parametrize("B", [0, 1, 70000])
def test_paged_metadata_reference_all_zero_lengths(B):
    """All-zero lengths at any batch size: every entry is (B, 0)."""
    meta = reference.paged_mqa_logits_metadata(torch.zeros(B, dtype=torch.int32), 64, 132)
    assert meta.shape == (133, 2) and (meta[:, 0] == B).all() and (meta[:, 1] == 0).all()
