"""deep_indexer.training on the SM90 kernels (backend "sm90" / "auto"): the warm-up `mean` loss and the indexer
logits backward against naive float64 math on the same bf16 inputs (GPU), dispatch and argument checks (CPU).

Bars (inputs are bf16, every reference is float64 on the bf16 values):
- the target p and the row statistics: the kernels accumulate in fp32 and take exp2 with ex2.approx (2 ulp): entry
  errors ~1e-6 relative. P_REL_TOL = 1e-4 per entry; one bf16 rounding of the scores or of p would give >= 2e-3.
- the loss: LOSS_TOL as in test_training (max abs error over max(1, |loss|)), fp32 sums over the keys.
- gradients: the one rounding beyond fp32 is dS = dI w [S > 0] to bf16 (8 bits) as the operand of the dq_I / dk_I
  WGMMAs, a relative error up to 2^-9 per term (calc_diff ~1e-6 on a sum of random-sign terms), and the returned
  gradients' own rounding to bf16 (calc_diff ~1.5e-6, see test_training). GRAD_TOL = 1e-5 for both the fp32
  gradients inside and the returned bf16 ones; an indexing error gives calc_diff of order 1.
"""
import pytest
import torch

from conftest import HAS_SM90, calc_diff
from deep_indexer.training import indexer_kl_loss, indexer_logits, packed_bounds
from deep_indexer.training import sm90 as fast

F64 = torch.float64
P_REL_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-5
needs_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an SM90 GPU")


def _inputs(t, n, di, dqk=576, seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * std).to(device=device, dtype=torch.bfloat16)

    q_i = r(t, 64, di, std=di ** -0.25)
    k_i = r(n, di, std=di ** -0.25)
    w = (torch.randn(t, 64, generator=g, dtype=F64) * 0.25).float().to(device)
    q, k = r(t, 128, dqk), r(n, dqk)
    return q_i, k_i, w, q, k


def _naive_mean_loss(q_i, k_i, w, q, k, scale, ks, ke):
    """Per-token KL(mean_h softmax || softmax(I)) in float64 (rows with no key: 0), vectorised with masks."""
    a = scale * torch.einsum("thd,sd->ths", q.double(), k.double())
    cols = torch.arange(k.shape[0], device=q.device)
    valid = (cols >= ks[:, None]) & (cols < ke[:, None])
    a = a.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(a, -1, keepdim=True)
    p = torch.exp(a - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))).mean(1)  # [T, N]
    s = torch.einsum("thd,sd->ths", q_i, k_i).relu()
    logits = torch.einsum("ths,th->ts", s, w).masked_fill(~valid, float("-inf"))
    logp_i = torch.log_softmax(logits, -1)
    term = torch.where(valid, torch.xlogy(p, p) - p * torch.where(valid, logp_i, torch.zeros_like(logp_i)),
                       torch.zeros_like(p))
    return term.sum(-1), p, valid, lse.squeeze(-1)


def _grads64(fn, leaves, gout):
    xs = [x.detach().double().requires_grad_(True) for x in leaves]
    out = fn(*xs)
    (out * gout).sum().backward()
    return out.detach(), [x.grad for x in xs]


CU = torch.tensor([0, 101, 101, 257, 300], dtype=torch.int32)  # odd lengths and an empty sequence


def _random_bounds(t, n, seed):
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, n, (t,), generator=g)
    ke = (ks + torch.randint(-5, n, (t,), generator=g)).clamp(0, n)
    ks[0], ke[0] = 3, 3  # empty
    ks[1], ke[1] = 0, n
    ks[2], ke[2] = n - 1, n  # one key at the end
    return ks, ke


# ------------------------------------------------------------------------------------------------ GPU


