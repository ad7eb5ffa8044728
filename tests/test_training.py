"""deep_indexer.training: every op and gradient against naive full-matrix float64 math (CPU; CUDA too when present)."""
import pytest
import torch

from deep_indexer.training import indexer_kl_loss, indexer_logits, packed_bounds, sparse_indexer_kl_loss

from conftest import HAS_SM90, calc_diff

F64 = torch.float64
CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------
# Naive float64 math (full matrices, per-row loops; autograd gives the reference gradients)
# ------------------------------------------------------------------------------------------------


def naive_logits(q_i, k_i, w, ks, ke):
    s = torch.einsum("thd,sd->ths", q_i, k_i)
    out = torch.einsum("ths,th->ts", s.relu(), w)
    cols = torch.arange(k_i.shape[0], device=q_i.device)
    valid = (cols >= ks[:, None]) & (cols < ke[:, None])
    return out.masked_fill(~valid, float("-inf")), valid


def naive_scores(q, k, scale):
    if k.dim() == 2:
        return scale * torch.einsum("thd,sd->ths", q, k)
    g = q.shape[1] // k.shape[1]
    return scale * torch.einsum("thd,shd->ths", q, k.repeat_interleave(g, dim=1))


def _kl(p, logits):
    """sum p log(p / softmax(logits)) over the last dim (p may be unnormalised: sum p log p - sum p log softmax)."""
    return (torch.xlogy(p, p) - p * torch.log_softmax(logits, -1)).sum(-1)


def naive_warmup(q_i, k_i, w, q, k, scale, ks, ke, target, lse=None, total_heads=None):
    """Per-token loss [T] by a loop over rows, on the row's valid keys only."""
    heads = q.shape[1]
    total = total_heads or heads
    a = naive_scores(q, k, scale)
    s = torch.einsum("thd,sd->ths", q_i, k_i).relu() * w[:, :, None]
    out = []
    for t in range(q.shape[0]):
        lo, hi = int(ks[t]), int(ke[t])
        if lo >= hi:
            out.append(torch.zeros((), dtype=F64, device=q.device) + 0 * w.sum())
            continue
        at = a[t, :, lo:hi]
        p_h = torch.softmax(at, -1) if lse is None else torch.exp(at - lse[t][:, None])
        if target == "per_head":
            out.append(_kl(p_h, s[t, :, lo:hi]).sum() / total)
        else:
            p = p_h.sum(0) / total
            logits = s[t, :, lo:hi].sum(0)
            if total != heads:  # a tensor-parallel share: cross-entropy only
                out.append(-(p * torch.log_softmax(logits, -1)).sum())
            else:
                out.append(_kl(p, logits))
    return torch.stack(out)


def naive_sparse(q_i, k_i, w, q, k, idx, scale, target, ks=None, ke=None, lse=None):
    a = naive_scores(q, k, scale)
    s = torch.einsum("thd,sd->ths", q_i, k_i).relu() * w[:, :, None]
    out = []
    for t in range(q.shape[0]):
        sel = [int(j) for j in idx[t] if j >= 0 and (ks is None or int(ks[t]) <= j < int(ke[t]))]
        if not sel:
            out.append(torch.zeros((), dtype=F64, device=q.device) + 0 * w.sum())
            continue
        at, st = a[t][:, sel], s[t][:, sel]
        if target == "per_head":
            out.append(_kl(torch.softmax(at, -1), st).mean())
            continue
        if lse is None:
            p = torch.softmax(at, -1).mean(0)
        else:
            p = torch.exp(at - lse[t][:, None]).mean(0)
            p = p / p.sum()
        out.append(_kl(p, st.sum(0)))
    return torch.stack(out)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def make(t, n, hi, di, h, dqk, hkv=None, dtype=F64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * std).to(device=device, dtype=dtype)

    q_i = r(t, hi, di, std=di ** -0.25)
    k_i = r(n, di, std=di ** -0.25)
    w = r(t, hi, std=hi ** -0.5 * 2)
    q = r(t, h, dqk)
    k = r(n, dqk) if hkv is None else r(n, hkv, dqk)
    return q_i, k_i, w, q, k


def grads(fn, tensors, gout=None):
    ts = [x.detach().clone().requires_grad_(True) for x in tensors]
    out = fn(*ts)
    if gout is None:
        # drawn in float64 and then cast: torch.randn gives different values for float32 and float64 (its
        # vectorised path differs from 16 elements on), and runs compared across dtypes need the same gout
        gout = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(7))
    gout = gout.to(device=out.device, dtype=out.dtype)
    if out.dtype.is_floating_point:
        gout = torch.where(torch.isfinite(out), gout, torch.zeros_like(gout))
    (torch.where(torch.isfinite(out), out, torch.zeros_like(out)) * gout).sum().backward()
    return out.detach(), [x.grad for x in ts]


