"""deep_indexer.training under torch.compile: the custom ops (opcheck) and fullgraph compiled losses and gradients
matching eager mode exactly (CPU)."""
import pytest
import torch

from deep_indexer.training import indexer_kl_loss, indexer_logits, packed_bounds, sparse_indexer_kl_loss

OPS = torch.ops.deep_indexer
F32, F64 = torch.float32, torch.float64


def _inputs(t=11, h=4, d=8, heads=4, dqk=16, hkv=None, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_i = torch.randn(t, h, d, generator=g).to(dtype)
    k_i = torch.randn(t, d, generator=g).to(dtype)
    w = torch.randn(t, h, generator=g).to(dtype)
    q = torch.randn(t, heads, dqk, generator=g).to(dtype)
    k = (torch.randn(t, dqk, generator=g) if hkv is None else torch.randn(t, hkv, dqk, generator=g)).to(dtype)
    return q_i, k_i, w, q, k


def _bounds(t, seed=1):
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, t, (t,), generator=g)
    ke = (ks + torch.randint(0, t, (t,), generator=g)).clamp_max(t)
    ke[0] = ks[0]  # one empty row
    return ks, ke


def _cpu_copies(ks, ke):
    return ks.clone(), ke.clone()


# ------------------------------------------------------------------------------------------------ opcheck

# test_autograd_registration / aot_dispatch need no CUDA; all checks run on the CPU.
_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("grad", [False, True])
def test_opcheck_indexer_logits(grad):
    q_i, k_i, w, _, _ = _inputs(dtype=F64)
    ks, ke = _bounds(q_i.shape[0])
    for x in (q_i, k_i, w):
        x.requires_grad_(grad)
    torch.library.opcheck(OPS.indexer_logits_fwd, (q_i, k_i, w, ks, ke, *_cpu_copies(ks, ke), 4, 3, "torch"),
                          test_utils=_UTILS)
    g = torch.randn(q_i.shape[0], k_i.shape[0], dtype=F64)
    torch.library.opcheck(OPS.indexer_logits_bwd,
                          (g, q_i.detach(), k_i.detach(), w.detach(), ks, ke, *_cpu_copies(ks, ke), 4, 3),
                          test_utils=_UTILS)


def test_opcheck_bounds_and_lse():
    q_i, k_i, _, q, k = _inputs()
    t = q_i.shape[0]
    cu = torch.tensor([0, 3, 3, 8, t], dtype=torch.int32)
    mask = torch.rand(t) > 0.3
    ks, ke = _bounds(t)
    torch.library.opcheck(OPS.training_bounds, (q_i, t, None, None, cu, True, mask), test_utils=_UTILS)
    torch.library.opcheck(OPS.training_bounds, (q_i, t, ks, ke, None, False, None), test_utils=_UTILS)
    torch.library.opcheck(OPS.training_bounds, (q_i, t, ks.int(), ke.int(), None, False, None), test_utils=_UTILS)
    torch.library.opcheck(OPS.training_bounds, (q_i, t, None, None, None, True, None), test_utils=_UTILS)
    torch.library.opcheck(OPS.training_attention_lse, (q, k, 0.25, ks, ke, *_cpu_copies(ks, ke), 3, 4),
                          test_utils=_UTILS)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_opcheck_indexer_kl_loss(per_head, dtype):
    q_i, k_i, w, q, k = _inputs(dtype=dtype, hkv=2 if per_head else None)
    t, heads = q.shape[0], q.shape[1]
    ks, ke = _bounds(t)
    lse = OPS.training_attention_lse(q, k, 0.3, ks, ke, *_cpu_copies(ks, ke), None, None)
    for x in (q_i, k_i, w):
        x.requires_grad_(True)
    args = (q_i, k_i, w, q, k, lse, ks, ke, *_cpu_copies(ks, ke), 0.3, per_head, heads, False, 4, 5)
    torch.library.opcheck(OPS.indexer_kl_loss_fwd, args, test_utils=_UTILS)
    loss, lse_i, mass = OPS.indexer_kl_loss_fwd(*args)
    g = torch.randn(t, dtype=loss.dtype)
    bargs = (g, q_i.detach(), k_i.detach(), w.detach(), q, k, lse, lse_i.detach(), mass.detach(), ks, ke,
             *_cpu_copies(ks, ke), 0.3, per_head, heads, 4, 5)
    torch.library.opcheck(OPS.indexer_kl_loss_bwd, bargs, test_utils=_UTILS)