@needs_sm90
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("bounds", ["packed", "random"])
def test_target_kernel(cluster, bounds, monkeypatch):
    """The raw target kernel into a NaN-poisoned chunk (rows [37, 300) of 300): valid entries written and within
    P_REL_TOL of float64, nothing else touched; row statistics."""
    from deep_indexer import _C

    monkeypatch.setenv("DI_TRAINING_TARGET_CLUSTER", str(cluster))
    t = n = 300
    _, _, _, q, k = _inputs(t, n, 128, seed=11)
    ks, ke = packed_bounds(CU) if bounds == "packed" else _random_bounds(t, n, 5)
    ks, ke = ks.cuda(), ke.cuda()
    scale = 0.07
    q_i, k_i, w = (x.double() for x in _inputs(t, n, 128, seed=11)[:3])
    _, p_ref, valid, lse = _naive_mean_loss(q_i, k_i, w, q, k, scale, ks, ke)
    r0, r1 = 37, 300
    p = torch.full((r1 - r0, n + 4), float("nan"), device="cuda")
    plogp = torch.full((t,), 7.0, device="cuda")
    mass = torch.full((t,), 7.0, device="cuda")
    lse32 = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).float().expand(t, 128).contiguous()
    _C.bf16_training_target(q, k, lse32, ks.int(), ke.int(), p, plogp, mass, r0, r1, scale, 1.0 / 128)
    got, want, v = p[:, :n], p_ref[r0:r1], valid[r0:r1]
    assert not torch.isnan(got[v]).any(), "valid entries not written"
    assert torch.isnan(got[~v]).all() and torch.isnan(p[:, n:]).all(), "entries outside the ranges written"
    rel = ((got[v].double() - want[v]).abs() / want[v].abs().clamp_min(1e-30)).max().item()
    assert rel < P_REL_TOL, f"p: max relative error {rel:.3g}"
    want_plogp = torch.where(valid, torch.xlogy(p_ref, p_ref), torch.zeros_like(p_ref)).sum(-1)
    want_mass = torch.where(valid, p_ref, torch.zeros_like(p_ref)).sum(-1)
    assert (plogp[:r0] == 7.0).all() and (mass[:r0] == 7.0).all(), "statistics of rows outside the call written"
    torch.testing.assert_close(plogp[r0:].double(), want_plogp[r0:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass[r0:].double(), want_mass[r0:], rtol=1e-5, atol=1e-5)


def _loss_case(di, bounds, seed, t=300):
    x = _inputs(t, t, di, seed=seed)
    if bounds == "packed":
        ks, ke = packed_bounds(CU)
        kw = dict(cu_seqlens=CU)
    else:
        ks, ke = _random_bounds(t, t, seed)
        kw = dict(ks=ks, ke=ke)
    return x, ks.cuda(), ke.cuda(), kw


@needs_sm90
@pytest.mark.parametrize("di", [64, 128])
@pytest.mark.parametrize("bounds", ["packed", "random"])
@pytest.mark.parametrize("chunked", [False, True])
def test_mean_loss_against_fp64(di, bounds, chunked, monkeypatch):
    """indexer_kl_loss(backend="sm90"): per-token loss and gradients against float64 (several row chunks when
    `chunked`: chunk buffers of 64 rows, rows offset by the chunk start)."""
    if chunked:
        monkeypatch.setattr(fast, "_CHUNK_BYTES", 64 * 300 * 4)
    (q_i, k_i, w, q, k), ks, ke, kw = _loss_case(di, bounds, seed=21 + di)
    scale = 576 ** -0.5
    gout = torch.randn(q.shape[0], generator=torch.Generator().manual_seed(3), dtype=F64).cuda()
    ref, g_ref = _grads64(lambda a, b, c: _naive_mean_loss(a, b, c, q, k, scale, ks, ke)[0], (q_i, k_i, w), gout)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q_i, k_i, w)]
    res = indexer_kl_loss(*leaves, q, k, scale, backend="sm90", reduction="sum", **kw)
    (res.per_token.double() * gout).sum().backward()
    err = (res.per_token.double() - ref).abs().max().item()
    assert err <= LOSS_TOL * max(1.0, ref.abs().max().item()), f"loss: max abs error {err:.3g}"
    assert res.per_token.dtype == torch.float32
    for name, a, b in zip(("dq_I", "dk_I", "dw"), [x.grad for x in leaves], g_ref):
        d = calc_diff(a.double(), b)
        assert d < GRAD_TOL, f"{name}: calc_diff {d:.3g} vs float64"
    # the fp32 gradients inside, before autograd rounds dq_I / dk_I to bf16
    lse = indexer_kl_loss(q_i, k_i, w, q, k, scale, backend="torch", **kw).attn_lse
    ks_c, ke_c = ks.cpu(), ke.cpu()
    _, lse_i, mass = fast.mean_fwd(q_i, k_i, w, q, k, scale, lse, ks, ke, ks_c, ke_c, 128, False)
    inner = fast.mean_bwd(gout.float(), q_i, k_i, w, q, k, scale, lse, lse_i, mass, ks, ke, ks_c, ke_c, 128)
    for name, a, b in zip(("dq_I", "dk_I", "dw"), inner, g_ref):
        assert a.dtype == torch.float32
        d = calc_diff(a.double(), b)
        assert d < GRAD_TOL, f"{name} (fp32): calc_diff {d:.3g} vs float64"