def close(x, y, what, tol=1e-9):
    assert x.shape == y.shape, (what, x.shape, y.shape)
    x, y = x.double().cpu(), y.double().cpu()
    assert torch.equal(torch.isfinite(x), torch.isfinite(y)), f"{what}: non-finite entries differ"
    x, y = x[torch.isfinite(y)], y[torch.isfinite(y)]
    err = (x - y).abs().max().item() if x.numel() else 0.0
    scale = max(1.0, y.abs().max().item() if y.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max abs err {err:.3g} (scale {scale:.3g})"


CU = torch.tensor([0, 5, 5, 12, 13, 20], dtype=torch.int32)  # odd lengths and an empty sequence


def rand_bounds(t, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, n, (t,), generator=g)
    ke = (ks + torch.randint(-3, n, (t,), generator=g)).clamp(0, n)  # some empty (ke <= ks) rows
    ks[0], ke[0] = 4, 4  # an empty row for sure
    ks[1], ke[1] = 0, n
    return ks, ke


# ------------------------------------------------------------------------------------------------
# Bounds helper
# ------------------------------------------------------------------------------------------------


def test_packed_bounds():
    ks, ke = packed_bounds(CU, causal=True)
    exp_ks = [0] * 5 + [5] * 7 + [12] + [13] * 7
    assert ks.tolist() == exp_ks and ke.tolist() == list(range(1, 21))
    ks, ke = packed_bounds(CU, causal=False)
    assert ke.tolist() == [5] * 5 + [12] * 7 + [13] + [20] * 7
    pos = torch.tensor([12, 4, 19, 5])
    ks, ke = packed_bounds(CU, causal=True, query_positions=pos)
    assert ks.tolist() == [12, 0, 13, 5] and ke.tolist() == [13, 5, 20, 6]


# ------------------------------------------------------------------------------------------------
# Indexer logits
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["packed_causal", "packed_full", "ks_ke", "all"])
def test_indexer_logits_fp64(layout):
    t = n = 20
    q_i, k_i, w, _, _ = make(t, n, 3, 8, 1, 4)
    if layout.startswith("packed"):
        kw = dict(cu_seqlens=CU, causal=layout == "packed_causal")
        ks, ke = packed_bounds(CU, causal=layout == "packed_causal")
    elif layout == "ks_ke":
        ks, ke = rand_bounds(t, n)
        kw = dict(ks=ks.int(), ke=ke.int())
    else:
        ks, ke, kw = torch.zeros(t, dtype=torch.long), torch.full((t,), n), {}
    out, g = grads(lambda a, b, c: indexer_logits(a, b, c, chunk_rows=3, chunk_keys=4, **kw), (q_i, k_i, w))
    ref_out, g_ref = grads(lambda a, b, c: naive_logits(a, b, c, ks, ke)[0], (q_i, k_i, w))
    assert torch.equal(out == float("-inf"), ref_out == float("-inf"))
    close(out, ref_out, "logits")
    for name, x, y in zip(("dq_I", "dk_I", "dw"), g, g_ref):
        close(x, y, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_logits_low_precision(dtype):
    t, n = 37, 29
    q_i, k_i, w, _, _ = make(t, n, 4, 16, 1, 4, dtype=dtype, seed=3)
    ks, ke = rand_bounds(t, n, seed=4)
    out = indexer_logits(q_i, k_i, w, ks=ks, ke=ke, chunk_keys=7)
    assert out.dtype == torch.float32
    ref_out, valid = naive_logits(q_i.double(), k_i.double(), w.double(), ks, ke)
    assert torch.equal(out == float("-inf"), ~valid)
    assert calc_diff(out[valid], ref_out[valid]) < 1e-9
    q_i.requires_grad_(True)
    indexer_logits(q_i, k_i, w, ks=ks, ke=ke).masked_fill(~valid, 0).sum().backward()
    assert q_i.grad.dtype == dtype and torch.isfinite(q_i.grad).all()


def test_indexer_logits_gradcheck():
    q_i, k_i, w, _, _ = make(6, 6, 2, 3, 1, 2, seed=5)
    cu = torch.tensor([0, 2, 6])
    f = lambda a, b, c: indexer_logits(a, b, c, cu_seqlens=cu, chunk_rows=2, chunk_keys=2).masked_fill(  # noqa: E731
        packed_bounds(cu)[1][:, None] <= torch.arange(6), 0)
    f2 = lambda a, b, c: f(a, b, c).masked_fill(packed_bounds(cu)[0][:, None] > torch.arange(6), 0)  # noqa: E731
    assert torch.autograd.gradcheck(f2, [x.requires_grad_(True) for x in (q_i, k_i, w)])


# ------------------------------------------------------------------------------------------------
# Warm-up loss
# ------------------------------------------------------------------------------------------------

CASES = [  # (target, H, H_I, H_kv, given lse)
    ("mean", 4, 3, None, False),
    ("mean", 4, 3, 2, True),
    ("per_head", 4, 4, None, True),
    ("per_head", 4, 4, 2, False),
]


@pytest.mark.parametrize("target,h,hi,hkv,given", CASES)
@pytest.mark.parametrize("layout", ["packed_causal", "ks_ke"])
def test_warmup_loss_fp64(target, h, hi, hkv, given, layout):
    t = n = 20
    q_i, k_i, w, q, k = make(t, n, hi, 8, h, 12, hkv=hkv, seed=11)
    scale = 0.37
    if layout == "packed_causal":
        ks, ke = packed_bounds(CU)
        kw = dict(cu_seqlens=CU)
    else:
        ks, ke = rand_bounds(t, n, seed=12)
        kw = dict(ks=ks, ke=ke)
    mask = torch.ones(t, dtype=torch.bool)
    mask[[3, 17]] = False
    lse = None
    if given:  # the true LSE, perturbed: the loss is then sum p log(p / softmax(I)) with sum p != 1
        a = naive_scores(q, k, scale)
        cols = torch.arange(n)
        lse = a.masked_fill(~((cols >= ks[:, None]) & (cols < ke[:, None]))[:, None], float("-inf")).logsumexp(-1)
        lse = lse + 0.05 * torch.randn(lse.shape, dtype=F64, generator=torch.Generator().manual_seed(2))

    def ours(a, b, c):
        return indexer_kl_loss(a, b, c, q, k, scale, attn_lse=lse, target=target, token_mask=mask, chunk_rows=3,
                               chunk_keys=4, **kw).per_token

    def naive(a, b, c):
        return naive_warmup(a, b, c, q, k, scale, ks, torch.where(mask, ke, ks), target, lse=lse)

    out, g = grads(ours, (q_i, k_i, w))
    ref_out, g_ref = grads(naive, (q_i, k_i, w))
    close(out, ref_out, "per-token loss")
    assert (out[~mask] == 0).all() and (out[mask & (ke > ks + 1)] != 0).all()
    for name, x, y in zip(("dq_I", "dk_I", "dw"), g, g_ref):
        close(x, y, name)


def test_warmup_loss_outputs_and_reductions():
    t = n = 20
    q_i, k_i, w, q, k = make(t, n, 3, 8, 4, 12, seed=21)
    res = indexer_kl_loss(q_i, k_i, w, q, k, cu_seqlens=CU, chunk_keys=3)
    valid = torch.ones(t, dtype=torch.bool)
    assert int(res.num_tokens) == int(valid.sum())
    close(res.loss, res.per_token.sum() / t, "mean")
    res_s = indexer_kl_loss(q_i, k_i, w, q, k, cu_seqlens=CU, reduction="sum")
    close(res_s.loss, res.per_token.sum(), "sum")
    close(res.target_mass, torch.ones(t), "target mass")
    # statistics: LSE of the indexer logits and of the attention over each row's keys
    ks, ke = packed_bounds(CU)
    logits, _ = naive_logits(q_i, k_i, w, ks, ke)
    close(res.indexer_lse, logits.logsumexp(-1), "indexer_lse")
    cols = torch.arange(n)
    a = naive_scores(q, k, 12 ** -0.5).masked_fill(~((cols >= ks[:, None]) & (cols < ke[:, None]))[:, None], float("-inf"))
    close(res.attn_lse, a.logsumexp(-1), "attn_lse")
    assert (res.per_token >= -1e-12).all()  # a KL divergence


def test_warmup_all_rows_masked():
    q_i, k_i, w, q, k = make(6, 6, 2, 4, 2, 4)
    q_i.requires_grad_(True)
    res = indexer_kl_loss(q_i, k_i, w, q, k, token_mask=torch.zeros(6, dtype=torch.bool))
    assert float(res.loss.detach()) == 0 and int(res.num_tokens) == 0
    res.loss.backward()
    assert (q_i.grad == 0).all()


@pytest.mark.parametrize("target", ["mean", "per_head"])
def test_warmup_gradcheck(target):
    q_i, k_i, w, q, k = make(5, 5, 2, 3, 2, 4, seed=31)
    cu = torch.tensor([0, 2, 5])

    def f(a, b, c):
        return indexer_kl_loss(a, b, c, q, k, 0.5, cu_seqlens=cu, target=target, chunk_rows=2, chunk_keys=2).per_token

    assert torch.autograd.gradcheck(f, [x.requires_grad_(True) for x in (q_i, k_i, w)])


def test_warmup_bf16_matches_fp64():
    t = n = 64
    q_i, k_i, w, q, k = make(t, n, 4, 32, 8, 64, hkv=1, dtype=torch.bfloat16, seed=41)
    k = k[:, 0]
    cu = torch.tensor([0, 23, 64])
    res = indexer_kl_loss(q_i, k_i, w, q, k, cu_seqlens=cu, chunk_keys=16)
    ks, ke = packed_bounds(cu)
    ref = naive_warmup(q_i.double(), k_i.double(), w.double(), q.double(), k.double(), 64 ** -0.5, ks, ke, "mean")
    assert res.per_token.dtype == torch.float32
    close(res.per_token, ref, "bf16 inputs, fp32 accumulation", tol=1e-5)


def test_loss_equals_kl_of_materialised_distributions():
    """The loss is KL(p || softmax(I)) with p the head mean of the attention softmax, on a tiny dense case."""
    q_i, k_i, w, q, k = make(4, 6, 2, 4, 3, 5, seed=51)
    res = indexer_kl_loss(q_i, k_i, w, q, k, 0.8, causal=False)
    p = torch.softmax(0.8 * torch.einsum("thd,sd->ths", q, k), -1).mean(1)
    r = torch.softmax(torch.einsum("thd,sd->ths", q_i, k_i).relu().mul(w[:, :, None]).sum(1), -1)
    close(res.per_token, (p * (p / r).log()).sum(-1), "KL")
    close(res.loss, (p * (p / r).log()).sum(-1).mean(), "mean KL")


def test_deterministic_bitwise():
    q_i, k_i, w, q, k = make(40, 40, 4, 16, 4, 32, dtype=torch.float32, seed=61)
    cu = torch.tensor([0, 17, 40])
    outs = []
    for _ in range(2):
        x = [v.clone().requires_grad_(True) for v in (q_i, k_i, w)]
        res = indexer_kl_loss(*x, q, k, cu_seqlens=cu, deterministic=True, chunk_rows=5, chunk_keys=8)
        res.loss.backward()
        outs.append([res.per_token.detach()] + [v.grad for v in x])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Sparse-stage loss
# ------------------------------------------------------------------------------------------------


def topk_indices(t, n, kk, ks, ke, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((t, kk), -1, dtype=torch.int32)
    for r in range(t):
        lo, hi = int(ks[r]), int(ke[r])
        cand = torch.randperm(n, generator=g)
        if hi > lo and r % 3 == 0:
            cand = torch.cat([torch.tensor([lo]), cand[cand != lo]])
        take = int(torch.randint(0, kk + 1, (1,), generator=g))
        idx[r, :take] = cand[:take].int()  # some outside [lo, hi) on purpose, some rows empty
    return idx


@pytest.mark.parametrize("target,h,hi,hkv,given", CASES)
def test_sparse_loss_fp64(target, h, hi, hkv, given):
    t = n = 20
    q_i, k_i, w, q, k = make(t, n, hi, 8, h, 12, hkv=hkv, seed=71)
    ks, ke = packed_bounds(CU)
    idx = topk_indices(t, n, 6, ks, ke, seed=72)
    scale = 0.45
    mask = torch.ones(t, dtype=torch.bool)
    mask[6] = False
    lse = None
    if given:
        lse = naive_scores(q, k, scale).logsumexp(-1) + torch.randn(t, h, dtype=F64, generator=torch.Generator().manual_seed(3))

    def ours(a, b, c):
        return sparse_indexer_kl_loss(a, b, c, q, k, idx, scale, cu_seqlens=CU, attn_lse=lse, target=target,
                                      token_mask=mask, chunk_rows=4).per_token

    def naive(a, b, c):
        return naive_sparse(a, b, c, q, k, torch.where(mask[:, None], idx, -1), scale, target, ks, ke, lse)

    out, g = grads(ours, (q_i, k_i, w))
    ref_out, g_ref = grads(naive, (q_i, k_i, w))
    close(out, ref_out, "per-token loss")
    for name, x, y in zip(("dq_I", "dk_I", "dw"), g, g_ref):
        close(x, y, name)


def test_sparse_equals_dense_when_all_keys_selected():
    t = n = 20
    q_i, k_i, w, q, k = make(t, n, 3, 8, 4, 12, seed=81)
    ks, ke = packed_bounds(CU)
    idx = torch.arange(n, dtype=torch.int32).repeat(t, 1)
    for target, hi in (("mean", 3), ("per_head", 4)):
        q_i, k_i, w, q, k = make(t, n, hi, 8, 4, 12, seed=81)
        d = indexer_kl_loss(q_i, k_i, w, q, k, cu_seqlens=CU, target=target)
        s = sparse_indexer_kl_loss(q_i, k_i, w, q, k, idx, cu_seqlens=CU, target=target)
        close(s.per_token, d.per_token, f"sparse = dense ({target})")
        close(s.indexer_lse, d.indexer_lse, "indexer_lse")


def test_sparse_gradcheck_and_determinism():
    q_i, k_i, w, q, k = make(5, 7, 2, 3, 2, 4, seed=91)
    idx = torch.tensor([[0, 3, -1], [6, 1, 2], [-1, -1, -1], [2, 5, 4], [1, -1, 0]], dtype=torch.int32)
    for target in ("mean", "per_head"):
        def f(a, b, c):
            return sparse_indexer_kl_loss(a, b, c, q, k, idx, 0.7, target=target, chunk_rows=2).per_token

        assert torch.autograd.gradcheck(f, [x.clone().requires_grad_(True) for x in (q_i, k_i, w)])
    x = [v.clone().requires_grad_(True) for v in (q_i, k_i, w)]
    sparse_indexer_kl_loss(*x, q, k, idx, deterministic=True).loss.backward()
    y = [v.clone().requires_grad_(True) for v in (q_i, k_i, w)]
    sparse_indexer_kl_loss(*y, q, k, idx, deterministic=False).loss.backward()
    for a, b in zip(x, y):
        close(a.grad, b.grad, "deterministic vs default", tol=1e-12)


# ------------------------------------------------------------------------------------------------
# Distributed decompositions (simulated ranks)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["mean", "per_head"])
@pytest.mark.parametrize("sparse", [False, True])
def test_tensor_parallel_heads(target, sparse):
    t = n = 20
    h, tp = 4, 2
    q_i, k_i, w, q, k = make(t, n, 4 if target == "per_head" else 3, 8, h, 12, seed=101)
    ks, ke = packed_bounds(CU)
    idx = topk_indices(t, n, 5, ks, ke, seed=102)

    def run(a, b, c, qq, total=None):
        if sparse:
            return sparse_indexer_kl_loss(a, b, c, qq, k, idx, 0.5, cu_seqlens=CU, target=target, total_heads=total,
                                          reduction="sum")
        return indexer_kl_loss(a, b, c, qq, k, 0.5, cu_seqlens=CU, target=target, total_heads=total, reduction="sum")

    full, g_full = grads(lambda a, b, c: run(a, b, c, q).per_token, (q_i, k_i, w))
    loss_sum, g_sum = torch.zeros(t, dtype=F64), [torch.zeros_like(x) for x in (q_i, k_i, w)]
    hs = h // tp
    for rank in range(tp):
        sl = slice(rank * hs, (rank + 1) * hs)
        if target == "per_head":  # indexer head h pairs with attention head h: split both
            qi_r, w_r = q_i[:, sl], w[:, sl]
        else:
            qi_r, w_r = q_i, w
        out, g = grads(lambda a, b, c: run(a, b, c, q[:, sl], total=h).per_token, (qi_r, k_i, w_r))
        loss_sum += out
        if target == "per_head":
            g_sum[0][:, sl] += g[0]
            g_sum[2][:, sl] += g[2]
        else:
            g_sum[0] += g[0]
            g_sum[2] += g[2]
        g_sum[1] += g[1]
    if target == "mean":  # ranks give the cross-entropy: add the target's entropy back
        if sparse:
            ent = naive_sparse(q_i, k_i, w, q, k, idx, 0.5, target, ks, ke) - _ce_sparse(q_i, k_i, w, q, k, idx, ks, ke)
        else:
            ent = full - _ce_dense(q_i, k_i, w, q, k, ks, ke)
        loss_sum = loss_sum + ent
    close(loss_sum, full, "sum over ranks")
    for name, x, y in zip(("dq_I", "dk_I", "dw"), g_sum, g_full):
        close(x, y, name)


def _ce_dense(q_i, k_i, w, q, k, ks, ke):
    a = naive_scores(q, k, 0.5)
    s = torch.einsum("thd,sd->ths", q_i, k_i).relu() * w[:, :, None]
    out = []
    for t in range(q.shape[0]):
        lo, hi = int(ks[t]), int(ke[t])
        p = torch.softmax(a[t, :, lo:hi], -1).mean(0)
        out.append(-(p * torch.log_softmax(s[t, :, lo:hi].sum(0), -1)).sum())
    return torch.stack(out)


def _ce_sparse(q_i, k_i, w, q, k, idx, ks, ke):
    a = naive_scores(q, k, 0.5)
    s = torch.einsum("thd,sd->ths", q_i, k_i).relu() * w[:, :, None]
    out = []
    for t in range(q.shape[0]):
        sel = [int(j) for j in idx[t] if j >= 0 and int(ks[t]) <= j < int(ke[t])]
        if not sel:
            out.append(torch.zeros((), dtype=F64))
            continue
        p = torch.softmax(a[t][:, sel], -1).mean(0)
        out.append(-(p * torch.log_softmax(s[t][:, sel].sum(0), -1)).sum())
    return torch.stack(out)


def test_context_parallel_rows():
    """A rank holding a slice of the query rows (global causal offsets) reproduces those rows' losses; the
    k_I gradients of the ranks sum to the full one."""
    t = n = 20
    q_i, k_i, w, q, k = make(t, n, 3, 8, 4, 12, seed=111)
    gout = torch.randn(t, dtype=F64)
    full, g_full = grads(lambda a, b, c: indexer_kl_loss(a, b, c, q, k, cu_seqlens=CU, reduction="sum").per_token,
                         (q_i, k_i, w), gout)
    dk = torch.zeros_like(k_i)
    for rows in (torch.arange(0, 7), torch.arange(7, 20)):
        ks, ke = packed_bounds(CU, causal=True, query_positions=rows)
        out, g = grads(lambda a, b, c: indexer_kl_loss(a, b, c, q[rows], k, ks=ks, ke=ke).per_token,
                       (q_i[rows], k_i, w[rows]), gout[rows])
        close(out, full[rows], "local rows")
        close(g[0], g_full[0][rows], "dq_I of local rows")
        dk += g[1]
    close(dk, g_full[1], "dk_I summed over ranks")


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def test_validation_errors():
    q_i, k_i, w, q, k = make(6, 6, 2, 4, 2, 4)
    with pytest.raises(ValueError, match="k_I"):
        indexer_logits(q_i, k_i[:, :3], w)
    with pytest.raises(ValueError, match="weights"):
        indexer_logits(q_i, k_i, w[:, :1])
    with pytest.raises(TypeError, match="q_I"):
        indexer_logits(q_i.int(), k_i, w)
    with pytest.raises(ValueError, match="ke"):
        indexer_logits(q_i, k_i, w, ks=torch.zeros(6, dtype=torch.int32), ke=torch.full((6,), 7, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        indexer_logits(q_i, k_i, w, cu_seqlens=torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="target"):
        indexer_kl_loss(q_i, k_i, w, q, k, target="sum")
    with pytest.raises(ValueError, match="per_head"):
        indexer_kl_loss(q_i[:, :1], k_i, w[:, :1], q, k, target="per_head")
    with pytest.raises(ValueError, match="H_kv"):
        indexer_kl_loss(q_i, k_i, w, q, k.unsqueeze(1).expand(6, 3, 4).contiguous())
    with pytest.raises(ValueError, match="softmax_scale"):
        indexer_kl_loss(q_i, k_i, w, q, k, -1.0)
    with pytest.raises(ValueError, match="attn_lse"):
        indexer_kl_loss(q_i, k_i, w, q, k, attn_lse=torch.zeros(6, 3, dtype=F64))
    with pytest.raises(ValueError, match="total_heads"):
        indexer_kl_loss(q_i, k_i, w, q, k, total_heads=1)
    with pytest.raises(ValueError, match="token_mask"):
        indexer_kl_loss(q_i, k_i, w, q, k, token_mask=torch.ones(5, dtype=torch.bool))
    idx = torch.zeros(6, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="distinct"):
        sparse_indexer_kl_loss(q_i, k_i, w, q, k, idx)
    with pytest.raises(ValueError, match="indices"):
        sparse_indexer_kl_loss(q_i, k_i, w, q, k, torch.full((6, 2), 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="backend"):
        indexer_logits(q_i, k_i, w, backend="cuda")
    with pytest.raises(ValueError, match="attn_lse"):
        sparse_indexer_kl_loss(q_i, k_i, w, q[:, :1], k, torch.arange(2).repeat(6, 1), total_heads=2,
                               attn_lse=torch.zeros(6, 1, dtype=F64))


def test_sm90_kernel_input_errors_on_cpu():
    """The kernel entry validates shapes and dtypes (before the device) with clear errors."""
    import deep_indexer

    bf = torch.bfloat16
    q_i, k_i = torch.zeros(4, 64, 128, dtype=bf), torch.zeros(9, 128, dtype=bf)
    w, ks, ke = torch.zeros(4, 64), torch.zeros(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    out = torch.zeros(4, 9)
    f = deep_indexer._C.bf16_indexer_logits
    with pytest.raises(ValueError, match="q_I has 64 heads of dim 96"):
        f(torch.zeros(4, 64, 96, dtype=bf), k_i, w, ks, ke, out)
    with pytest.raises(ValueError, match="k_I"):
        f(q_i, k_i.float(), w, ks, ke, out)
    with pytest.raises(ValueError, match="weights"):
        f(q_i, k_i, w[:, :32], ks, ke, out)
    with pytest.raises(ValueError, match="ke"):
        f(q_i, k_i, w, ks, ke.long(), out)
    with pytest.raises(ValueError, match="out"):
        f(q_i, k_i, w, ks, ke, out[:, :8])
    with pytest.raises(ValueError, match="CUDA"):
        f(q_i, k_i, w, ks, ke, out)
    with pytest.raises(TypeError, match="bfloat16"):
        indexer_logits(q_i.float(), k_i.float(), w, backend="sm90")


# ------------------------------------------------------------------------------------------------
# bf16 inputs: fp32 inside, bf16 only in the returned gradients (CPU emulations of the CUDA path, and CUDA)
# ------------------------------------------------------------------------------------------------

# Bars for bf16 inputs against float64 on the same (bf16-valued) inputs, calc_diff = 1 - 2<x,y>/(|x|^2+|y|^2):
# - GRAD_BF16_TOL for the gradients autograd returns: a leaf's gradient has the leaf's dtype, so they are the
#   fp32 gradients rounded once to bf16 (8 significant bits, relative error up to 2^-9 per entry, uniform).
#   That rounding alone gives calc_diff ~ 1.1e-6 to 1.5e-6 (measured); 1e-5 keeps a 7x margin.
# - GRAD_FP32_TOL for the fp32 gradients inside (reference.warmup_kl_bwd): fp32 accumulation gives ~1e-13
#   (measured 3e-14 to 8e-14). One bf16 rounding of any intermediate (>= ~1e-6) or a TF32 GEMM of fp32
#   operands (2e-8 to 2e-7) fails it: this is the check that everything except the given inputs stays fp32.
# - LOSS_TOL (max abs error over max(1, |loss|)): fp32 loss, measured 3e-7 to 6e-7; TF32 logits would give 3e-4.
GRAD_BF16_TOL, GRAD_FP32_TOL, LOSS_TOL = 1e-5, 1e-10, 1e-5
CU_BF16 = torch.tensor([0, 101, 101, 257, 300], dtype=torch.int32)


def _bf16_case(target):
    h = 8
    return make(300, 300, h if target == "per_head" else 4, 64, h, 192, dtype=torch.bfloat16, seed=121)


def _naive_bf16_reference(x, target):
    """Loss and gradients of the naive float64 math (independent of the code under test) on x's values."""
    cpu = [v.double() for v in x]
    ks, ke = packed_bounds(CU_BF16)
    return grads(lambda a, b, c: naive_warmup(a, b, c, cpu[3], cpu[4], cpu[4].shape[-1] ** -0.5, ks, ke, target),
                 cpu[:3])


def _fp32_internal_grads(x, cu, target, chunk_keys=None):
    """(dq_I, dk_I, dw) of sum(gout * per_token) straight from the reference backward, in its accumulation
    dtype (fp32 for bf16 inputs): what autograd rounds to the inputs' dtype."""
    from deep_indexer.training import reference as ref

    q_i, k_i, w, q, k = x
    ks, ke = packed_bounds(cu.to(q.device))
    ks_c, ke_c = ks.cpu(), ke.cpu()
    per_head, heads, scale = target == "per_head", q.shape[1], q.shape[-1] ** -0.5
    lse = ref.attention_lse(q, k, scale, ks, ke, ks_c, ke_c, None, chunk_keys)
    loss, lse_i, mass = ref.warmup_kl_fwd(q_i, k_i, w, q, k, scale, lse, ks, ke, ks_c, ke_c, per_head, heads,
                                          False, None, chunk_keys)
    gout = torch.randn(loss.shape, dtype=F64, generator=torch.Generator().manual_seed(7)).to(loss)
    return ref.warmup_kl_bwd(gout, q_i, k_i, w, q, k, scale, lse, lse_i, mass, ks, ke, ks_c, ke_c, per_head,
                             heads, None, chunk_keys)


def check_bf16_against_fp64(x, target, device="cpu"):
    """The warm-up loss on bf16 inputs x (moved to `device`, key tiles of 64) against float64 on the CPU."""
    cu = CU_BF16
    dev = [v.to(device) for v in x]
    out, g = grads(lambda a, b, c: indexer_kl_loss(a, b, c, dev[3], dev[4], cu_seqlens=cu.to(device), target=target,
                                                   chunk_keys=64).per_token, dev[:3])
    ref_out, g_ref = _naive_bf16_reference(x, target)
    assert out.dtype == torch.float32
    close(out, ref_out, "loss", tol=LOSS_TOL)
    for name, a, b in zip(("dq_I", "dk_I", "dw"), g, g_ref):
        assert a.dtype == torch.bfloat16, name
        d = calc_diff(a.cpu(), b)
        assert d < GRAD_BF16_TOL, f"{name}: calc_diff {d:.3g} vs float64 (returned bf16 gradient)"
    inner = _fp32_internal_grads(dev, cu, target, chunk_keys=64)
    for name, a, b in zip(("dq_I", "dk_I", "dw"), inner, g_ref):
        assert a.dtype == torch.float32, name
        d = calc_diff(a.cpu(), b)
        assert d < GRAD_FP32_TOL, f"{name}: calc_diff {d:.3g} vs float64 (fp32 gradient inside)"


def test_grads_helper_same_gout_across_dtypes():
    """grads() must feed float32 and float64 outputs the same upstream gradient (torch.randn does not)."""
    seen = []
    for dt in (torch.float32, F64):
        x = torch.ones(40, dtype=dt)
        seen.append(grads(lambda a: a * 1, [x])[1][0])
    assert torch.equal(seen[0], seen[1].float())  # the float64 draw rounded to float32


@pytest.mark.parametrize("target", ["mean", "per_head"])
def test_bf16_cpu_matches_fp64(target):
    """The CPU path (bf16 inputs upcast to fp32 GEMMs) under the bars above."""
    check_bf16_against_fp64(_bf16_case(target), target)


def _emulated_fp32_out_gemms(monkeypatch):
    """Force the CUDA-only branch (16-bit GEMM with fp32 output) on the CPU: the GEMM is emulated by exact
    float64 products and sums rounded once to fp32, as accurate as cuBLAS's fp32 accumulation can be."""
    from deep_indexer.training import reference as ref

    calls = []

    def emulate(f):
        def run(a, b_t):
            assert a.dtype == b_t.dtype == torch.bfloat16, "the fp32-out GEMM takes the bf16 inputs only"
            calls.append(f.__name__)
            return f(a.double(), b_t.double()).float()
        return run

    monkeypatch.setattr(ref, "_fast_gemm", lambda a, b, acc: acc == torch.float32 and a.dtype in ref._LOW
                        and b.dtype == a.dtype)
    monkeypatch.setattr(ref, "_mm_fp32_out", emulate(torch.mm))
    monkeypatch.setattr(ref, "_bmm_fp32_out", emulate(torch.bmm))
    return calls


@pytest.mark.parametrize("target", ["mean", "per_head"])
def test_bf16_cuda_gemm_branch_on_cpu(target, monkeypatch):
    """The CUDA path's own branch (bf16 x bf16 -> fp32 GEMMs, layouts as on the GPU), run on the CPU."""
    calls = _emulated_fp32_out_gemms(monkeypatch)
    check_bf16_against_fp64(_bf16_case(target), target)
    assert "mm" in calls


@pytest.mark.parametrize("sparse", [False, True])
def test_cuda_gemm_branch_layouts_on_cpu(sparse, monkeypatch):
    """The fp32-out GEMM branch's layouts with H_kv key heads and gathered (sparse) keys: bmm_nt and the
    head-grouped reshapes give what the upcast CPU path gives (to fp32 rounding)."""
    t = n = 40
    q_i, k_i, w, q, k = make(t, n, 4, 16, 8, 32, hkv=2, dtype=torch.bfloat16, seed=161)
    idx = torch.randn(t, n, generator=torch.Generator().manual_seed(4)).topk(12, dim=1).indices.int()
    idx[3, 5:] = -1  # padding

    def run():
        if sparse:
            return grads(lambda a, b, c: sparse_indexer_kl_loss(a, b, c, q, k, idx).per_token, (q_i, k_i, w))
        return grads(lambda a, b, c: indexer_kl_loss(a, b, c, q, k, chunk_keys=16).per_token, (q_i, k_i, w))

    want = run()
    calls = _emulated_fp32_out_gemms(monkeypatch)
    got = run()
    assert set(calls) == ({"bmm"} if sparse else {"mm", "bmm"}), set(calls)
    close(got[0], want[0], "loss", tol=1e-6)
    for name, a, b in zip(("dq_I", "dk_I", "dw"), got[1], want[1]):
        assert calc_diff(a, b) < GRAD_BF16_TOL, name


def _tf32(x):
    """fp32 -> TF32 (10 mantissa bits, round half away from zero), as tensor cores read fp32 operands."""
    if x.dtype != torch.float32:
        return x
    return ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize("target", ["mean", "per_head"])
def test_bf16_loss_immune_to_tf32_gemms(target, monkeypatch):
    """With TF32 enabled for fp32 matmuls (a common training setting), the fp32 GEMMs of the backward round
    their operands to TF32 (the fp32-inside bar then does not hold: 2e-8 to 2e-7), but the loss and the logits
    never go through an fp32 GEMM, and the returned bf16 gradients stay under their bar."""
    x = _bf16_case(target)
    ref_out, g_ref = _naive_bf16_reference(x, target)  # before the patches: exact float64
    for name in ("matmul", "mm", "bmm"):
        monkeypatch.setattr(torch, name, lambda a, b, f=getattr(torch, name): f(_tf32(a), _tf32(b)))
    einsum = torch.einsum
    monkeypatch.setattr(torch, "einsum", lambda eq, *ops: einsum(eq, *[_tf32(o) for o in ops]))
    out, g = grads(lambda a, b, c: indexer_kl_loss(a, b, c, x[3], x[4], cu_seqlens=CU_BF16, target=target,
                                                   chunk_keys=64).per_token, x[:3])
    close(out, ref_out, "loss", tol=LOSS_TOL)
    for name, a, b in zip(("dq_I", "dk_I", "dw"), g, g_ref):
        assert calc_diff(a, b) < GRAD_BF16_TOL, name


# ------------------------------------------------------------------------------------------------
# GPU (the same portable code on CUDA): against float64 on the CPU, and determinism
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["mean", "per_head"])
def test_cuda_matches_cpu_fp64(target):
    """bf16 inputs on CUDA (bf16 x bf16 -> fp32 GEMMs, fp32 everything else) against float64 on the CPU, with
    fp32 matmuls in full fp32 (torch's default; the TF32 case is covered on the CPU above)."""
    if torch.backends.cuda.matmul.allow_tf32:
        pytest.skip("TF32 enabled for fp32 matmuls in this process: the fp32-inside bar assumes IEEE fp32")
    check_bf16_against_fp64(_bf16_case(target), target, device="cuda")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_bounds_given_on_the_host():
    """cu_seqlens, ks/ke and token_mask may be CPU tensors for CUDA inputs (no device-to-host copy): the same
    results, bitwise, as the device tensors; a tensor on another device is refused."""
    t = n = 300
    x = [v.cuda() for v in make(t, n, 4, 64, 8, 64, dtype=torch.bfloat16, seed=151)]
    mask = torch.rand(t, generator=torch.Generator().manual_seed(3)) > 0.2
    ks, ke = packed_bounds(CU_BF16)
    runs = []
    for host in (False, True):
        dev = "cpu" if host else "cuda"
        kw = dict(token_mask=mask.to(dev), reduction="sum")
        a = grads(lambda a, b, c: indexer_kl_loss(a, b, c, x[3], x[4], cu_seqlens=CU_BF16.to(dev), **kw).per_token,
                  x[:3])
        b = grads(lambda a, b, c: indexer_kl_loss(a, b, c, x[3], x[4], ks=ks.to(dev), ke=ke.to(dev), **kw).per_token,
                  x[:3])
        c = grads(lambda a, b, c: indexer_logits(a, b, c, cu_seqlens=CU_BF16.to(dev)), x[:3])
        runs.append([a[0], *a[1], b[0], *b[1], c[0], *c[1]])
    for u, v in zip(*runs):
        assert torch.equal(u, v)
    torch.testing.assert_close(runs[0][0], runs[0][4])  # cu_seqlens and its (ks, ke): same rows
    with pytest.raises(ValueError, match="ke: expected the device of ks"):
        indexer_logits(*x[:3], ks=ks, ke=ke.cuda())


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_sparse_deterministic_mode():
    t = n = 512
    x = [v.cuda() for v in make(t, n, 8, 64, 8, 64, dtype=torch.bfloat16, seed=131)]
    logits = torch.randn(t, n, device="cuda")
    idx = logits.topk(64, dim=1).indices.int()
    runs = []
    for _ in range(3):
        y = [v.clone().requires_grad_(True) for v in x[:3]]
        sparse_indexer_kl_loss(*y, x[3], x[4], idx, deterministic=True).loss.backward()
        runs.append([v.grad for v in y])
    for r in runs[1:]:
        for a, b in zip(r, runs[0]):
            assert torch.equal(a, b)


@pytest.mark.skipif(not HAS_SM90, reason="needs an SM90 GPU")
def test_cuda_large_bounded_memory():
    """8K causal tokens, H = 128 x 576 MQA, H_I = 64 x 128: peak memory stays far below [H, T, T] fp32 (32 GiB)."""
    t = 8192
    g = torch.Generator(device="cuda").manual_seed(141)

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * std).bfloat16()

    q_i, k_i, w = r(t, 64, 128, std=0.3), r(t, 128, std=0.3), r(t, 64, std=0.25)
    q, k = r(t, 128, 576), r(t, 576)
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = [v.clone().requires_grad_(True) for v in (q_i, k_i, w)]
    res = indexer_kl_loss(*y, q, k, 576 ** -0.5, cu_seqlens=cu)
    res.loss.backward()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 2 << 30, f"peak {peak / 2**20:.0f} MiB"
    assert torch.isfinite(res.loss) and all(torch.isfinite(v.grad).all() for v in y)


# ------------------------------------------------------------------------------------------------
# SM90 kernel: bf16 indexer logits forward (backend="sm90")
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("tokens,keys", [(1, 1), (37, 301), (1031, 2050)])
def test_sm90_indexer_logits_kernel(heads, dim, tokens, keys):
    import deep_indexer

    g = torch.Generator(device="cuda").manual_seed(heads * 7 + dim + tokens)
    q_i = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * dim ** -0.25).bfloat16()
    k_i = (torch.randn(keys, dim, device="cuda", generator=g) * dim ** -0.25).bfloat16()
    w = torch.randn(tokens, heads, device="cuda", generator=g)
    ks = torch.randint(0, keys, (tokens,), device="cuda", generator=g)
    ke = (ks + torch.randint(-5, keys, (tokens,), device="cuda", generator=g)).clamp(0, keys)
    ks[0], ke[0] = 0, keys
    if tokens > 2:
        ks[1], ke[1] = keys // 2, keys // 2  # an empty row
    ks, ke = ks.int(), ke.int()
    # the raw kernel into a NaN-poisoned output: every valid entry written, nothing else touched
    out = torch.full((tokens, keys), float("nan"), device="cuda")
    deep_indexer._C.bf16_indexer_logits(q_i, k_i, w, ks, ke, out, clean=False)
    ref = indexer_logits(q_i.double(), k_i.double(), w.double(), ks=ks, ke=ke)
    valid = torch.isfinite(ref)
    assert torch.isfinite(out[valid]).all(), "valid entries not written"
    assert torch.isnan(out[~valid]).all(), "entries outside the ranges written"
    assert calc_diff(out[valid], ref[valid]) < 1e-5
    # clean=True (the default): exactly -inf outside (filled by the kernel's idle producer warps when there
    # are at least as many q blocks as SMs, else by the separate clean kernel), the same values inside
    cleaned = torch.full((tokens, keys), float("nan"), device="cuda")
    deep_indexer._C.bf16_indexer_logits(q_i, k_i, w, ks, ke, cleaned)
    assert torch.equal(cleaned == float("-inf"), ~valid) and torch.equal(cleaned[valid], out[valid])
    # through the autograd op: -inf outside; the backward on the portable path, or for 64 heads on the SM90
    # kernels (test_training_sm90.py checks them against float64; here within their bar of the portable one)
    x = [v.clone().requires_grad_(True) for v in (q_i, k_i, w)]
    got = indexer_logits(*x, ks=ks, ke=ke, backend="sm90")
    assert torch.equal(got == float("-inf"), ~valid)
    got.masked_fill(~valid, 0).sum().backward()
    y = [v.clone().requires_grad_(True) for v in (q_i, k_i, w)]
    indexer_logits(*y, ks=ks, ke=ke).masked_fill(~valid, 0).sum().backward()
    for a, b in zip(x, y):
        if heads == 64:
            assert calc_diff(a.grad.double(), b.grad.double()) < 1e-5
        else:
            assert torch.equal(a.grad, b.grad)
    # deterministic: bitwise equal run to run
    assert torch.equal(indexer_logits(q_i, k_i, w, ks=ks, ke=ke, backend="sm90"), got.detach())


@pytest.mark.skipif(not HAS_SM90, reason="needs an SM90 GPU")
def test_sm90_indexer_logits_packed_causal_large():
    t = 8192
    g = torch.Generator(device="cuda").manual_seed(5)
    q_i = (torch.randn(t, 64, 128, device="cuda", generator=g) * 0.3).bfloat16()
    k_i = (torch.randn(t, 128, device="cuda", generator=g) * 0.3).bfloat16()
    w = torch.randn(t, 64, device="cuda", generator=g)
    cu = torch.tensor([0, 1, 1000, 1000, 5003, t], dtype=torch.int32, device="cuda")
    got = indexer_logits(q_i, k_i, w, cu_seqlens=cu, backend="sm90")
    ref = indexer_logits(q_i, k_i, w, cu_seqlens=cu)
    valid = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), valid)
    assert calc_diff(got[valid], ref[valid]) < 1e-5


def test_distributed_example_runs():
    """examples/training_distributed.py: every TP / CP / sparse decomposition matches its one-rank run (it exits
    non-zero otherwise); on the CPU in float64."""
    import os
    import subprocess
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "training_distributed.py")
    r = subprocess.run([sys.executable, path, "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 4 decompositions match" in r.stdout