@pytest.mark.parametrize("per_head,given_lse,bounded", [(False, False, True), (False, True, False), (True, False, True)])
def test_opcheck_sparse_kl_loss(per_head, given_lse, bounded):
    q_i, k_i, w, q, k = _inputs(dtype=F64)
    t, heads, n = q.shape[0], q.shape[1], k.shape[0]
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(n, generator=g)[:5] for _ in range(t)])
    idx[:, -1] = -1
    ks, ke = _bounds(t) if bounded else (None, None)
    lse = torch.randn(t, heads, dtype=F64).add(3) if given_lse else None
    for x in (q_i, k_i, w):
        x.requires_grad_(True)
    args = (q_i, k_i, w, q, k, lse, idx, ks, ke, 0.3, per_head, heads, False, False, 4, True)
    torch.library.opcheck(OPS.sparse_indexer_kl_loss_fwd, args, test_utils=_UTILS)
    gr = torch.randn(t, dtype=F64)
    bargs = (gr, q_i.detach(), k_i.detach(), w.detach(), q, k, lse, idx, ks, ke, 0.3, per_head, heads, True, 4)
    torch.library.opcheck(OPS.sparse_indexer_kl_loss_bwd, bargs, test_utils=_UTILS)


# ------------------------------------------------------------------------------------------------ compile


def _grads(fn, *leaves):
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = fn(*leaves)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss_for_grad = loss.masked_fill(~torch.isfinite(loss), 0).sum() if loss.dim() else loss
    loss_for_grad.backward()
    return out, [x.grad for x in leaves]


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b) or (torch.isnan(a).equal(torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _compare(fn, leaves, backend):
    torch._dynamo.reset()
    ref_out, ref_g = _grads(fn, *leaves)
    got_out, got_g = _grads(torch.compile(fn, fullgraph=True, backend=backend), *leaves)
    if isinstance(ref_out, torch.Tensor):
        _same(got_out, ref_out)
    else:
        for a, b in zip(got_out, ref_out):
            _same(a, b)
    for a, b in zip(got_g, ref_g):
        _same(a, b)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["cu_seqlens", "ks_ke", "all"])
def test_compiled_indexer_logits(backend, dtype, layout):
    q_i, k_i, w, _, _ = _inputs(dtype=dtype)
    t = q_i.shape[0]
    cu = torch.tensor([0, 4, 4, t])
    ks, ke = _bounds(t)
    kw = {"cu_seqlens": dict(cu_seqlens=cu), "ks_ke": dict(ks=ks, ke=ke), "all": {}}[layout]

    def fn(a, b, c):
        return indexer_logits(a, b, c, chunk_rows=4, chunk_keys=3, **kw) * 1.5

    _compare(fn, (q_i, k_i, w), backend)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("target,hkv,given", [("mean", None, False), ("mean", 2, True), ("per_head", None, True),
                                              ("per_head", 2, False)])
def test_compiled_indexer_kl_loss(backend, target, hkv, given):
    q_i, k_i, w, q, k = _inputs(hkv=hkv)
    t = q.shape[0]
    cu = torch.tensor([0, 5, 5, t])
    mask = torch.ones(t, dtype=torch.bool)
    mask[2] = False
    # the attention's own LSE (from an eager call), or none (computed inside)
    lse = indexer_kl_loss(q_i, k_i, w, q, k, 0.3, cu_seqlens=cu).attn_lse if given else None

    def fn(a, b, c):
        return indexer_kl_loss(a, b, c, q, k, 0.3, cu_seqlens=cu, token_mask=mask, attn_lse=lse, target=target,
                               chunk_rows=3, chunk_keys=4)

    _compare(fn, (q_i, k_i, w), backend)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("target", ["mean", "per_head"])
@pytest.mark.parametrize("bounded", [False, True])
def test_compiled_sparse_kl_loss(backend, target, bounded):
    q_i, k_i, w, q, k = _inputs(dtype=torch.bfloat16)
    t, n = q.shape[0], k.shape[0]
    g = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(n, generator=g)[:6] for _ in range(t)])
    idx[1, 2:] = -1
    mask = torch.ones(t, dtype=torch.bool)
    mask[4] = False
    kw = dict(cu_seqlens=torch.tensor([0, 6, t]), causal=False) if bounded else {}

    def fn(a, b, c):
        return sparse_indexer_kl_loss(a, b, c, q, k, idx, 0.3, target=target, token_mask=mask, reduction="sum",
                                      chunk_rows=4, **kw)

    _compare(fn, (q_i, k_i, w), backend)