@needs_sm90
@pytest.mark.parametrize("heads", [64, 40])
@pytest.mark.parametrize("given_lse", [False, True])
def test_mean_loss_fewer_heads(heads, given_lse, monkeypatch):
    """Fewer than 128 attention heads (a tensor-parallel rank's share) on the SM90 path, padded in blocks of rows
    (blocks of 64 rows here): loss and gradients against float64, the computed LSE against float64, and
    two ranks of heads / 2 (total_heads = heads) whose gradients sum to the one-rank gradients."""
    monkeypatch.setattr(fast, "_CHUNK_BYTES", 64 * 128 * 576 * 2)
    (q_i, k_i, w, q, k), ks, ke, kw = _loss_case(128, "random", seed=81 + heads)
    q = q[:, :heads].contiguous()
    scale = 576 ** -0.5
    assert fast.loss_unsupported(q_i, k_i, q, k, False) is None
    gout = torch.randn(q.shape[0], generator=torch.Generator().manual_seed(5), dtype=F64).cuda()
    ref, g_ref = _grads64(lambda a, b, c: _naive_mean_loss(a, b, c, q, k, scale, ks, ke)[0], (q_i, k_i, w), gout)
    _, _, valid, ref_lse = _naive_mean_loss(q_i.double(), k_i.double(), w.double(), q, k, scale, ks, ke)
    lse = ref_lse.float() if given_lse else None
    leaves = [x.detach().clone().requires_grad_(True) for x in (q_i, k_i, w)]
    res = indexer_kl_loss(*leaves, q, k, scale, attn_lse=lse, backend="sm90", reduction="sum", **kw)
    (res.per_token.double() * gout).sum().backward()
    err = (res.per_token.double() - ref).abs().max().item()
    assert err <= LOSS_TOL * max(1.0, ref.abs().max().item()), f"loss: max abs error {err:.3g}"
    for name, a, b in zip(("dq_I", "dk_I", "dw"), [x.grad for x in leaves], g_ref):
        d = calc_diff(a.double(), b)
        assert d < GRAD_TOL, f"{name}: calc_diff {d:.3g} vs float64"
    if not given_lse:
        live = valid.any(-1)
        assert res.attn_lse.shape == (q.shape[0], heads) and torch.isneginf(res.attn_lse[~live]).all()
        e = (res.attn_lse[live].double() - ref_lse[live]).abs().max().item()
        assert e < 1e-5 * max(1.0, ref_lse[live].abs().max().item()), f"lse: max abs error {e:.3g}"
    half = heads // 2
    g_sum = [torch.zeros(x.shape, dtype=F64, device="cuda") for x in (q_i, k_i, w)]
    for sl in (slice(0, half), slice(half, heads)):
        part = [x.detach().clone().requires_grad_(True) for x in (q_i, k_i, w)]
        r = indexer_kl_loss(*part, q[:, sl].contiguous(), k, scale, total_heads=heads, backend="sm90",
                            reduction="sum", **kw)
        (r.per_token.double() * gout).sum().backward()
        for acc, x in zip(g_sum, part):
            acc += x.grad.double()
    for name, a, b in zip(("dq_I", "dk_I", "dw"), g_sum, g_ref):
        d = calc_diff(a, b)
        assert d < GRAD_TOL, f"{name} summed over two ranks: calc_diff {d:.3g} vs float64"


@needs_sm90
@pytest.mark.parametrize("cluster", [1, 2])
def test_attention_lse_kernel(cluster, monkeypatch):
    """attn_lse=None on the SM90 path: the kernel's LSE against float64 (fp32 sums, ex2.approx: ~1e-6), -inf for
    empty rows, and the loss against float64 with it."""
    monkeypatch.setenv("DI_TRAINING_TARGET_CLUSTER", str(cluster))
    (q_i, k_i, w, q, k), ks, ke, kw = _loss_case(128, "random", seed=71)
    scale = 0.05
    ref_loss, _, valid, ref_lse = _naive_mean_loss(q_i.double(), k_i.double(), w.double(), q, k, scale, ks, ke)
    res = indexer_kl_loss(q_i, k_i, w, q, k, scale, backend="sm90", **kw)
    empty = ~valid.any(-1)
    assert torch.isneginf(res.attn_lse[empty]).all()
    err = (res.attn_lse[~empty].double() - ref_lse[~empty]).abs().max().item()
    assert err < 1e-5 * max(1.0, ref_lse[~empty].abs().max().item()), f"lse: max abs error {err:.3g}"
    err = (res.per_token.double() - ref_loss).abs().max().item()
    assert err <= LOSS_TOL * max(1.0, ref_loss.abs().max().item()), f"loss: max abs error {err:.3g}"


