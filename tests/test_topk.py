"""topk_indices: exact sets with the documented tie rule.

CPU: the reference against torch.topk, a step-by-step emulation of the kernel's radix select
(same key transform, digit schedule, early stop and column-order selection) against the
reference on adversarial rows, and input validation. GPU (SM90): the kernel against the reference.
"""
import os
import numpy as np
import pytest
import torch

from conftest import requires_sm90

import deep_indexer as di
from deep_indexer import reference

DEV = "cuda"
KINDS = ("random", "equal", "ties", "few", "neginf", "huge_neg", "low_contrast", "nan", "signed_zero", "small_bins")


def make_rows(kind: str, m: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Adversarial [m, n] logits of `dtype` (CPU)."""
    if kind == "random":
        x = torch.randn(m, n, generator=gen)
    elif kind == "equal":
        x = torch.full((m, n), 0.5)
    elif kind == "ties":  # heavy ties at the k-th value
        x = torch.randint(0, 8, (m, n), generator=gen).float() / 4
    elif kind == "few":  # fewer distinct values than k
        x = torch.randint(0, 3, (m, n), generator=gen).float() - 1
    elif kind == "neginf":
        x = torch.randn(m, n, generator=gen)
        x[torch.rand(m, n, generator=gen) < 0.7] = float("-inf")
    elif kind == "huge_neg":  # below -65504: collapses under an fp16 pre-binning
        x = -1e6 * (1 + torch.rand(m, n, generator=gen))
    elif kind == "low_contrast":  # values a few ulp apart
        if dtype == torch.bfloat16:
            bits = 0x3F80 + torch.randint(0, 6, (m, n), generator=gen, dtype=torch.int16)
            return bits.view(torch.bfloat16)
        bits = 0x3F800000 + torch.randint(0, 24, (m, n), generator=gen, dtype=torch.int32)
        return bits.view(torch.float32)
    elif kind == "small_bins":  # ~16 keys per bin of all but the last radix digit, 4 values each: exact ties in it
        low = torch.randint(0, 4, (m, n), generator=gen, dtype=torch.int32)
        if dtype == torch.bfloat16:  # bins of the top 11 bits (below +inf)
            g = torch.randint(0, min(max(1, n // 16), 600), (m, n), generator=gen, dtype=torch.int32)
            return (0x3000 + (g << 5) + low).to(torch.int16).view(torch.bfloat16)
        g = torch.randint(0, max(1, n // 16), (m, n), generator=gen, dtype=torch.int32)  # bins of the top 22 bits
        return (0x3F800000 + (g << 10) + low).view(torch.float32)
    elif kind == "nan":
        x = torch.randn(m, n, generator=gen)
        x[torch.rand(m, n, generator=gen) < 0.2] = float("nan")
        x[torch.rand(m, n, generator=gen) < 0.05] = -float("nan")
    elif kind == "signed_zero":
        x = torch.randint(-1, 2, (m, n), generator=gen).float() * 1e-3
        x[torch.rand(m, n, generator=gen) < 0.5] = 0.0
        x[torch.rand(m, n, generator=gen) < 0.25] = -0.0
    else:
        raise AssertionError(kind)
    return x.to(dtype)


# ------------------------------------------------------------------------------------ kernel emulation
# Constants of include/deep_indexer/topk/topk_layout.hpp (the emulation may shrink the buffer and the
# window to reach every path on short rows).
THREADS, CAND_CAP, WINDOW = 512, 8192, 32768
SAMPLE_MIN = THREADS * 8  # rows longer than this take the threshold sample
SAMPLE_FLOOR_BELOW = 1024  # the sample's one-pass search starts this many top-16-bit values below the previous kmin


def isqrt32(x: int) -> int:
    r, b = 0, 1 << 15
    while b:
        if (r + b) * (r + b) <= x:
            r += b
        b >>= 1
    return r


def sample_rank(k: int, n: int, m_keys: int, kvec: int) -> int:
    mu = k * m_keys // n
    return min(mu + 6 * isqrt32(mu) + 9, m_keys - 2 * kvec)


def sample_vectors(n: int, mis: int, elem_bytes: int, threads: int = THREADS) -> np.ndarray:
    """Vector indices of the threshold sample of a row of n > SAMPLE_MIN keys (the kernel's rule)."""
    kvec = 16 // elem_bytes
    num_vecs = (mis + n + kvec - 1) // kvec
    s_v = min(max(n // (32 * threads * kvec), 1), 2 if elem_bytes == 4 else 1)
    m_v = s_v * threads
    return np.arange(m_v, dtype=np.int64) * (num_vecs // m_v)


def digits(elem_bytes: int) -> list:
    return [(21, 11), (10, 11), (0, 10)] if elem_bytes == 4 else [(5, 11), (0, 5)]


def kth_bin(hist: np.ndarray, k: int) -> tuple:
    """(bin, keys above it, keys in it) of the bin holding the k-th largest key (find_kth_bin)."""
    above = np.cumsum(hist[::-1])[::-1] - hist
    (b,) = np.nonzero((above < k) & (k <= above + hist))
    assert b.shape == (1,), "exactly one k-th bin"
    b = int(b[0])
    return b, int(above[b]), int(hist[b])


def radix_pass(keys: np.ndarray, st: dict, shift: int, bits: int) -> tuple:
    """One radix pass over `keys` (the kernel's radix_pass): counts the digit of the keys matching the
    prefix, finds the k_rem-th key's bin, refines st (prefix, mask, greater, k_rem); (keys above, in bin)."""
    dm = (1 << bits) - 1
    hist = np.bincount((keys[(keys & st["mask"]) == st["prefix"]] >> shift) & dm, minlength=2048)
    b, above, cnt = kth_bin(hist, st["k_rem"])
    st["prefix"] |= b << shift
    st["mask"] |= dm << shift
    st["greater"] += above
    st["k_rem"] -= above
    return above, cnt


def emulate_kernel_row(buf: np.ndarray, start: int, lo: int, hi: int, k: int, elem_bytes: int, sorted_: bool,
                       ctas: int = 1, cap: int = CAND_CAP, window: int = WINDOW, stats: dict | None = None,
                       near: int = 0) -> list:
    """The kernel's algorithm on one row. `buf` holds the keys of the whole allocation (16-byte
    aligned at element 0), the row's first column is element start + lo. Mirrors the vector split
    (mis), the threshold sample, the filter into a buffer of `cap` entries (any order), the
    fallback radix select over the row, the buffer select (bfloat16 with a threshold: one pass over key
    minus threshold first) and the windowed column-order emission. Returns the output columns (relative
    to lo), in output order; `stats` gets the path taken, the buffer select's form, the sample's search
    form and kmin. A smaller `cap` scales the sample's thread count (and SAMPLE_MIN) with it. `near`: the
    CTA's previous kmin (0: none), where the sample's one-pass search starts."""
    kvec = 16 // elem_bytes
    full_mask = 0xFFFFFFFF if elem_bytes == 4 else 0xFFFF
    n = hi - lo
    mis = (start + lo) % kvec
    vec0 = (start + lo - mis) // kvec
    num_vecs = 0 if n == 0 else (mis + n + kvec - 1) // kvec
    cols = np.arange(n, dtype=np.int64)
    keys = buf[start + lo:start + hi].astype(np.int64)
    path = "direct"

    kmin = 0
    threads = THREADS * cap // CAND_CAP
    if n > threads * 8:  # threshold from the strided sample: a two-digit radix select of the j-th key
        sv = sample_vectors(n, mis, elem_bytes, threads)
        sk = []
        for v in sv:
            for c in range(kvec):
                j = v * kvec + c - mis
                if 0 <= j < n:
                    sk.append(int(buf[(vec0 + v) * kvec + c]))
        sk = np.array(sk, dtype=np.int64)
        rank = sample_rank(k, n, len(sv) * kvec, kvec)
        assert 1 <= rank <= len(sk)
        kmin, sample_search = None, "digits"
        if near > 0:  # one pass over the keys' top 16 bits - floor, bins of one value (0 and 2047 shared)
            top = 8 * elem_bytes - 16
            floor = max(near >> top, SAMPLE_FLOOR_BELOW) - SAMPLE_FLOOR_BELOW
            b, _, _ = kth_bin(np.bincount(np.clip((sk >> top) - floor, 0, 2047), minlength=2048), rank)
            if 0 < b < 2047:
                kmin, sample_search = (floor + b) << top, "floor"
        if kmin is None:
            st = dict(prefix=0, mask=0, greater=0, k_rem=rank)
            for d, (shift, bits) in enumerate(digits(elem_bytes)[:2]):
                above, cnt = radix_pass(sk, st, shift, bits)
                if d == 0 and (above + cnt) * n <= (cap // 2) * len(sv) * kvec:  # the first digit's edge is enough
                    break
            kmin = st["prefix"]
        if stats is not None:
            stats["sample_search"], stats["kmin"] = sample_search, kmin
        path = "sample"

    def filt(kmin_):  # survivors of the whole row (the CTAs' shares together), in some order
        sel = keys >= kmin_
        return keys[sel], cols[sel]

    # each CTA of a cluster filters a contiguous share of the vectors: together, the whole row
    per_cta = -(-num_vecs // ctas)
    shares = [(min(q * per_cta, num_vecs), min(min(q * per_cta, num_vecs) + per_cta, num_vecs)) for q in range(ctas)]
    assert sum(e - b for b, e in shares) == num_vecs
    bk, bc = filt(kmin)
    ns = len(bk)
    prefix = mask = greater = 0
    take_eq, whole, eq_from_row = ns, True, False
    floor_key = kmin  # every buffered key is >= it (0: no bound known)
    select = "digits"
    if ns < min(k, n) or ns > cap:
        path += "+fallback"
        floor_key = 0
        st = dict(prefix=0, mask=0, greater=0, k_rem=k)
        for shift, bits in digits(elem_bytes):
            _, cnt = radix_pass(keys, st, shift, bits)
            count_ge = st["greater"] + cnt
            if count_ge <= cap:
                break
        eq_from_row = count_ge > cap
        bk, bc = filt(st["prefix"] + 1 if eq_from_row else st["prefix"])
        ns = len(bk)
        assert ns == (st["greater"] if eq_from_row else count_ge) and ns <= cap
        if eq_from_row:
            path += "+eq_from_row"
            assert st["mask"] == full_mask
            prefix, mask, greater = st["prefix"], st["mask"], st["greater"]
            take_eq, whole = st["k_rem"], False
        else:
            take_eq = ns
    if not eq_from_row and ns > k:
        st = dict(prefix=0, mask=0, greater=0, k_rem=k)
        resolved = False
        if elem_bytes == 2 and floor_key > 0:  # one pass over key - floor_key, 2047 one-key bins and an overflow bin
            assert (bk >= floor_key).all()
            b, above, cnt = kth_bin(np.bincount(np.minimum(bk - floor_key, 2047), minlength=2048), k)
            resolved = b < 2047
            select = "one_pass" if resolved else "one_pass_overflow"
            if resolved:
                st = dict(prefix=floor_key + b, mask=full_mask, greater=above, k_rem=k - above)
                whole = st["k_rem"] == cnt
        if not resolved:
            for shift, bits in digits(elem_bytes):
                _, cnt = radix_pass(bk, st, shift, bits)
                whole = st["k_rem"] == cnt
                if whole:
                    break
        prefix, mask, greater, take_eq = st["prefix"], st["mask"], st["greater"], st["k_rem"]
    total = greater + take_eq
    assert total == min(k, n)

    out = [None] * total
    gt_base = eq_base = 0
    w0 = 0
    while w0 < n and gt_base + min(eq_base, take_eq) < total:
        wn = min(window, n - w0)
        gt = np.zeros(wn, dtype=bool)
        eq = np.zeros(wn, dtype=bool)
        inw = (bc >= w0) & (bc < w0 + wn)
        mk = bk[inw] & mask
        gt[bc[inw][(mk > prefix) | ((mk == prefix) & whole)] - w0] = True
        eq[bc[inw][(mk == prefix) & (not whole)] - w0] = True
        if eq_from_row:
            eq |= keys[w0:w0 + wn] == prefix
        assert not (gt & eq).any()
        g_before = gt_base + np.cumsum(gt) - gt
        e_before = eq_base + np.cumsum(eq) - eq
        for j in np.nonzero(gt | eq)[0]:
            if gt[j] or e_before[j] < take_eq:
                pos = int(g_before[j] + min(e_before[j], take_eq))
                assert pos < total and out[pos] is None
                out[pos] = w0 + int(j)
        gt_base += int(gt.sum())
        eq_base += int(eq.sum())
        w0 += window
    assert gt_base == (total if whole else greater) and None not in out
    if stats is not None:
        stats["path"], stats["survivors"], stats["select"] = path, ns, select
    if sorted_:
        comp = np.array([(int(keys[j]) << 32) | (0xFFFFFFFF - j) for j in out], dtype=np.uint64)
        out = [out[i] for i in np.argsort(comp, kind="stable")[::-1]]  # composites are unique
    return out


def _emulate_vs_reference(x: torch.Tensor, start: int, lo: int, hi: int, k: int, sorted_: bool, **kw) -> dict:
    buf = reference.topk_keys(x).numpy()
    stats = {}
    got = emulate_kernel_row(buf, start, lo, hi, k, x.element_size(), sorted_, stats=stats, **kw)
    ref = reference.topk_indices(x[start:].unsqueeze(0), k, torch.tensor([lo], dtype=torch.int32),
                                 torch.tensor([hi], dtype=torch.int32), sorted=sorted_)[0]
    assert got == ref[ref >= 0].tolist()
    return stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(1, 1), (1, 5), (7, 3), (300, 64), (5000, 2048), (5000, 512), (2048, 2048), (2049, 2048)])
@pytest.mark.parametrize("sorted_", [False, True])
def test_emulation_matches_reference(dtype, kind, n, k, sorted_):
    gen = torch.Generator().manual_seed(n * 31 + k + len(kind))
    width = n + 40
    x = make_rows(kind, 1, width, dtype, gen)[0]
    # a small buffer and window reach the sample, fallback and multi-window paths on short rows
    for start, lo, cap, window in ((0, 0, CAND_CAP, WINDOW), (3, 5, 2500, 1024), (1, 2, 2048, 64)):
        hi = min(lo + n, width - start)
        _emulate_vs_reference(x, start, lo, hi, k, sorted_, cap=cap, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,path", [("random", "sample"), ("low_contrast", "sample+fallback+eq_from_row"),
                                       ("ties", "sample+fallback+eq_from_row"), ("equal", "sample+fallback+eq_from_row")])
def test_emulation_long_row_paths(dtype, kind, path):
    # the kernel's real buffer and window: random rows take the sample path (one read), rows with
    # more than a buffer of keys equal to the k-th take the equal keys from the row
    gen = torch.Generator().manual_seed(7)
    n = 262144
    x = make_rows(kind, 1, n + 8, dtype, gen)[0]
    stats = _emulate_vs_reference(x, 3, 0, n, 2048, False)
    assert stats["path"] == path
    if kind == "random":
        assert 2048 <= stats["survivors"] <= CAND_CAP // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(9000, 2048), (30000, 2048), (120000, 2048), (30000, 512), (70001, 1), (8193, 2048)])
def test_emulation_sample_survivors(dtype, n, k):
    # random rows: the sample's threshold keeps >= k keys that fit the buffer with room to spare
    gen = torch.Generator().manual_seed(n + k)
    for trial in range(3):
        x = make_rows("random", 1, n + 8, dtype, gen)[0]
        stats = _emulate_vs_reference(x, trial, 0, n, k, False)
        assert stats["path"] == "sample" and k <= stats["survivors"] <= 0.75 * CAND_CAP, stats


def skewed_row(n: int, mis: int, dtype: torch.dtype, sample_value: float, gen: torch.Generator,
               every: int = 1) -> torch.Tensor:
    """A random row whose threshold-sample vectors (every `every`-th of them) hold `sample_value`:
    a sample that misjudges the row (too high: fewer than k survivors; too low: more than the buffer)."""
    kvec = 16 // torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(mis + n + 2 * kvec, generator=gen)
    for v in sample_vectors(n, mis, 16 // kvec)[::every]:
        x[v * kvec:(v + 1) * kvec] = sample_value
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sample_value,every", [(8.0, 4), (-8.0, 1)])
def test_emulation_fallback_on_skewed_sample(dtype, sample_value, every):
    gen = torch.Generator().manual_seed(11)
    n, mis = 40000, 1
    x = skewed_row(n, mis, dtype, sample_value, gen, every)
    stats = _emulate_vs_reference(x, mis, 0, n, 2048, True)
    assert stats["path"] == "sample+fallback"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [512, 2048])
def test_emulation_sample_search_from_previous_row(dtype, k):
    # a CTA's rows in turn: the sample searches in one pass from the previous row's kmin and finds its j-th
    # key's top 16 bits (bfloat16: the key itself); a row whose threshold lies ~8 binades or more from the
    # previous one takes the digits (as the first row does); every row's result is exact either way
    gen = torch.Generator().manual_seed(k + 3)
    n, mis, near = 30000, 3, 0
    scales = [(1.0, 0.0), (1.5, 0.2), (1.0, 0.0), (2.0 ** 12, 0.0), (2.0 ** 11, 0.0), (1.0, 0.0), (0.5, -3.0)]
    searches = []
    for scale, shift in scales:
        x = (torch.randn(mis + n + 8, generator=gen) * scale + shift).to(dtype)
        stats = _emulate_vs_reference(x, mis, 0, n, k, False, near=near)
        assert stats["path"] == "sample", stats
        keys = reference.topk_keys(x).numpy().astype(np.int64)
        sv = sample_vectors(n, mis, x.element_size())
        kvec = 16 // x.element_size()
        idx = np.concatenate([np.arange(v * kvec, (v + 1) * kvec) for v in sv])
        sk = np.sort(keys[idx[(idx >= mis) & (idx < mis + n)]])[::-1]  # the sample's valid keys
        rank = sample_rank(k, n, len(sv) * kvec, kvec)
        if stats["sample_search"] == "floor":
            top = 8 * x.element_size() - 16
            assert stats["kmin"] == (sk[rank - 1] >> top) << top  # the j-th key's top 16 bits
        else:
            assert stats["kmin"] <= sk[rank - 1]  # the j-th key's bin edge (one or two digits)
        searches.append(stats["sample_search"])
        near = stats["kmin"]
    assert searches == ["digits", "floor", "floor", "digits", "floor", "digits", "digits"], searches


def far_threshold_row(width: int, lo: int, n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """k values in [1, 2) among tiny negative ones in columns [lo, lo + n): the threshold sample holds fewer
    large values than its rank, so the threshold lies among the negative values, more than 2047 bfloat16
    keys below the k-th key (the one-pass selection's overflow bin)."""
    x = -1e-3 * (1 + torch.rand(width, generator=gen))
    x[lo + torch.randperm(n, generator=gen)[:k]] = 1 + torch.rand(k, generator=gen)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "far"])
@pytest.mark.parametrize("k", [512, 2048])
def test_emulation_buffer_select_forms(dtype, kind, k):
    # bfloat16 rows with a threshold select in one pass over key - threshold, unless the k-th key lies 2047
    # or more keys above it; float32 rows take the digits
    gen = torch.Generator().manual_seed(k + len(kind))
    n = 30000
    for start in (0, 3):
        x = (far_threshold_row(n + 8, start, n, k, dtype, gen) if kind == "far"
             else make_rows("random", 1, n + 8, dtype, gen)[0])
        stats = _emulate_vs_reference(x, start, 0, n, k, False)
        want = "digits" if dtype == torch.float32 else "one_pass" if kind == "random" else "one_pass_overflow"
        assert stats["path"] == "sample" and stats["select"] == want, stats


@pytest.mark.parametrize("elem_bytes", [4, 2])
@pytest.mark.parametrize("ctas", [1, 2, 8])
@pytest.mark.parametrize("start,lo,hi,k", [(0, 0, 5000, 512), (3, 7, 4100, 2048), (1, 0, 1, 1), (5, 9, 9, 4),
                                           (2, 1, 60, 100), (6, 3, 3000, 2047), (0, 5, 300, 37),
                                           (1, 0, 20000, 2048), (4, 17, 12000, 100)])
@pytest.mark.parametrize("kind", ["random", "ties", "low_contrast"])
def test_emulation_ranges_and_clusters(elem_bytes, ctas, start, lo, hi, k, kind):
    dtype = torch.float32 if elem_bytes == 4 else torch.bfloat16
    gen = torch.Generator().manual_seed(start * 100 + hi + ctas)
    width = start + hi + 40
    width += (-width) % 8
    x = make_rows(kind, 1, width, dtype, gen)[0]
    for sorted_ in (False, True):
        _emulate_vs_reference(x, start, lo, hi, k, sorted_, ctas=ctas)


# ------------------------------------------------------------------------------------ reference
def test_keys_order_preserving():
    v = torch.tensor([float("-inf"), -1e30, -65505.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 65505.0, 3e38, float("inf")])
    for dtype in (torch.float32, torch.bfloat16):
        key = reference.topk_keys(v.to(dtype))
        assert (key[1:] >= key[:-1]).all() and key[5] == key[6]
        assert int(reference.topk_keys(torch.tensor([float("nan")]).to(dtype))[0]) == 0 < int(key[0])


def test_keys_documented_form():
    # sign + bits for positive values, sign - |bits| for negative ones (both zeros share a key)
    v = torch.tensor([-1.0, 1.0, -0.0, 0.0, float("-inf"), float("inf"), -3e-45])
    got = reference.topk_keys(v).tolist()
    s = 0x80000000
    assert got == [s - 0x3F800000, s + 0x3F800000, s, s, s - 0x7F800000, s + 0x7F800000, s - 2]
    got16 = reference.topk_keys(v.bfloat16()).tolist()
    assert got16 == [0x8000 - 0x3F80, 0x8000 + 0x3F80, 0x8000, 0x8000, 0x8000 - 0x7F80, 0x8000 + 0x7F80, 0x8000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ("random", "ties", "few", "huge_neg", "low_contrast"))
def test_reference_matches_torch_topk(dtype, kind):
    gen = torch.Generator().manual_seed(3)
    x = make_rows(kind, 5, 3000, dtype, gen)
    k = 512
    idx, val = reference.topk_indices(x, k, None, torch.full((5,), 3000, dtype=torch.int32), sorted=True,
                                      return_values=True)
    tv = torch.topk(x.float(), k, dim=1).values
    assert torch.equal(val.float(), tv)  # same values (the set up to ties)
    assert torch.equal(torch.gather(x, 1, idx.long()), val)
    # tie rule: within equal values, columns ascend; every unselected equal column is larger
    for r in range(5):
        kth = val[r, -1]
        sel = set(idx[r].tolist())
        eq_cols = (x[r] == kth).nonzero().flatten().tolist()
        taken = [c for c in eq_cols if c in sel]
        assert taken == eq_cols[: len(taken)]


def test_reference_ranges_modes_and_padding():
    x = torch.randn(4, 50)
    ks = torch.tensor([0, 10, 45, 30], dtype=torch.int32)
    ke = torch.tensor([50, 20, 45, 100], dtype=torch.int32)
    out = reference.topk_indices(x, 8, ks, ke, index_mode="absolute")
    assert (out[2] == -1).all()  # empty range
    assert (out[1] >= 10).all() and (out[1] < 20).all()
    rel = reference.topk_indices(x, 8, ks, ke)
    assert torch.equal(torch.where(rel >= 0, rel + ks[:, None], rel), out)
    # slot mode with the decode grouping and a block table
    ctx = torch.tensor([20, 33], dtype=torch.int32)
    bt = torch.tensor([[3, 1, 0, 0, 0], [2, 4, 6, 5, 7]], dtype=torch.int32)
    x2 = torch.randn(4, 40)
    s = reference.topk_indices(x2, 40, context_lens=ctx, next_n=2, index_mode="slot", block_table=bt, block_size=8)
    r = reference.topk_indices(x2, 40, context_lens=ctx, next_n=2)
    assert int((s[0] >= 0).sum()) == 19 and int((s[1] >= 0).sum()) == 20 and int((s[3] >= 0).sum()) == 33
    exp = torch.where(r >= 0, bt.repeat_interleave(2, 0).gather(1, (r.clamp_min(0) // 8).long()) * 8 + r.clamp_min(0) % 8, r)
    assert torch.equal(s, exp)


def _varlen_ids(runs, gen):
    """int32 request ids with consecutive runs of the given lengths (neighbouring runs differ)."""
    ids, prev = [], None
    for n in runs:
        rid = prev
        while rid == prev:
            rid = int(torch.randint(-2**31, 2**31 - 1, (1,), generator=gen))
        ids += [rid] * n
        prev = rid
    return torch.tensor(ids, dtype=torch.int32)


def test_reference_varlen_slot_uses_the_runs_first_table_row():
    gen = torch.Generator().manual_seed(3)
    runs = [1, 3, 40, 2, 1]
    m, n, bs = sum(runs), 300, 16
    ids = _varlen_ids(runs, gen)
    x = torch.randn(m, n, generator=gen)
    ctx = torch.randint(0, n + 1, (m,), generator=gen, dtype=torch.int32)
    bt = torch.randint(0, 10000, (m, n // bs + 1), generator=gen, dtype=torch.int32)
    first = torch.repeat_interleave(torch.tensor([sum(runs[:i]) for i in range(len(runs))]), torch.tensor(runs))
    got = reference.topk_indices(x, 64, context_lens=ctx, index_mode="slot", block_table=bt, block_size=bs, indices=ids)
    want = reference.topk_indices(x, 64, context_lens=ctx, index_mode="slot", block_table=bt[first], block_size=bs)
    assert torch.equal(got, want)
    assert not torch.equal(got, reference.topk_indices(x, 64, context_lens=ctx, index_mode="slot", block_table=bt,
                                                       block_size=bs))
    # the ids do not change the other modes
    for mode in ("relative", "absolute"):
        assert torch.equal(reference.topk_indices(x, 64, context_lens=ctx, index_mode=mode, indices=ids),
                           reference.topk_indices(x, 64, context_lens=ctx, index_mode=mode))


@pytest.mark.parametrize("S,chunk", [(37, 10), (37, 1), (40, 40), (40, 100), (0, 8)])
def test_fused_prefill_chunking_cpu(monkeypatch, S, chunk):
    # the chunk walk of fp8_mqa_topk_indices (the one-stream form, all a CPU can run), with the reference ops
    # standing in for the kernels: every row once, each chunk through the workspace, outputs sliced in place
    import deep_indexer.ops as ops
    from deep_indexer import quant

    gen = torch.Generator().manual_seed(S * 100 + chunk)
    H, D, SKV, k = 4, 32, 300, 16
    q = torch.randn(S, H, D, generator=gen).to(torch.float8_e4m3fn)
    kk, ksc = quant.per_token_cast_to_fp8(torch.randn(SKV, D, generator=gen))
    w = torch.randn(S, H, generator=gen)
    ks = torch.randint(-5, SKV, (S,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(-3, SKV, (S,), generator=gen, dtype=torch.int32)
    off = torch.randint(0, 100, (S,), generator=gen, dtype=torch.int32)
    rows_seen = []

    def fake_logits(q_, kv_, w_, ks_, ke_, clean, *, logits_dtype, out):
        assert out.shape == (q_.shape[0], SKV) and q_.shape[0] <= max(chunk, 1)
        rows_seen.append(q_.shape[0])
        out.copy_(reference.mqa_logits(q_, kv_, w_, ks_, ke_, False))
        return out

    def fake_topk(logits, k_, ks_, ke_, *, out, out_values, return_values, row_offset, **kw):
        r = reference.topk_indices(logits, k_, ks_, ke_, row_offset=row_offset, return_values=True, **kw)
        out.copy_(r[0])
        out_values.copy_(r[1])

    monkeypatch.setattr(ops, "fp8_mqa_logits", fake_logits)
    monkeypatch.setattr(ops, "topk_indices", fake_topk)
    got = ops.fp8_mqa_topk_indices(q, (kk, ksc), w, ks, ke, k, index_mode="absolute", row_offset=off,
                                   chunk_rows=chunk, return_values=True)
    assert sum(rows_seen) == S
    want = reference.topk_indices(reference.mqa_logits(q, (kk, ksc), w, ks, ke, False), k, ks, ke,
                                  index_mode="absolute", row_offset=off, return_values=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------------ validation (CPU tensors)
def _args(m=4, n=64):
    return torch.randn(m, n), torch.full((m,), n, dtype=torch.int32)


@pytest.mark.parametrize("k", [0, 2049, -1])
def test_validation_k(k):
    x, ke = _args()
    with pytest.raises(ValueError, match="k must be in"):
        di.topk_indices(x, k, None, ke)


def test_validation_arguments():
    x, ke = _args()
    with pytest.raises(ValueError, match="logits must have dtype"):
        di.topk_indices(x.half(), 4, None, ke)
    with pytest.raises(ValueError, match="stride 1"):
        di.topk_indices(x.t(), 4, None, ke)
    with pytest.raises(ValueError, match="cu_seq_len_k_end must have shape"):
        di.topk_indices(x, 4, None, ke[:3])
    with pytest.raises(ValueError, match="cu_seq_len_k_end must have dtype"):
        di.topk_indices(x, 4, None, ke.long())
    with pytest.raises(ValueError, match="required"):
        di.topk_indices(x, 4)
    with pytest.raises(ValueError, match="not both"):
        di.topk_indices(x, 4, None, ke, context_lens=ke)
    with pytest.raises(ValueError, match="context_lens must have shape"):
        di.topk_indices(x, 4, context_lens=torch.zeros(2, 3, dtype=torch.int32), next_n=2)
    with pytest.raises(ValueError, match="not a multiple of next_n"):
        di.topk_indices(x, 4, context_lens=ke, next_n=3)
    with pytest.raises(ValueError, match="index_mode"):
        di.topk_indices(x, 4, None, ke, index_mode="physical")
    with pytest.raises(ValueError, match="needs block_table"):
        di.topk_indices(x, 4, None, ke, index_mode="slot")
    with pytest.raises(ValueError, match="block_size"):
        di.topk_indices(x, 4, None, ke, index_mode="slot", block_table=torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="only used with"):
        di.topk_indices(x, 4, None, ke, block_table=torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="row_offset must have shape"):
        di.topk_indices(x, 4, None, ke, row_offset=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must have shape"):
        di.topk_indices(x, 4, None, ke, out=torch.zeros(4, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_values must have dtype"):
        di.topk_indices(x, 4, None, ke, return_values=True, out_values=torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="needs return_values"):
        di.topk_indices(x, 4, None, ke, out_values=torch.zeros(4, 4))
    ids = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="next_n must be 1"):
        di.topk_indices(x, 4, context_lens=ke[:2], next_n=2, indices=ids)
    with pytest.raises(ValueError, match="indices must have shape"):
        di.topk_indices(x, 4, None, ke, indices=ids[:3])
    with pytest.raises(ValueError, match="indices must have dtype"):
        di.topk_indices(x, 4, None, ke, indices=ids.long())
    with pytest.raises(ValueError, match="CUDA device"):
        di.topk_indices(x, 4, None, ke)


# ------------------------------------------------------------------------------------ GPU
def _check(x, k, ks, ke, **kw):
    """Runs the kernel (outputs poisoned first) and compares with the reference exactly; unsorted output
    in both forms: the buffered kernel (DI_TOPK_RESIDENT=0) and the resident one (=1) where a cluster
    can hold the rows (else the same buffered kernel again)."""
    if kw.get("sorted", False) or os.environ.get("DI_TOPK_RESIDENT") is not None:
        return _check_once(x, k, ks, ke, **kw)
    got = None
    for form in ("0", "1"):
        os.environ["DI_TOPK_RESIDENT"] = form
        try:
            res = _check_once(x, k, ks, ke, **kw)
        finally:
            del os.environ["DI_TOPK_RESIDENT"]
        assert got is None or torch.equal(res, got)
        got = res
    return got


def _check_once(x, k, ks, ke, **kw):
    m = x.shape[0]
    rv = kw.get("return_values", False)
    out = torch.full((m, k), -7, dtype=torch.int32, device=DEV)
    vals = torch.full((m, k), 1234.5, dtype=x.dtype, device=DEV) if rv else None
    dkw = {a: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for a, v in kw.items()}
    xd = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=DEV)  # keeps a padded row stride
    xd.copy_(x)
    assert xd.stride() == x.stride()
    res = di.topk_indices(xd, k, None if ks is None else ks.to(DEV), None if ke is None else ke.to(DEV),
                          out=out, out_values=vals, **dkw)
    ref = reference.topk_indices(x, k, ks, ke, **kw)
    if rv:
        assert res[0].data_ptr() == out.data_ptr() and res[1].data_ptr() == vals.data_ptr()
        torch.testing.assert_close(vals.cpu(), ref[1], rtol=0, atol=0, equal_nan=True)
        ref = ref[0]
    else:
        assert res.data_ptr() == out.data_ptr()
    got = out.cpu()
    bad = (got != ref).any(dim=1).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} rows differ, first row {int(bad[0])}: {got[bad[0]][:16].tolist()} vs {ref[bad[0]][:16].tolist()}"
    return got


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("m,n,k", [(3, 1, 1), (5, 100, 7), (8, 4099, 512), (6, 20000, 2048), (4, 70001, 1024)])
def test_topk_adversarial(dtype, kind, sorted_, m, n, k):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    pad = 3
    x = make_rows(kind, m, n + pad, dtype, gen)[:, :n]  # padded row stride
    ks = torch.randint(0, max(1, n // 4), (m,), generator=gen, dtype=torch.int32)
    ke = torch.randint(n // 2, n + 5, (m,), generator=gen, dtype=torch.int32)
    ks[0], ke[0] = 0, n  # a full row
    _check(x, k, ks, ke, sorted=sorted_, return_values=True)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("k", [512, 2048])
def test_topk_threshold_far_below_kth(k):
    # bfloat16 rows whose threshold lies more than 2047 keys below the k-th key (the one-pass selection's
    # overflow bin, then the two digits), next to random rows (one pass) and float32 copies of both
    gen = torch.Generator().manual_seed(k)
    m, n = 6, 30000
    rows = [far_threshold_row(n, 0, n, k, torch.float32, gen) for _ in range(m - 2)]
    rows += list(make_rows("random", 2, n, torch.float32, gen))
    x = torch.stack(rows)
    ke = torch.full((m,), n, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        _check(x.to(dtype), k, None, ke, return_values=True)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("k", [512, 2048])
def test_topk_rows_of_changing_scale(k):
    # more rows than CTAs, each scaled by its own power of two and shifted: a CTA's sample search, which
    # starts from its previous row's threshold, meets rows near it, ~12 binades away and across zero
    gen = torch.Generator().manual_seed(k + 5)
    m, n = 1500, 12000
    scale = 2.0 ** torch.randint(-12, 13, (m, 1), generator=gen).float()
    shift = torch.randint(-2, 3, (m, 1), generator=gen).float() * scale
    x = torch.randn(m, n, generator=gen) * scale + shift
    ke = torch.randint(n - 3000, n + 1, (m,), generator=gen, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        _check(x.to(dtype), k, None, ke)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [32768, 131072, 262144])
@pytest.mark.parametrize("kind", ["random", "low_contrast", "ties"])
def test_topk_long_rows(dtype, n, kind):
    gen = torch.Generator().manual_seed(n)
    x = make_rows(kind, 2, n, dtype, gen)
    _check(x, 2048, None, torch.tensor([n, n - 12345], dtype=torch.int32))


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 100, 512, 1024, 2047, 2048])
def test_topk_many_rows_random_ranges(k):
    # >= 2 rows per SM: the two-CTAs-per-SM launch with its smaller row cache (rows longer than it)
    gen = torch.Generator().manual_seed(k)
    m, n = 600, 30000
    x = make_rows("random", m, n, torch.float32, gen)
    ks = torch.randint(-100, n, (m,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(-50, n, (m,), generator=gen, dtype=torch.int32)
    _check(x, k, ks, ke, index_mode="absolute")
    _check(x.bfloat16(), k, ks, ke, sorted=True)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("mode", ["relative", "absolute", "slot"])
def test_topk_decode_grouping_and_modes(monkeypatch, next_n, two_d, mode):
    gen = torch.Generator().manual_seed(next_n * 10 + two_d)
    B, max_len = 9, 5000
    ctx = torch.randint(0, max_len + 1, (B,), generator=gen, dtype=torch.int32)
    ctx[0] = 0
    ctx[1] = max_len
    if two_d:
        ctx = (ctx[:, None] - torch.randint(0, 3, (B, next_n), generator=gen, dtype=torch.int32)).clamp_min(0)
    x = make_rows("ties", B * next_n, max_len, torch.float32, gen)
    kw = dict(context_lens=ctx, next_n=next_n, index_mode=mode, row_offset=torch.randint(0, 1000, (B * next_n,), generator=gen, dtype=torch.int32))
    if mode != "slot":
        _check(x, 512, None, None, **kw)
    for bs in (64, 48) if mode == "slot" else ():  # a power of two (a column's block by a shift) and not
        nblk = (max_len + bs - 1) // bs
        bt = torch.randperm(B * nblk, generator=gen).to(torch.int32).reshape(B, nblk)
        for resident in ("1", "0"):  # the resident kernel's cursor and the buffered kernel's per-entry mapping
            monkeypatch.setenv("DI_TOPK_RESIDENT", resident)
            _check(x, 512, None, None, block_table=bt[:, : nblk - 3], block_size=bs, **kw)  # short table: -1 past it


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("runs", [[1] * 7, [2, 5, 1, 3], [40, 1, 70, 3]], ids=["ones", "mixed", "long_runs"])
@pytest.mark.parametrize("cluster", ["0", "4", "two_per_sm"])
def test_topk_varlen_slot(monkeypatch, runs, cluster):
    # a row's block-table row is the first row of its run of equal ids (runs longer than the 32-id look-back
    # window too); the other rows of the table hold garbage that must not be read. two_per_sm: the resident
    # form of two 512-thread CTAs per SM, whose k = 2048 entries are mapped when staged in shared memory
    if cluster == "two_per_sm":
        monkeypatch.setenv("DI_TOPK_RESIDENT_CTAS_PER_SM", "2")
    elif cluster != "0":
        monkeypatch.setenv("DI_TOPK_CLUSTER", cluster)
    gen = torch.Generator().manual_seed(len(runs))
    m, n, bs = sum(runs), 9000, 32
    ids = _varlen_ids(runs, gen)
    x = make_rows("random", m, n, torch.float32, gen)
    ctx = torch.randint(0, n + 1, (m,), generator=gen, dtype=torch.int32)
    ctx[0] = n
    bt = torch.randint(-2**31, 2**31 - 1, (m, n // bs + 1), generator=gen, dtype=torch.int32)
    starts = [sum(runs[:i]) for i in range(len(runs))]
    bt[starts] = torch.randint(0, 1 << 20, (len(runs), bt.shape[1]), generator=gen, dtype=torch.int32)
    off = torch.randint(0, 1000, (m,), generator=gen, dtype=torch.int32)
    for k in (2048, 100):
        _check(x, k, None, None, context_lens=ctx, index_mode="slot", block_table=bt, block_size=bs, indices=ids,
               row_offset=off)
    _check(x, 512, None, None, context_lens=ctx[:, None].contiguous(), index_mode="relative", indices=ids)


@requires_sm90
@pytest.mark.gpu
def test_topk_deterministic_and_graph_replay():
    gen = torch.Generator().manual_seed(5)
    m, n, k = 64, 8192, 2048
    x = make_rows("ties", m, n, torch.float32, gen).to(DEV)
    ke = torch.full((m,), n, dtype=torch.int32, device=DEV)
    first = di.topk_indices(x, k, None, ke)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(5):
            assert torch.equal(di.topk_indices(x, k, None, ke), first)
    torch.cuda.synchronize()
    out = torch.full((m, k), -7, dtype=torch.int32, device=DEV)
    di.topk_indices(x, k, None, ke, out=out)  # warm up (module load) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        di.topk_indices(x, k, None, ke, out=out)
    for seed in range(3):
        x.copy_(make_rows("random", m, n, torch.float32, torch.Generator().manual_seed(seed)))
        ke.copy_(torch.randint(0, n + 1, (m,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), reference.topk_indices(x.cpu(), k, None, ke.cpu()))


@requires_sm90
@pytest.mark.gpu
def test_topk_torch_op_and_compile():
    x = torch.randn(16, 3000, device=DEV)
    ke = torch.full((16,), 3000, dtype=torch.int32, device=DEV)
    a = torch.ops.deep_indexer.topk_indices(x, 512, None, ke)
    f = torch.compile(lambda t, e: di.topk_indices(t, 512, None, e, sorted=True), fullgraph=True)
    b = f(x, ke)
    assert torch.equal(a.cpu(), reference.topk_indices(x.cpu(), 512, None, ke.cpu()))
    assert torch.equal(b.cpu(), reference.topk_indices(x.cpu(), 512, None, ke.cpu(), sorted=True))


# ------------------------------------------------------------------------------------ logits -> top-k in one call
@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("next_n,two_d", [(1, False), (2, False), (2, True), (4, True)])
@pytest.mark.parametrize("mode", ["relative", "slot"])
def test_fused_decode_matches_standalone(next_n, two_d, mode):
    from deep_indexer.bench import decode_inputs

    B, avg, H, D, block_kv, k = 12, 6000, 64, 128, 64, 2048
    x = decode_inputs(B, next_n, avg, H, D, block_kv, DEV, seed=next_n)
    ctx = x["context_lens"]
    if two_d:
        ctx = (ctx[:, None] - torch.arange(next_n, 0, -1, device=DEV, dtype=torch.int32)[None, :] + 1).contiguous()
    meta = di.get_paged_mqa_logits_metadata(ctx, block_kv)
    logits = di.fp8_paged_mqa_logits(x["q"], x["kv_cache"], x["weights"], ctx, x["block_table"], meta,
                                     x["max_context_len"], False)
    slot = mode == "slot"
    want = di.topk_indices(logits, k, context_lens=ctx, next_n=next_n, index_mode=mode,
                           block_table=x["block_table"] if slot else None, block_size=block_kv if slot else None)
    ws = di.topk_workspace(B * next_n, x["max_context_len"] + 100, device=DEV)
    out = torch.full((B * next_n, k), -7, dtype=torch.int32, device=DEV)
    got = di.fp8_paged_mqa_topk_indices(x["q"], x["kv_cache"], x["weights"], ctx, x["block_table"], meta,
                                        x["max_context_len"], k, index_mode=mode, workspace=ws, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want)
    # and the standalone top-k itself against the reference on the same logits
    ref = reference.topk_indices(logits.cpu(), k, context_lens=ctx.cpu(), next_n=next_n, index_mode=mode,
                                 block_table=x["block_table"].cpu() if slot else None,
                                 block_size=block_kv if slot else None)
    assert torch.equal(want.cpu(), ref)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("sm_share", ["third", "all_but_one", "all", "twice"])
def test_fused_decode_schedule_sm_counts(sm_share):
    # a schedule for fewer SMs than the GPU's (the logits kernel then lets the top-k launch only at its end),
    # for all of them and for more (both let it launch at once): the same indices as the composition
    from deep_indexer.bench import decode_inputs

    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    num_sms = {"third": sms // 3, "all_but_one": sms - 1, "all": sms, "twice": 2 * sms}[sm_share]
    B, next_n, avg, H, D, block_kv, k = 40, 2, 6000, 64, 128, 64, 1024
    x = decode_inputs(B, next_n, avg, H, D, block_kv, DEV, seed=num_sms)
    ctx = x["context_lens"]
    meta = di.get_paged_mqa_logits_metadata(ctx, block_kv, num_sms)
    assert meta.shape[0] == num_sms + 1
    logits = di.fp8_paged_mqa_logits(x["q"], x["kv_cache"], x["weights"], ctx, x["block_table"], meta,
                                     x["max_context_len"], False)
    want = di.topk_indices(logits, k, context_lens=ctx, next_n=next_n)
    out = torch.full((B * next_n, k), -7, dtype=torch.int32, device=DEV)
    for _ in range(3):
        out.fill_(-7)
        got = di.fp8_paged_mqa_topk_indices(x["q"], x["kv_cache"], x["weights"], ctx, x["block_table"], meta,
                                            x["max_context_len"], k, out=out)
        assert torch.equal(got, want)
    ref = reference.topk_indices(logits.cpu(), k, context_lens=ctx.cpu(), next_n=next_n)
    assert torch.equal(want.cpu(), ref)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("next_n,H,D,block_kv", [(3, 32, 64, 32), (8, 16, 128, 64), (5, 128, 64, 32), (1, 32, 128, 32)])
def test_fused_decode_heads_dims_blocks(next_n, H, D, block_kv):
    from deep_indexer.bench import decode_inputs

    B, avg, k = 5, 3000, 1024
    x = decode_inputs(B, next_n, avg, H, D, block_kv, DEV, seed=next_n * H + D)
    ctx = x["context_lens"]
    meta = di.get_paged_mqa_logits_metadata(ctx, block_kv)
    logits = di.fp8_paged_mqa_logits(x["q"], x["kv_cache"], x["weights"], ctx, x["block_table"], meta,
                                     x["max_context_len"], False)
    for mode in ("relative", "slot"):
        slot = mode == "slot"
        kw = dict(index_mode=mode, block_table=x["block_table"] if slot else None, block_size=block_kv if slot else None)
        want = di.topk_indices(logits, k, context_lens=ctx, next_n=next_n, **kw)
        got = di.fp8_paged_mqa_topk_indices(x["q"], x["kv_cache"], x["weights"], ctx, x["block_table"], meta,
                                            x["max_context_len"], k, index_mode=mode)
        assert torch.equal(got, want), mode
        ref = reference.topk_indices(logits.cpu(), k, context_lens=ctx.cpu(), next_n=next_n, index_mode=mode,
                                     block_table=x["block_table"].cpu() if slot else None,
                                     block_size=block_kv if slot else None)
        assert torch.equal(want.cpu(), ref), mode


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("two_d", [False, True])
def test_fused_decode_varlen(two_d):
    # varlen rows (indices): one q row per request token, runs of equal ids; the block table's rows other
    # than each run's first hold garbage
    from deep_indexer.bench import varlen_inputs

    x = varlen_inputs(6, 37, 3000, 64, 128, 64, DEV, seed=4)  # runs of 37 rows: past the 32-id look-back window
    ids, ctx, R, k = x["indices"], x["context_lens"], x["q"].shape[0], 2048
    if two_d:
        ctx = ctx[:, None].contiguous()
    table = x["block_table"].clone()
    junk = torch.ones(R, dtype=torch.bool, device=DEV)
    junk[::37] = False
    table[junk] = torch.randint(-2**31, 2**31 - 1, (int(junk.sum()), table.shape[1]), dtype=torch.int32, device=DEV)
    meta = di.get_paged_mqa_logits_metadata(ctx, 64, indices=ids)
    logits = di.fp8_paged_mqa_logits(x["q"], x["kv_cache"], x["weights"], ctx, table, meta, x["max_context_len"],
                                     False, indices=ids)
    ws = di.topk_workspace(R, x["max_context_len"], device=DEV)
    for mode in ("relative", "slot"):
        slot = mode == "slot"
        kw = dict(index_mode=mode, block_table=table if slot else None, block_size=64 if slot else None)
        want = di.topk_indices(logits, k, context_lens=ctx, indices=ids, **kw)
        out = torch.full((R, k), -7, dtype=torch.int32, device=DEV)
        got = di.fp8_paged_mqa_topk_indices(x["q"], x["kv_cache"], x["weights"], ctx, table, meta,
                                            x["max_context_len"], k, index_mode=mode, workspace=ws, out=out,
                                            indices=ids)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got, want), mode
        ref = reference.topk_indices(logits.cpu(), k, context_lens=ctx.cpu(), index_mode=mode, indices=ids.cpu(),
                                     block_table=table.cpu() if slot else None, block_size=64 if slot else None)
        assert torch.equal(want.cpu(), ref), mode
        if slot:  # every selected slot lies in a block of the request's own (first-row) table
            req_blocks = set(x["block_table"][::37].flatten().tolist())
            assert set((got[got >= 0] // 64).tolist()) <= req_blocks


@requires_sm90
@pytest.mark.gpu
def test_stream_order_with_programmatic_launches(monkeypatch):
    # PDL lets each of our kernels start while the previous kernel of the stream finishes; each must
    # still see the inputs that torch kernels wrote just before it and must not overwrite an output
    # that a torch kernel is still reading. Inputs alternate between two cases, rewritten in place.
    from deep_indexer.bench import decode_inputs

    B, next_n, avg, H, D, block_kv, k = 16, 2, 9000, 64, 128, 64, 2048
    a = decode_inputs(B, next_n, avg, H, D, block_kv, DEV, seed=1)
    b = dict(a)  # the same layout, other contents: q, weights, cache values, shorter context lengths
    b["q"] = torch.randn(a["q"].shape, device=DEV).to(torch.float8_e4m3fn)
    b["weights"] = torch.randn_like(a["weights"])
    b["kv_cache"] = a["kv_cache"].clone()
    b["kv_cache"].view(a["kv_cache"].shape[0], -1)[:, : block_kv * D].copy_(
        torch.randn(a["kv_cache"].shape[0], block_kv * D, device=DEV).to(torch.float8_e4m3fn).view(torch.uint8))
    b["context_lens"] = (a["context_lens"] - torch.randint(0, 3000, (B,), device=DEV, dtype=torch.int32)).clamp(min=next_n)
    cases = [a, b]
    mcl = a["max_context_len"]
    names = ("q", "kv_cache", "weights", "context_lens", "block_table")
    want = []
    monkeypatch.setenv("DI_PDL", "0")
    for c in cases:
        meta = di.get_paged_mqa_logits_metadata(c["context_lens"], block_kv)
        logits = di.fp8_paged_mqa_logits(c["q"], c["kv_cache"], c["weights"], c["context_lens"], c["block_table"],
                                         meta, mcl, False)
        want.append((di.topk_indices(logits, k, context_lens=c["context_lens"], next_n=next_n), logits))
    for pdl in ("1", "0"):
        monkeypatch.setenv("DI_PDL", pdl)
        live = {n: torch.empty_like(cases[0][n]) for n in names}
        ws = di.topk_workspace(B * next_n, mcl, device=DEV)
        out = torch.full((B * next_n, k), -7, dtype=torch.int32, device=DEV)
        logits_live = torch.empty_like(want[0][1])
        prev = None
        for step in range(6):
            c = step % 2
            for n in names:  # torch kernels right before ours
                live[n].copy_(cases[c][n])
            seen = out.clone()  # read by a torch kernel while our next call may already start
            meta = di.get_paged_mqa_logits_metadata(live["context_lens"], block_kv)
            di.fp8_paged_mqa_topk_indices(live["q"], live["kv_cache"], live["weights"], live["context_lens"],
                                          live["block_table"], meta, mcl, k, workspace=ws, out=out)
            if prev is not None:
                assert torch.equal(seen, want[prev][0]), (pdl, step)
            assert torch.equal(out, want[c][0]), (pdl, step)
            logits_live.copy_(want[1 - c][1])  # the standalone top-k right after a torch write of its input
            got = di.topk_indices(logits_live, k, context_lens=cases[1 - c]["context_lens"], next_n=next_n)
            assert torch.equal(got, want[1 - c][0]), (pdl, step)
            prev = c


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["causal", "cp"])
@pytest.mark.parametrize("k,chunk", [(2048, None), (512, 300), (100, 3), (2048, 1023)])
@pytest.mark.parametrize("overlap", [True, False])
def test_fused_prefill_matches_standalone(pattern, k, chunk, overlap):
    from deep_indexer.bench import prefill_inputs

    S, SKV, H, D = 1024, 8192, 64, 128
    x = prefill_inputs(S, SKV, pattern, H, D, DEV)
    logits = di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], False)
    want = di.topk_indices(logits, k, x["ks"], x["ke"], return_values=True)
    out = torch.full((S, k), -7, dtype=torch.int32, device=DEV)
    got = di.fp8_mqa_topk_indices(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], k, chunk_rows=chunk,
                                  return_values=True, out=out, overlap=overlap)
    # the caller's stream sees the result without a device-wide synchronization (the side stream joined it)
    assert got[0].data_ptr() == out.data_ptr()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = reference.topk_indices(logits.cpu(), k, x["ks"].cpu(), x["ke"].cpu())
    assert torch.equal(want[0].cpu(), ref)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("H,D", [(16, 64), (32, 32), (32, 128), (128, 128), (64, 64)])
def test_fused_prefill_heads_dims_ragged(H, D):
    # every supported head count / dim, ragged per-row ranges (empty, reversed, negative starts, ends past
    # SKV), absolute indices with a row offset, chunks on one stream and on two
    from deep_indexer import quant

    gen = torch.Generator().manual_seed(H * 1000 + D)
    S, SKV, k = 700, 5000, 300
    q = torch.randn(S, H, D, generator=gen).to(DEV).to(torch.float8_e4m3fn)
    kk, ksc = quant.per_token_cast_to_fp8(torch.randn(SKV, D, generator=gen).to(DEV))
    w = torch.randn(S, H, generator=gen).to(DEV)
    ks = torch.randint(-50, SKV, (S,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(-20, SKV // 2, (S,), generator=gen, dtype=torch.int32)
    ke[:5] = torch.tensor([SKV + 100, 0, SKV, 1, 7], dtype=torch.int32)
    ks, ke = ks.to(DEV), ke.to(DEV)
    off = torch.randint(0, 1 << 20, (S,), generator=gen, dtype=torch.int32).to(DEV)
    logits = di.fp8_mqa_logits(q, (kk, ksc), w, ks, ke, False)
    want = di.topk_indices(logits, k, ks, ke, index_mode="absolute", row_offset=off)
    for overlap, chunk in ((True, 256), (False, 256), (True, None)):
        got = di.fp8_mqa_topk_indices(q, (kk, ksc), w, ks, ke, k, index_mode="absolute", row_offset=off,
                                      chunk_rows=chunk, overlap=overlap)
        assert torch.equal(got, want), (overlap, chunk)
    ref = reference.topk_indices(logits.cpu(), k, ks.cpu(), ke.cpu(), index_mode="absolute", row_offset=off.cpu())
    assert torch.equal(want.cpu(), ref)


@requires_sm90
@pytest.mark.gpu
def test_fused_prefill_overlapped_graph_replay():
    # the two-stream chunks inside a CUDA graph on a non-default stream, replayed on new inputs
    from deep_indexer.bench import prefill_inputs

    S, SKV, H, D, k, chunk = 600, 4096, 64, 128, 256, 200
    x = prefill_inputs(S, SKV, "causal", H, D, DEV)
    ws = di.topk_workspace(chunk, SKV, device=DEV)
    out = torch.full((S, k), -7, dtype=torch.int32, device=DEV)
    run = lambda: di.fp8_mqa_topk_indices(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], k, workspace=ws, out=out)
    run()  # loads the kernels
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        with torch.cuda.graph(g, stream=st):
            run()
    torch.cuda.current_stream().wait_stream(st)
    for seed in (1, 2):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        x["q"].copy_(torch.randn(S, H, D, device=DEV, generator=gen).to(torch.float8_e4m3fn))
        out.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        logits = di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], False)
        assert torch.equal(out, di.topk_indices(logits, k, x["ks"], x["ke"])), seed


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("cluster", ["1", "2", "4", "8"])
@pytest.mark.parametrize("wide", ["0", "1"])
@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_topk_forced_clusters(monkeypatch, cluster, wide, sorted_, kind):
    # every cluster size (sorted output always runs one CTA per row) and block size on rows of every
    # length class (direct, sampled, longer than a window), misaligned starts and a padded row stride
    monkeypatch.setenv("DI_TOPK_CLUSTER", cluster)
    monkeypatch.setenv("DI_TOPK_WIDE", wide)
    gen = torch.Generator().manual_seed(int(cluster) * 10 + sorted_)
    m, n = 7, 200000
    x = make_rows(kind, m, n + 5, torch.float32, gen)[:, 3:n + 3]
    ks = torch.tensor([0, 17, 1000, 5, 199990, 3, 0], dtype=torch.int32)
    ke = torch.tensor([n, n - 3, 150000, 2000, n, 4100, 9000], dtype=torch.int32)
    _check(x, 2048, ks, ke, sorted=sorted_, index_mode="absolute", return_values=True)
    _check(x.bfloat16(), 512, ks, ke, sorted=sorted_)


def _one_launch_line(capfd, needle, run):
    """Runs `run()` and returns the one DI_JIT_DEBUG launch line holding `needle` that it printed (a line is
    printed once per shape and process: each case needs a shape of its own)."""
    capfd.readouterr()
    run()
    lines = [ln for ln in capfd.readouterr().err.splitlines() if needle in ln]
    assert len(lines) == 1, lines
    return lines[0]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("cluster,wide,sorted_", [("1", "1", False), ("2", "1", False), ("2", "0", False),
                                                  ("1", "1", True)])
def test_topk_buffered_row_per_cta_launch(monkeypatch, capfd, cluster, wide, sorted_):
    # unsorted wide CTAs and clusters run one row each: the grid is rows x C, also (forced) past the rows the GPU
    # holds at once; sorted output keeps rows in turn (a grid of at most the SMs). Results exact either way.
    monkeypatch.setenv("DI_JIT_DEBUG", "1")
    monkeypatch.setenv("DI_TOPK_RESIDENT", "0")
    monkeypatch.setenv("DI_TOPK_CLUSTER", cluster)
    monkeypatch.setenv("DI_TOPK_WIDE", wide)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    c = int(cluster)
    m = sms + 3 + c + 4 * (wide == "0") + 8 * sorted_  # more rows than clusters at once; a launch line of its own
    n = 40000
    gen = torch.Generator().manual_seed(970 + m)
    x = make_rows("random", m, n, torch.float32, gen)
    ke = torch.randint(n // 2, n + 1, (m,), generator=gen, dtype=torch.int32)
    ke[1], ke[4] = 0, 1000  # an empty row; fewer keys than k
    line = _one_launch_line(capfd, f"topk rows={m} cols={n} ", lambda: _check_once(x, 2048, None, ke, sorted=sorted_))
    grid = min(m, sms) if sorted_ else m * c
    assert f"grid {grid}, cluster {c}," in line, line


PACKED_KINDS = ("random", "ties", "low_contrast", "small_bins", "neginf", "few")


def _check_packed_form(capfd, x, ks, ke, sorted_, want):
    """Both calls of a packed-survivor case against the reference, then the launch line: one word (", packed")
    exactly when `want`. DI_JIT_DEBUG prints a line once per process: each case needs rows of its own count."""
    m, n = x.shape
    capfd.readouterr()
    _check(x, 2048, ks, ke, sorted=sorted_, index_mode="absolute", return_values=True)
    _check(x, 512, ks, ke, sorted=sorted_)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if f"topk rows={m} cols={n} elem_bytes=2" in ln]
    assert lines, "no launch line for the shape"
    assert all(ln.endswith(", packed") == want for ln in lines), (n, lines)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("packed", ["0", "1"])
@pytest.mark.parametrize("wide", ["0", "1"])
@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_topk_packed_survivors(monkeypatch, capfd, packed, wide, sorted_, kind):
    # bfloat16 survivors kept in one word (key, position from the row's first 16-byte vector) up to 65529
    # columns, two words above that or with DI_TOPK_PACKED=0. A row stride of 65535 misaligns the rows'
    # starts (row 1 by 7 elements: its last column sits at position 65535, the largest that fits); rows
    # kept whole (< 4096 keys), sampled, and falling back to the whole-row select (ties, few: more
    # survivors than the buffer, some stored by the per-survivor walk).
    monkeypatch.setenv("DI_TOPK_PACKED", packed)
    monkeypatch.setenv("DI_TOPK_WIDE", wide)
    monkeypatch.setenv("DI_TOPK_RESIDENT", "0")
    monkeypatch.setenv("DI_TOPK_CLUSTER", "1")  # (a few long rows would take clusters, which keep two words)
    monkeypatch.setenv("DI_JIT_DEBUG", "1")
    case = PACKED_KINDS.index(kind) * 8 + int(packed) * 4 + int(wide) * 2 + sorted_
    gen = torch.Generator().manual_seed(case)
    m = 7 + case  # a launch line of its own for each case
    for n in (65529, 65530):
        x = make_rows(kind, m, 65535, torch.bfloat16, gen)[:, :n]
        x[1, -8:] = 100.0  # the last positions of row 1 are selected
        ks = torch.tensor([0, 0, 3, 60000, 0, 100, 9] + [5] * (m - 7), dtype=torch.int32)
        ke = torch.tensor([n, n, n - 1, n, 5000, 3100, n] + [n] * (m - 7), dtype=torch.int32)
        _check_packed_form(capfd, x, ks, ke, sorted_, want=packed == "1" and n == 65529)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_topk_packed_aligned_rows(monkeypatch, capfd, sorted_, kind):
    # rows whose column 0 is 16-byte aligned (aligned base and row stride) keep one word per survivor up to
    # 65536 columns, with or without cu_seq_len_k_start (a start's misalignment is at most the columns before
    # it: the last column sits at position 65535); a misaligned row stride at 65536 columns, or 65537 columns,
    # keeps two words
    monkeypatch.setenv("DI_TOPK_RESIDENT", "0")
    monkeypatch.setenv("DI_TOPK_CLUSTER", "1")
    monkeypatch.setenv("DI_JIT_DEBUG", "1")
    gen = torch.Generator().manual_seed(77 + 2 * sorted_ + (kind == "ties"))
    base = 60 + 8 * (2 * (kind == "ties") + sorted_)  # a launch line of its own for each case
    for i, (n, width, with_ks, want) in enumerate(((65536, 65536, False, True), (65536, 65536, True, True),
                                                   (65536, 65537, False, False), (65536, 65537, True, False),
                                                   (65537, 65544, False, False))):
        m = base + i
        x = make_rows(kind, m, width, torch.bfloat16, gen)[:, :n]
        x[:2, -8:] = 100.0  # the last positions of rows 0 and 1 are selected
        ke = torch.tensor([n, n, n - 1, 40000, 5] + [n - 3] * (m - 5), dtype=torch.int32)
        # starts 0, 7 (the row's end at position 65535), then every misalignment
        ks = torch.tensor([0, 7, 9] + torch.randint(0, 64, (m - 3,), generator=gen).tolist(),
                          dtype=torch.int32).minimum(ke) if with_ks else None
        _check_packed_form(capfd, x, ks, ke, sorted_, want)


def _check_resident_rows(kind, m, n_max, dtype, gen):
    """m rows of up to n_max keys (misaligned starts, the longest row whole, an empty one, one of fewer
    than k keys) through k = 2048 absolute with offsets, k = 333 with values, and k = 1024 and 2048 slots (CTAs
    of 256 or 512 threads stage the k = 2048 entries in shared memory), also through blocks of 4 columns."""
    x = make_rows(kind, m, n_max + 8, dtype, gen)[:, 1:n_max + 1]
    ks = torch.randint(0, 40, (m,), generator=gen, dtype=torch.int32)
    ke = torch.randint(n_max // 2, n_max + 5, (m,), generator=gen, dtype=torch.int32)
    ke[0], ks[0] = n_max, 0
    ke[1 % m] = ks[1 % m]  # empty
    ke[2 % m] = ks[2 % m] + 100  # fewer keys than k
    off = torch.randint(-1000, 1000, (m,), generator=gen, dtype=torch.int32)
    _check(x, 2048, ks, ke, index_mode="absolute", row_offset=off)
    _check(x, 333, ks, ke, return_values=True)
    ctx = torch.randint(1, n_max + 1, (m,), generator=gen, dtype=torch.int32)
    bt = torch.randperm(m * ((n_max + 63) // 64), generator=gen).to(torch.int32).view(m, -1)
    _check(x, 1024, None, None, context_lens=ctx, index_mode="slot", block_table=bt, block_size=64)
    _check(x, 2048, None, None, context_lens=ctx, index_mode="slot", block_table=bt, block_size=64)
    # blocks of 4 columns: a thread's consecutive columns cross several blocks (the slot cursor steps over them)
    bt4 = torch.randperm(m * ((n_max + 3) // 4), generator=gen).to(torch.int32).view(m, -1)
    _check(x, 1024, None, None, context_lens=ctx, index_mode="slot", block_table=bt4, block_size=4)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("threads,keys", [("1024", "4"), ("1024", "8"), ("1024", "12"), ("1024", "16"), ("1024", "32"),
                                          ("512", "8"), ("512", "16"), ("512", "24"), ("256", "16"), ("256", "24")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "ties", "equal", "low_contrast", "nan", "small_bins"])
@pytest.mark.parametrize("m", [3, 300])
def test_topk_resident_forced(monkeypatch, threads, keys, dtype, kind, m):
    # the resident form on every cluster size it takes (rows up to 8 CTAs' keys), more rows than SMs (one CTA
    # per SM: rows in turn, both row parities; clusters: a cluster per row, more than fit at once), misaligned
    # starts, empty rows, rows of fewer than k keys;
    # keys per thread the form cannot hold (bfloat16: 4, 12; float32: 32 at 1024 threads) leave it to the
    # buffered kernel
    monkeypatch.setenv("DI_TOPK_RESIDENT", "1")
    monkeypatch.setenv("DI_TOPK_RESIDENT_KEYS", keys)
    monkeypatch.setenv("DI_TOPK_RESIDENT_THREADS", threads)
    per_cta = int(threads) * int(keys)
    gen = torch.Generator().manual_seed(int(keys) + m + len(kind))
    for n_max in (per_cta - 8, 2 * per_cta - 8, 5 * per_cta, 8 * per_cta - 8):
        if m == 300 and n_max > 2 * per_cta:
            continue  # keeps the reference's time down; the cluster sizes are covered by m = 3
        _check_resident_rows(kind, m, n_max, dtype, gen)


# (CTAs per SM, dtype, keys per thread) of the forms with several CTAs per SM: 512 threads for two, 256 for four
PER_SM_FORMS = [("2", torch.float32, "4"), ("2", torch.float32, "12"), ("2", torch.float32, "24"),
                ("2", torch.bfloat16, "8"), ("2", torch.bfloat16, "16"), ("2", torch.bfloat16, "24"),
                ("2", torch.bfloat16, "32"), ("4", torch.float32, "4"), ("4", torch.float32, "12"),
                ("4", torch.float32, "20"), ("4", torch.bfloat16, "8"), ("4", torch.bfloat16, "16"),
                ("4", torch.bfloat16, "32")]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("per_sm,dtype,keys", PER_SM_FORMS)
@pytest.mark.parametrize("kind", ["random", "ties", "equal", "low_contrast", "nan", "small_bins"])
@pytest.mark.parametrize("many", [False, True])
def test_topk_resident_per_sm(monkeypatch, per_sm, dtype, keys, kind, many):
    # the resident forms with two 512-thread or four 256-thread CTAs per SM (forced; bfloat16 keys packed two
    # per register, float32 up to its register budget: 24 keys a thread at 512 threads, 20 at 256): rows up to
    # one CTA's keys, 3 rows or more rows than the SMs hold CTAs at once (a CTA per row, dealt by the hardware),
    # misaligned starts, empty rows, rows of fewer than k keys, every index mode
    monkeypatch.setenv("DI_TOPK_RESIDENT_CTAS_PER_SM", per_sm)
    monkeypatch.setenv("DI_TOPK_RESIDENT_KEYS", keys)
    per_cta = 1024 // int(per_sm) * int(keys)
    m = 150 * int(per_sm) if many else 3
    gen = torch.Generator().manual_seed(int(keys) + m + len(kind) + (4 if per_sm == "4" else 0))
    for n_max in (per_cta - 8, per_cta // 2 + 3):
        _check_resident_rows(kind, m, n_max, dtype, gen)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_max,per_sm", [(4000, 4), (10000, 2)])
def test_topk_resident_several_per_sm_launch_a_cta_per_row(monkeypatch, capfd, dtype, n_max, per_sm):
    # by default, past 2 x SMs rows of at most 4K (10K) keys at k = 512 take the four- (two-) CTA form with one
    # CTA per row (the grid as large as the rows: the hardware deals them), and the results stay exact
    monkeypatch.setenv("DI_JIT_DEBUG", "1")
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    m = 4 * sms + 3 + per_sm  # more rows than the SMs hold CTAs of either form at once; a launch line of its own
    gen = torch.Generator().manual_seed(900 + per_sm + (dtype == torch.bfloat16))
    x = make_rows("random", m, n_max, dtype, gen)
    ke = torch.randint(n_max * 7 // 10, n_max + 1, (m,), generator=gen, dtype=torch.int32)
    ke[1] = 100  # fewer keys than k
    line = _one_launch_line(capfd, f"topk resident rows={m} ", lambda: _check_once(x, 512, None, ke))
    assert f"grid {m}, cluster 1," in line and f"{per_sm} per SM" in line, line


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_resident_clusters_launch_a_cluster_per_row(monkeypatch, capfd, dtype):
    # clusters take one row each: the grid is rows x C CTAs, also (forced) past the clusters the GPU holds at
    # once, and the results stay exact
    monkeypatch.setenv("DI_JIT_DEBUG", "1")
    monkeypatch.setenv("DI_TOPK_RESIDENT", "1")
    monkeypatch.setenv("DI_TOPK_RESIDENT_THREADS", "256")
    monkeypatch.setenv("DI_TOPK_RESIDENT_KEYS", "16")
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    m = sms + 5 + (dtype == torch.bfloat16)  # a launch line of its own
    n_max = 3 * 256 * 16 - 8  # three CTAs a row
    gen = torch.Generator().manual_seed(950 + (dtype == torch.bfloat16))
    x = make_rows("random", m, n_max, dtype, gen)
    ke = torch.randint(n_max * 7 // 10, n_max + 1, (m,), generator=gen, dtype=torch.int32)
    ke[0], ke[2] = 100, 0  # fewer keys than k; an empty row
    line = _one_launch_line(capfd, f"topk resident rows={m} ", lambda: _check_once(x, 2048, None, ke))
    assert f"grid {3 * m}, cluster 3," in line, line


FULL_ROW_FORMS = [("4", 256, torch.bfloat16, 32), ("4", 256, torch.float32, 20), ("2", 512, torch.bfloat16, 32),
                  ("2", 512, torch.float32, 24), ("1", 1024, torch.bfloat16, 16), ("1", 1024, torch.float32, 8)]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("per_sm,threads,dtype,keys", FULL_ROW_FORMS)
def test_topk_resident_full_rows_from_any_start(monkeypatch, capfd, per_sm, threads, dtype, keys):
    # rows whose column 0 is 16-byte aligned span at most the vectors of their columns, whatever their start
    # (cu_seq_len_k_start): rows of exactly one CTA's keys, from every misalignment to the last column, take
    # one CTA of that form; with a misaligned row stride a start may need one vector more, and it is not taken
    if per_sm == "1":
        monkeypatch.setenv("DI_TOPK_RESIDENT", "1")
        monkeypatch.setenv("DI_TOPK_RESIDENT_THREADS", str(threads))
    else:
        monkeypatch.setenv("DI_TOPK_RESIDENT_CTAS_PER_SM", per_sm)
    monkeypatch.setenv("DI_TOPK_RESIDENT_KEYS", str(keys))
    monkeypatch.setenv("DI_JIT_DEBUG", "1")
    n = threads * keys
    vec = 16 // torch.tensor([], dtype=dtype).element_size()
    case = FULL_ROW_FORMS.index((per_sm, threads, dtype, keys))
    gen = torch.Generator().manual_seed(500 + case)
    for aligned in (True, False):
        m = 41 + 2 * case + (not aligned)  # a launch line of its own for each case
        x = make_rows("random", m, n + 1, dtype, gen)
        # row stride n (aligned) or n + 1 (rows past the first misaligned)
        x = x[:, :n].contiguous() if aligned else x[:, 1:]
        ks = torch.tensor([0, vec - 1, 1, n - 5, n] + torch.randint(0, 4 * vec, (m - 5,), generator=gen).tolist(),
                          dtype=torch.int32)
        ke = torch.full((m,), n, dtype=torch.int32)
        ke[5] = ks[5] + 700  # a row of fewer than 2048 keys
        capfd.readouterr()
        _check_once(x, 2048, ks, ke, index_mode="absolute")
        _check_once(x, 512, ks, ke, return_values=True)
        vecs = n // vec + (not aligned)
        lines = [ln for ln in capfd.readouterr().err.splitlines() if f"topk resident rows={m} vecs={vecs} " in ln]
        assert len(lines) == 2, lines
        form = f"cluster 1, {threads} threads x {keys} keys, {per_sm} per SM"
        assert all((form in ln) == aligned for ln in lines), (aligned, lines)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form,threads,keys,ctas", [("two", 512, 24, 1), ("two", 512, 16, 1), ("one", 1024, 8, 1),
                                                    ("one", 1024, 16, 1), ("cluster", 256, 16, 3),
                                                    ("cluster", 256, 8, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_resident_rows_ending_at_thread_and_warp_edges(monkeypatch, form, threads, keys, ctas, dtype):
    # threads past a row's end hold no column and skip the per-key steps: rows ending exactly at, one key
    # before and one key after a thread's, a warp's and a CTA's last key, rows of a single thread's keys
    # and of none, in one launch, against the reference (ties and NaN rows too)
    if form == "two":
        monkeypatch.setenv("DI_TOPK_RESIDENT_CTAS_PER_SM", "2")
    else:
        monkeypatch.setenv("DI_TOPK_RESIDENT", "1")
        monkeypatch.setenv("DI_TOPK_RESIDENT_THREADS", str(threads))
    monkeypatch.setenv("DI_TOPK_RESIDENT_KEYS", str(keys))
    per_cta = threads * keys
    n_max = ctas * per_cta - 8
    ends = set()
    for edge in (keys, 5 * keys, 32 * keys, 3 * 32 * keys, per_cta, per_cta + 32 * keys, n_max):
        ends.update(e for e in (edge - 1, edge, edge + 1) if 0 < e <= n_max)
    ends = sorted(ends) + [0, 1]
    m = len(ends)
    gen = torch.Generator().manual_seed(threads + keys + ctas)
    for kind in ("random", "ties", "nan"):
        x = make_rows(kind, m, n_max, dtype, gen)
        ke = torch.tensor(ends, dtype=torch.int32)
        for k in (2048, 300, 7):
            _check(x, k, None, ke, return_values=True)
        ks = torch.full((m,), 3, dtype=torch.int32).minimum(ke)
        _check(x, 1024, ks, ke, index_mode="absolute")


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", [{"DI_TOPK_RESIDENT": "1", "DI_TOPK_RESIDENT_THREADS": "1024"},
                                  {"DI_TOPK_RESIDENT": "1", "DI_TOPK_RESIDENT_THREADS": "512"},
                                  {"DI_TOPK_RESIDENT_CTAS_PER_SM": "2"}, {"DI_TOPK_RESIDENT": "0"}])
def test_topk_bf16_every_bit_pattern(monkeypatch, form):
    # every one of the 65536 bfloat16 bit patterns (each NaN, both zeros, subnormals, infinities) once,
    # through the one-CTA forms that transform, count and compare the keys two per register (and the
    # buffered kernel): the negative patterns shuffled over rows 0-3, the positive ones over rows 4-7 (so
    # that the k-th key falls among either), 8192 keys a row
    for key, v in form.items():
        monkeypatch.setenv(key, v)
    gen = torch.Generator().manual_seed(len(str(form)))
    neg, pos = 32768 + torch.randperm(32768, generator=gen), torch.randperm(32768, generator=gen)
    bits = torch.cat([neg, pos]).to(torch.int32)
    x = (bits - 65536 * (bits >= 32768).int()).to(torch.int16).view(torch.bfloat16).view(8, 8192)
    every = torch.arange(-32768, 32768, dtype=torch.int32)
    assert torch.equal(torch.sort(x.view(torch.int16).flatten()).values.int(), every)
    ke = torch.full((8,), 8192, dtype=torch.int32)
    for k in (1, 255, 2047, 2048):
        _check_once(x, k, None, ke, return_values=True)
    ks = torch.randint(0, 9, (8,), generator=gen, dtype=torch.int32)
    ke = torch.randint(6000, 8193, (8,), generator=gen, dtype=torch.int32)
    _check_once(x, 1024, ks, ke)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 32768, 256), (1, 32768, 2048), (8, 40000, 2048), (40, 25000, 1024),
                                   (64, 8000, 512), (200, 3000, 2048), (200, 8000, 2048), (256, 8000, 512),
                                   (128, 42000, 2048), (100, 20000, 512), (500, 6000, 1024), (1100, 6000, 2048),
                                   (600, 4000, 512), (1000, 5000, 768), (700, 3000, 1024), (700, 3000, 2048)])
def test_topk_default_choice(monkeypatch, dtype, m, n, k):
    # the heuristic's own choice (no forcing): one row over a cluster, a cluster per row where the device
    # runs them all at once, more rows than that (buffered), one CTA per row at k < 1024, rows > SMs
    # (short rows: buffered; rows of 6-8K keys: several rows per CTA at k >= 1024, buffered at k = 512; past
    # 2 x SMs rows at k <= 1024: four CTAs per SM where they hold the rows), rows <= SMs
    # too long for one CTA's registers whose clusters do not all fit at once (buffered)
    monkeypatch.delenv("DI_TOPK_RESIDENT", raising=False)
    monkeypatch.delenv("DI_TOPK_RESIDENT_KEYS", raising=False)
    gen = torch.Generator().manual_seed(m + n + k)
    x = make_rows("random", m, n, dtype, gen)
    ke = torch.randint(n // 2, n + 1, (m,), generator=gen, dtype=torch.int32)
    ke[0] = n
    got = _check_once(x, k, None, ke)
    monkeypatch.setenv("DI_TOPK_RESIDENT", "0")
    assert torch.equal(_check_once(x, k, None, ke), got)
    ks = torch.randint(0, 40, (m,), generator=gen, dtype=torch.int32)
    monkeypatch.delenv("DI_TOPK_RESIDENT")
    _check_once(x, k, ks, ke)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cluster", ["1", "4"])
@pytest.mark.parametrize("wide", ["0", "1"])
def test_topk_fallback_paths(monkeypatch, dtype, cluster, wide):
    # rows whose threshold sample misjudges them (too high: fewer than k survivors; too low: more
    # than the buffer) and rows with more keys equal to the k-th than the buffer holds: the
    # emulation confirms each row's path, the kernel must still match the reference
    monkeypatch.setenv("DI_TOPK_CLUSTER", cluster)
    monkeypatch.setenv("DI_TOPK_WIDE", wide)
    gen = torch.Generator().manual_seed(3 + len(cluster))
    n, mis = 40000, 1
    width = n + mis + 16
    rows = [skewed_row(n, mis, dtype, 8.0, gen, 4), skewed_row(n, mis, dtype, -8.0, gen, 1)]
    rows += [make_rows(kind, 1, width, dtype, gen)[0] for kind in ("low_contrast", "equal", "random")]
    x = torch.stack([torch.nn.functional.pad(r.float(), (0, width - r.shape[0])).to(dtype) for r in rows])
    ke = torch.full((len(rows),), n + mis, dtype=torch.int32)
    ks = torch.full((len(rows),), mis, dtype=torch.int32)
    paths = [_emulate_vs_reference(x[i], 0, mis, n + mis, 2048, False)["path"] for i in range(len(rows))]
    assert "fallback" in paths[0] and "fallback" in paths[1], paths  # sample too high / too low
    assert paths[3] == "sample+fallback+eq_from_row" and paths[4] == "sample", paths
    pad = torch.empty(len(rows), width + (-width) % 8 + 8, dtype=dtype)[:, :width]  # rows start 16-byte aligned
    pad.copy_(x)
    for sorted_ in (False, True):
        _check(pad, 2048, ks, ke, sorted=sorted_, return_values=True)