def test_compiled_training_step_no_graph_break():
    """A tiny module: the whole loss + backward traces as one graph (fullgraph raises on a break)."""
    torch.manual_seed(0)
    t, hi, di, heads, dqk = 9, 4, 8, 4, 16
    proj = torch.nn.Linear(16, hi * di + di + hi)
    x = torch.randn(t, 16)
    q = torch.randn(t, heads, dqk)
    k = torch.randn(t, dqk)
    cu = torch.tensor([0, 4, t])

    def step(x):
        y = proj(x)
        q_i = y[:, :hi * di].reshape(t, hi, di)
        k_i = y[:, hi * di:hi * di + di]
        w = y[:, hi * di + di:]
        return indexer_kl_loss(q_i, k_i, w, q, k, 0.25, cu_seqlens=cu).loss

    ref = step(x)
    ref.backward()
    ref_g = [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad()
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    got.backward()
    assert torch.equal(got, ref)
    for p, r in zip(proj.parameters(), ref_g):
        assert torch.equal(p.grad, r)


def test_compiled_validation_errors():
    """Value checks that read tensors run inside the ops: still raised under torch.compile."""
    q_i, k_i, w, q, k = _inputs()
    t = q_i.shape[0]
    torch._dynamo.reset()
    bad_ke = torch.full((t,), t + 1)
    with pytest.raises(Exception, match="ke: expected values"):
        torch.compile(lambda a: indexer_logits(a, k_i, w, ks=torch.zeros(t, dtype=torch.long), ke=bad_ke),
                      fullgraph=True, backend="eager")(q_i)
    idx = torch.zeros(t, 3, dtype=torch.long)
    with pytest.raises(Exception, match="distinct keys"):
        torch.compile(lambda a: sparse_indexer_kl_loss(a, k_i, w, q, k, idx).loss, fullgraph=True,
                      backend="eager")(q_i)


def test_compiled_graph_holds_the_custom_ops():
    """The traced graph calls the deep_indexer training ops (no fallback to the eager autograd.Functions)."""
    q_i, k_i, w, q, k = _inputs()
    t, n = q.shape[0], k.shape[0]
    idx = torch.stack([torch.randperm(n)[:4] for _ in range(t)])
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def fn(a):
        lg = indexer_logits(a, k_i, w, cu_seqlens=torch.tensor([0, 5, t]))
        dense = indexer_kl_loss(a, k_i, w, q, k, 0.3, cu_seqlens=torch.tensor([0, 5, t]))
        sparse = sparse_indexer_kl_loss(a, k_i, w, q, k, idx, 0.3)
        return lg.masked_fill(lg.isinf(), 0).sum() + dense.loss + sparse.loss

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(q_i)
    for op in ("training_bounds", "training_attention_lse", "indexer_logits_fwd", "indexer_kl_loss_fwd",
               "sparse_indexer_kl_loss_fwd"):
        assert any(f"deep_indexer.{op}" in s for s in seen), (op, seen)


def test_compiled_dynamic_shapes():
    """dynamic=True: two token counts through one compiled function, each matching eager exactly."""
    torch._dynamo.reset()

    def fn(a, b, c, q, k):
        return indexer_kl_loss(a, b, c, q, k, 0.3, target="per_head").loss

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for t in (7, 13):
        q_i, k_i, w, q, k = _inputs(t=t, seed=t)
        ref_out, ref_g = _grads(lambda a, b, c: fn(a, b, c, q, k), q_i, k_i, w)
        got_out, got_g = _grads(lambda a, b, c: compiled(a, b, c, q, k), q_i, k_i, w)
        _same(got_out, ref_out)
        for a, b in zip(got_g, ref_g):
            _same(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("sparse", [False, True])
def test_cuda_compiled_losses(backend, sparse):
    """CUDA, bounds and token_mask on the host: compiled (fullgraph) equals eager; bitwise except for inductor's
    own code around the ops (the reduction), which may round differently."""
    q_i, k_i, w, q, k = (x.cuda() for x in _inputs(t=300, dtype=torch.bfloat16))
    t, n = q.shape[0], k.shape[0]
    cu = torch.tensor([0, 100, 100, t])
    mask = torch.rand(t) > 0.1
    idx = torch.stack([torch.randperm(n)[:32] for _ in range(t)]).cuda()

    def fn(a, b, c):
        if sparse:
            return sparse_indexer_kl_loss(a, b, c, q, k, idx, 0.3, cu_seqlens=cu, token_mask=mask, deterministic=True)
        return indexer_kl_loss(a, b, c, q, k, 0.3, cu_seqlens=cu, token_mask=mask, chunk_keys=64)

    torch._dynamo.reset()
    ref_out, ref_g = _grads(fn, q_i, k_i, w)
    got_out, got_g = _grads(torch.compile(fn, fullgraph=True, backend=backend), q_i, k_i, w)
    if backend == "inductor":
        torch.testing.assert_close(got_out.per_token, ref_out.per_token, rtol=0, atol=0)
        torch.testing.assert_close(got_out.loss, ref_out.loss, rtol=1e-6, atol=0)
        for a, b in zip(got_g, ref_g):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-5)  # bf16 grads, 1/n rounding
    else:
        for a, b in zip(got_out, ref_out):
            _same(a, b)
        for a, b in zip(got_g, ref_g):
            _same(a, b)