@needs_sm90
def test_mean_loss_deterministic_and_clusters(monkeypatch):
    """Bitwise identical loss and gradients run to run, and with clusters of 1 or 2 CTAs in the target kernel."""
    (q_i, k_i, w, q, k), _, _, kw = _loss_case(128, "packed", seed=41)
    runs = []
    for cluster in ("2", "2", "1"):
        monkeypatch.setenv("DI_TRAINING_TARGET_CLUSTER", cluster)
        leaves = [x.detach().clone().requires_grad_(True) for x in (q_i, k_i, w)]
        res = indexer_kl_loss(*leaves, q, k, backend="sm90", **kw)
        res.loss.backward()
        runs.append([res.per_token, res.indexer_lse, res.target_mass] + [x.grad for x in leaves])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@needs_sm90
def test_mean_loss_masked_rows_and_auto_dispatch(monkeypatch):
    """token_mask rows: loss 0, no gradient; every row masked: all zeros. "auto" takes the kernels here."""
    (q_i, k_i, w, q, k), _, _, kw = _loss_case(128, "packed", seed=51)
    calls = []
    real = fast.mean_fwd
    monkeypatch.setattr(fast, "mean_fwd", lambda *a: calls.append(1) or real(*a))
    mask = torch.rand(q.shape[0], generator=torch.Generator().manual_seed(2)) > 0.3
    leaves = [x.detach().clone().requires_grad_(True) for x in (q_i, k_i, w)]
    res = indexer_kl_loss(*leaves, q, k, token_mask=mask, **kw)
    res.loss.backward()
    assert calls, "backend='auto' did not take the SM90 path"
    assert (res.per_token[~mask.cuda()] == 0).all()
    assert (leaves[0].grad[~mask.cuda()] == 0).all() and (leaves[2].grad[~mask.cuda()] == 0).all()
    ref = indexer_kl_loss(q_i, k_i, w, q, k, token_mask=mask, backend="torch", **kw)
    err = (res.per_token - ref.per_token).abs().max().item()
    assert err <= LOSS_TOL * max(1.0, ref.per_token.abs().max().item())
    none = torch.zeros_like(mask)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q_i, k_i, w)]
    res = indexer_kl_loss(*leaves, q, k, token_mask=none, **kw)
    res.loss.backward()
    assert res.loss.item() == 0 and all((x.grad == 0).all() for x in leaves)


def _per_head_inputs(t, n, heads, kv_heads, dqk, seed, di=64):
    """per_head inputs: kv_heads = 0 gives one key head as k [N, Dqk]; else k [N, kv_heads, Dqk]."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * std).to(device="cuda", dtype=torch.bfloat16)

    q_i = r(t, heads, di, std=di ** -0.25)
    k_i = r(n, di, std=di ** -0.25)
    w = (torch.randn(t, heads, generator=g, dtype=F64) * 0.5).float().cuda()
    q = r(t, heads, dqk)
    k = r(n, dqk) if kv_heads == 0 else r(n, kv_heads, dqk)
    return q_i, k_i, w, q, k


def _naive_per_head_loss(q_i, k_i, w, q, k, scale, ks, ke):
    """Per-token mean over heads of KL(softmax(A_h) || softmax(I_h)) in float64, and the attention LSE [T, H]."""
    heads = q.shape[1]
    kk = k.double().unsqueeze(1) if k.dim() == 2 else k.double()
    kk = kk.repeat_interleave(heads // kk.shape[1], dim=1)  # [N, H, Dqk]
    a = scale * torch.einsum("thd,shd->ths", q.double(), kk)
    cols = torch.arange(k.shape[0], device=q.device)
    valid = ((cols >= ks[:, None]) & (cols < ke[:, None]))[:, None, :]
    a = a.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(a, -1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(a - safe[..., None])
    logits = (torch.einsum("thd,sd->ths", q_i, k_i).relu() * w[..., None]).masked_fill(~valid, float("-inf"))
    logp_i = torch.log_softmax(logits, -1)
    term = torch.where(valid, torch.xlogy(p, p) - p * torch.where(valid, logp_i, torch.zeros_like(logp_i)),
                       torch.zeros_like(p))
    return term.sum(-1).mean(-1), lse


PER_HEAD_CASES = [  # (heads, kv_heads, dqk): the seeds' MHA shape, GQA, MQA, odd head counts, every attention dim
    (64, 64, 128), (64, 16, 128), (64, 0, 128), (12, 12, 64), (6, 3, 192), (5, 0, 64)]


@needs_sm90
@pytest.mark.parametrize("heads,kv_heads,dqk", PER_HEAD_CASES)
@pytest.mark.parametrize("bounds", ["packed", "random"])
def test_per_head_loss_against_fp64(heads, kv_heads, dqk, bounds, monkeypatch):
    """indexer_kl_loss(target="per_head", backend="sm90"): loss, statistics and gradients against float64, with
    the heads of the dk_I kernel in 1 group or in uneven groups."""
    t = 300
    q_i, k_i, w, q, k = _per_head_inputs(t, t, heads, kv_heads, dqk, seed=heads + dqk)
    if bounds == "packed":
        ks, ke = packed_bounds(CU)
        kw = dict(cu_seqlens=CU)
    else:
        ks, ke = _random_bounds(t, t, seed=dqk)
        kw = dict(ks=ks, ke=ke)
    ks, ke = ks.cuda(), ke.cuda()
    scale = dqk ** -0.5
    gout = torch.randn(t, generator=torch.Generator().manual_seed(5), dtype=F64).cuda()
    ref_lse = _naive_per_head_loss(q_i, k_i, w, q, k, scale, ks, ke)[1]
    ref, g_ref = _grads64(lambda a, b, c: _naive_per_head_loss(a, b, c, q, k, scale, ks, ke)[0], (q_i, k_i, w), gout)
    for groups in ("1", "5"):
        monkeypatch.setenv("DI_TRAINING_PER_HEAD_GROUPS", groups)
        leaves = [x.detach().clone().requires_grad_(True) for x in (q_i, k_i, w)]
        res = indexer_kl_loss(*leaves, q, k, scale, attn_lse=ref_lse.float(), target="per_head", backend="sm90",
                              reduction="sum", **kw)
        (res.per_token.double() * gout).sum().backward()
        err = (res.per_token.double() - ref).abs().max().item()
        assert err <= LOSS_TOL * max(1.0, ref.abs().max().item()), f"loss: max abs error {err:.3g}"
        assert res.indexer_lse.shape == (t, heads) and res.target_mass.shape == (t, heads)
        empty = ke <= ks
        assert torch.isneginf(res.indexer_lse[empty]).all() and (res.target_mass[empty] == 0).all()
        torch.testing.assert_close(res.target_mass[~empty].double(), torch.ones_like(res.target_mass[~empty].double()),
                                   rtol=0, atol=1e-5)
        for name, a, b in zip(("dq_I", "dk_I", "dw"), [x.grad for x in leaves], g_ref):
            d = calc_diff(a.double(), b)
            assert d < GRAD_TOL, f"{name} (groups {groups}): calc_diff {d:.3g} vs float64"
    # the statistics and the fp32 gradients inside, against the portable path / float64
    lse_i_ref = indexer_kl_loss(q_i, k_i, w, q, k, scale, attn_lse=ref_lse.float(), target="per_head",
                                backend="torch", **kw).indexer_lse
    loss, lse_i, mass = fast.per_head_fwd(q_i, k_i, w, q, k, scale, ref_lse.float(), ks, ke, heads)
    live = torch.isfinite(lse_i_ref)
    assert torch.equal(live, torch.isfinite(lse_i))
    torch.testing.assert_close(lse_i[live], lse_i_ref[live].float(), rtol=1e-5, atol=1e-5)
    inner = fast.per_head_bwd(gout.float(), q_i, k_i, w, q, k, scale, ref_lse.float(), lse_i, mass, ks, ke, heads)
    for name, a, b in zip(("dq_I", "dk_I", "dw"), inner, g_ref):
        assert a.dtype == torch.float32
        d = calc_diff(a.double(), b)
        assert d < GRAD_TOL, f"{name} (fp32): calc_diff {d:.3g} vs float64"


@needs_sm90
def test_per_head_deterministic_long_rows_and_auto(monkeypatch):
    """Several key blocks and row pairs (T = 1000 causal in two sequences), rows without keys, no attn_lse (computed
    by the portable path); bitwise identical run to run; "auto" takes the kernels."""
    t = 1000
    q_i, k_i, w, q, k = _per_head_inputs(t, t, 8, 8, 128, seed=9)
    cu = torch.tensor([0, 37, 1000], dtype=torch.int32)
    mask = torch.rand(t, generator=torch.Generator().manual_seed(4)) > 0.2
    calls = []
    real = fast.per_head_fwd
    monkeypatch.setattr(fast, "per_head_fwd", lambda *a: calls.append(1) or real(*a))
    runs = []
    for _ in range(2):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q_i, k_i, w)]
        res = indexer_kl_loss(*leaves, q, k, 0.1, cu_seqlens=cu, target="per_head", token_mask=mask)
        res.loss.backward()
        runs.append([res.per_token, res.indexer_lse, res.target_mass] + [x.grad for x in leaves])
    assert len(calls) == 2, "backend='auto' did not take the SM90 path"
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    ks, ke = packed_bounds(cu)
    ke = torch.where(mask, ke, ks)
    ks, ke = ks.cuda(), ke.cuda()
    gout = torch.ones(t, dtype=F64, device="cuda") / mask.sum().item()
    ref, g_ref = _grads64(lambda a, b, c: _naive_per_head_loss(a, b, c, q, k, 0.1, ks, ke)[0], (q_i, k_i, w), gout)
    err = (runs[0][0].double() - ref).abs().max().item()
    assert err <= LOSS_TOL * max(1.0, ref.abs().max().item()), f"loss: max abs error {err:.3g}"
    assert (runs[0][0][~mask.cuda()] == 0).all()
    for name, a, b in zip(("dq_I", "dk_I", "dw"), runs[0][3:], g_ref):
        d = calc_diff(a.double(), b)
        assert d < GRAD_TOL, f"{name}: calc_diff {d:.3g} vs float64"


@needs_sm90
@pytest.mark.parametrize("di", [64, 128])
@pytest.mark.parametrize("chunked", [False, True])
def test_logits_backward_against_fp64(di, chunked, monkeypatch):
    """indexer_logits(backend="sm90") backward (dk_I key-major with the sign mask, masked dq_I / dw row-major)
    against float64, random bounds with empty and one-key rows; bitwise reproducible. `chunked`: a mask budget of
    33 rows, so 11 row chunks, each with its own key range."""
    if chunked:
        monkeypatch.setattr(fast, "_MASK_BYTES", 0)
    t, n = 333, 517
    q_i, k_i, w, _, _ = _inputs(t, n, di, dqk=64, seed=61 + di)
    ks, ke = _random_bounds(t, n, 9)
    gout = torch.randn(t, n, generator=torch.Generator().manual_seed(4), dtype=F64).cuda()

    def naive(a, b, c):
        cols = torch.arange(n, device=a.device)
        valid = (cols >= ks.cuda()[:, None]) & (cols < ke.cuda()[:, None])
        out = torch.einsum("ths,th->ts", torch.einsum("thd,sd->ths", a, b).relu(), c)
        return torch.where(valid, out, torch.zeros_like(out))

    _, g_ref = _grads64(naive, (q_i, k_i, w), gout)
    runs = []
    for _ in range(2):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q_i, k_i, w)]
        out = indexer_logits(*leaves, ks=ks, ke=ke, backend="sm90")
        (torch.where(torch.isfinite(out), out, torch.zeros_like(out)) * gout.float()).sum().backward()
        runs.append([x.grad for x in leaves])
    for name, a, b in zip(("dq_I", "dk_I", "dw"), runs[0], g_ref):
        d = calc_diff(a.double(), b)
        assert d < GRAD_TOL, f"{name}: calc_diff {d:.3g} vs float64"
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@needs_sm90
def test_masked_dq_kernel_fp32_and_bf16_out():
    """The raw kernels: the dk kernel's sign mask for rows [40, 300) and keys [64, 517), then the masked dq kernel
    into NaN-poisoned fp32 and bf16 outputs for rows [41, 299): rows outside untouched, keys below 64 ignored
    (the mask's range), dq_I / dw within GRAD_TOL of float64 on the clamped bounds, bf16 = fp32 rounded."""
    from deep_indexer import _C

    t, n, r0, r1, key0 = 333, 517, 40, 300, 64
    q_i, k_i, w, _, _ = _inputs(t, n, 128, dqk=64, seed=77)
    ks, ke = _random_bounds(t, n, 13)
    grad = torch.randn(t, n, generator=torch.Generator().manual_seed(6)).cuda()
    ks32, ke32 = ks.int().cuda(), ke.int().cuda()
    mask = torch.empty(r1 - r0, fast.mask_words_per_row(n - key0), dtype=torch.int32, device="cuda")
    _C.bf16_indexer_logits_bwd_dk(q_i, k_i, w, ks32, ke32, grad, 0, None, None, None, None, r0, r1, key0, n, mask, r0)
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        dq = torch.full((t, 64, 128), float("nan"), dtype=dtype, device="cuda")
        dw = torch.full((t, 64), float("nan"), device="cuda")
        _C.bf16_indexer_logits_bwd_dq(q_i, k_i, w, ks32, ke32, grad, 0, dq, dw, r0 + 1, r1 - 1, mask, r0, key0, n)
        rows = slice(r0 + 1, r1 - 1)
        assert torch.isnan(dq[: r0 + 1]).all() and torch.isnan(dq[r1 - 1:]).all(), "rows outside written"
        assert torch.isnan(dw[: r0 + 1]).all() and torch.isnan(dw[r1 - 1:]).all(), "rows outside written"
        outs[dtype] = dq[rows], dw[rows]
    lo, hi = ks.clamp_min(key0)[r0 + 1:r1 - 1].cuda(), ke[r0 + 1:r1 - 1].cuda()
    qd, kd, wd = q_i[r0 + 1:r1 - 1].double(), k_i.double(), w[r0 + 1:r1 - 1].double()
    s = torch.einsum("thd,sd->ths", qd, kd)
    cols = torch.arange(n, device="cuda")
    gv = torch.where((cols >= lo[:, None]) & (cols < hi[:, None]), grad[r0 + 1:r1 - 1].double(), 0.0)
    dq_ref = torch.einsum("ths,sd->thd", gv[:, None, :] * wd[:, :, None] * (s > 0), kd)
    dw_ref = torch.einsum("ts,ths->th", gv, s.relu())
    assert calc_diff(outs[torch.float32][0].double(), dq_ref) < GRAD_TOL
    assert calc_diff(outs[torch.float32][1].double(), dw_ref) < GRAD_TOL
    assert torch.equal(outs[torch.float32][0].bfloat16(), outs[torch.bfloat16][0])
    assert torch.equal(outs[torch.float32][1], outs[torch.bfloat16][1])


# ------------------------------------------------------------------------------------------------ CPU


def test_backend_argument_and_cpu_fallback():
    x = _inputs(40, 40, 64, dqk=64, seed=1, device="cpu")
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="backend: expected one of"):
        indexer_kl_loss(*x, cu_seqlens=cu, backend="cuda")
    with pytest.raises(ValueError, match="backend='sm90'.*SM90"):
        indexer_kl_loss(*x, cu_seqlens=cu, backend="sm90")
    auto = indexer_kl_loss(*x, cu_seqlens=cu)
    torch_ = indexer_kl_loss(*x, cu_seqlens=cu, backend="torch")
    assert torch.equal(auto.per_token, torch_.per_token)


def test_unsupported_reasons():
    q_i, k_i, _, q, k = _inputs(4, 4, 64, dqk=64, seed=1, device="cpu")
    assert "SM90" in fast.loss_unsupported(q_i, k_i, q, k, False)
    assert "SM90" in fast.loss_unsupported(q_i, k_i, q, k, True)
    assert "SM90" in fast.logits_unsupported(q_i, k_i)
    assert "SM90" in fast.lse_unsupported(q, k)


def test_kernel_entries_check_arguments_on_cpu():
    """The kernel entries validate shapes and dtypes (before the device) with messages naming the argument."""
    from deep_indexer import _C

    bf = torch.bfloat16
    t, n = 6, 9
    q, k = torch.zeros(t, 128, 576, dtype=bf), torch.zeros(n, 576, dtype=bf)
    lse, ks, ke = torch.zeros(t, 128), torch.zeros(t, dtype=torch.int32), torch.ones(t, dtype=torch.int32)
    p = torch.zeros(t, n)
    with pytest.raises(ValueError, match="q has 64 heads"):
        _C.bf16_training_target(torch.zeros(t, 64, 576, dtype=bf), k, lse, ks, ke, p, None, None, 0, t, 0.1, 1 / 128)
    with pytest.raises(ValueError, match="attn_lse"):
        _C.bf16_training_target(q, k, lse[:, :4], ks, ke, p, None, None, 0, t, 0.1, 1 / 128)
    with pytest.raises(ValueError, match=r"rows \[0, 7\)"):
        _C.bf16_training_target(q, k, lse, ks, ke, p, None, None, 0, 7, 0.1, 1 / 128)
    with pytest.raises(ValueError, match="p must have at least"):
        _C.bf16_training_target(q, k, lse, ks, ke, p[:, :4], None, None, 0, t, 0.1, 1 / 128)
    with pytest.raises(ValueError, match="CUDA"):
        _C.bf16_training_target(q, k, lse, ks, ke, p, None, None, 0, t, 0.1, 1 / 128)
    q_i, k_i, w = torch.zeros(t, 64, 128, dtype=bf), torch.zeros(n, 128, dtype=bf), torch.zeros(t, 64)
    with pytest.raises(ValueError, match="64 heads of dim 64 or 128"):
        _C.bf16_indexer_logits_bwd_dk(torch.zeros(t, 32, 128, dtype=bf), k_i, w, ks, ke, p, 0, None, None, None, None, 0, t,
                                      0, n)
    with pytest.raises(ValueError, match="given together"):
        _C.bf16_indexer_logits_bwd_dk(q_i, k_i, w, ks, ke, p, 0, torch.zeros(t), None, None, None, 0, t, 0, n)
    with pytest.raises(ValueError, match="dq must have shape"):
        _C.bf16_indexer_logits_bwd_dq(q_i, k_i, w, ks, ke, p, 0, torch.zeros(t, 64, 64), torch.zeros(t, 64), 0, t)
    # the sign mask: int32 [rows, 256 words per 128 keys]; bf16 dq_I only with it
    with pytest.raises(ValueError, match="mask_out must have at least 6 rows and 256 columns"):
        _C.bf16_indexer_logits_bwd_dk(q_i, k_i, w, ks, ke, p, 0, None, None, None, None, 0, t, 0, n,
                                      torch.zeros(6, 128, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="mask_out must have dtype"):
        _C.bf16_indexer_logits_bwd_dk(q_i, k_i, w, ks, ke, p, 0, None, None, None, None, 0, t, 0, n,
                                      torch.zeros(6, 256), 0)
    with pytest.raises(ValueError, match="mask_out is for the logits backward"):
        _C.bf16_indexer_logits_bwd_dk(q_i, k_i, w, ks, ke, p, 0, torch.zeros(t), torch.zeros(t), torch.zeros(t), p, 0,
                                      t, 0, n, torch.zeros(6, 256, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="mask keys"):
        _C.bf16_indexer_logits_bwd_dq(q_i, k_i, w, ks, ke, p, 0, torch.zeros(t, 64, 128, dtype=bf), torch.zeros(t, 64),
                                      0, t, torch.zeros(6, 256, dtype=torch.int32), 0, 5, n + 1)
    with pytest.raises(ValueError, match="dq must have dtype"):
        _C.bf16_indexer_logits_bwd_dq(q_i, k_i, w, ks, ke, p, 0, torch.zeros(t, 64, 128, dtype=bf), torch.zeros(t, 64),
                                      0, t)
    with pytest.raises(ValueError, match="lse_out must have shape"):
        _C.bf16_indexer_logits_stats(q_i, k_i, w, ks, ke, p, torch.zeros(t + 1), torch.zeros(t), 0, t)
    # per_head entries
    qh, kh, qih, kih = (torch.zeros(t, 8, 128, dtype=bf), torch.zeros(n, 8, 128, dtype=bf), torch.zeros(t, 8, 64, dtype=bf),
                        torch.zeros(n, 64, dtype=bf))
    lh, wh, kl = torch.zeros(t, 8), torch.zeros(t, 8), torch.zeros(t, 8)
    with pytest.raises(ValueError, match="attention dim 128 with indexer dim 128"):
        _C.bf16_per_head_fwd(qh, kh, torch.zeros(t, 8, 128, dtype=bf), torch.zeros(n, 128, dtype=bf), ks, ke, lh, wh,
                             kl, kl, kl, 0.1)
    with pytest.raises(ValueError, match="3 key heads"):
        _C.bf16_per_head_fwd(qh, torch.zeros(n, 3, 128, dtype=bf), qih, kih, ks, ke, lh, wh, kl, kl, kl, 0.1)
    with pytest.raises(ValueError, match="attn_lse must have shape"):
        _C.bf16_per_head_fwd(qh, kh, qih, kih, ks, ke, lh[:, :4], wh, kl, kl, kl, 0.1)
    with pytest.raises(ValueError, match="mass must have shape"):
        _C.bf16_per_head_fwd(qh, kh, qih, kih, ks, ke, lh, wh, kl, kl, kl[1:], 0.1)
    with pytest.raises(ValueError, match="dq must have shape"):
        _C.bf16_per_head_bwd(qh, kh, qih, kih, ks, ke, lh, wh, lh, lh, torch.zeros(t), kl, kl, 0.1)
    with pytest.raises(ValueError, match="g must have shape"):
        _C.bf16_per_head_bwd(qh, kh, qih, kih, ks, ke, lh, wh, lh, lh, torch.zeros(t + 1), torch.zeros(t, 8, 64), kl, 0.1)
    with pytest.raises(ValueError, match="CUDA"):
        _C.bf16_per_head_fwd(qh, kh, qih, kih, ks, ke, lh, wh, kl, kl, kl, 0.1)



def test_new_variants_are_registered():
    import deep_indexer.jit as jit

    ops = {v.op for v in jit.variants()}
    assert {"training_target", "training_logits_stats", "training_indexer_dk", "training_indexer_dq",
            "training_per_head_rows", "training_per_head_dk"} <= ops
    from deep_indexer import _C

    for qk, d in jit.TRAINING_PER_HEAD_DIMS:
        assert _C.training_per_head_supported(qk, d)
    assert not _C.training_per_head_supported(128, 128)  # over the register budget (spills)
