"""Distributed indexer training with deep_indexer.training, simulated in one process (CPU or one GPU).

Shows, and checks against a single-rank run of the same batch:
  1. tensor parallelism: the attention heads are split across ranks; each rank computes its heads' share
     of the target (total_heads=H), the indexer is replicated, and ONE all-reduce (sum) of the indexer
     gradients gives the exact gradient (the target p is linear in the per-head softmaxes);
  2. context parallelism: each rank holds a slice of the query rows (load-balanced "zigzag" halves of
     each sequence) and all the keys; packed_bounds(query_positions=...) gives the global causal ranges;
     the k_I gradient (all keys) is summed over ranks, dq_I and dweights stay local;
  3. padded rows: a token_mask drops them from the loss, the gradients and the mean.

With torch.distributed, `all_reduce` below is `dist.all_reduce(t, group=...)` over the TP or CP group.

On a Hopper GPU it runs in bfloat16 at sizes the SM90 kernels take (128 attention heads, so a TP rank holds
128 / tp of them; 64 indexer heads), and the checks compare up to bf16 rounding; elsewhere in float64, exact.

    python examples/training_distributed.py [--device cuda] [--tp 2] [--cp 2] [--dtype float64|bfloat16]
"""
import argparse

import torch

from deep_indexer.training import indexer_kl_loss, packed_bounds, sparse_indexer_kl_loss
from deep_indexer.training import sm90

CHECKS = []  # (what, relative difference)


def all_reduce(per_rank: list) -> torch.Tensor:
    """Stands for dist.all_reduce(SUM) across the simulated ranks."""
    return torch.stack(per_rank).sum(0)


def make_batch(lengths, pad_to, heads, dqk, heads_i, dim_i, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    t = max(pad_to, total)

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device)

    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)) + [t], dtype=torch.int32, device=device)
    mask = torch.arange(t, device=device) < total  # the last "sequence" is padding
    return dict(q_i=r(t, heads_i, dim_i, std=0.3).to(dtype), k_i=r(t, dim_i, std=0.3).to(dtype), w=r(t, heads_i, std=0.3),
                q=r(t, heads, dqk).to(dtype), k=r(t, dqk).to(dtype), cu=cu, mask=mask)


def loss_and_grads(b, q, q_i, w, rows=None, **kw):
    x = [t.detach().clone().requires_grad_(True) for t in (q_i, b["k_i"], w)]
    if rows is None:
        res = indexer_kl_loss(x[0], x[1], x[2], q, b["k"], cu_seqlens=b["cu"], token_mask=b["mask"],
                              reduction="sum", **kw)
    else:  # context parallel: local rows, all keys, global causal bounds
        ks, ke = packed_bounds(b["cu"], causal=True, query_positions=rows)
        res = indexer_kl_loss(x[0], x[1], x[2], q, b["k"], ks=ks, ke=ke, token_mask=b["mask"][rows],
                              reduction="sum", **kw)
    res.loss.backward()
    return res, [t.grad for t in x]


def reldiff(a, b, what):
    """max over the gradients of |a - b| / |b| (Frobenius norms), recorded for the final check."""
    d = max(float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-300)) for x, y in zip(a, b))
    CHECKS.append((what, d))
    return d


def tensor_parallel(b, tp):
    heads = b["q"].shape[1]
    full, g_full = loss_and_grads(b, b["q"], b["q_i"], b["w"])
    hs = heads // tp
    parts, grads = [], []
    for rank in range(tp):  # rank holds attention heads [rank * hs, (rank + 1) * hs)
        res, g = loss_and_grads(b, b["q"][:, rank * hs:(rank + 1) * hs], b["q_i"], b["w"], total_heads=heads)
        parts.append(res.loss.detach())
        grads.append(g)
    g_sum = [all_reduce([g[i] for g in grads]) for i in range(3)]  # the one all-reduce of the indexer grads
    ce = float(all_reduce(parts))
    print(f"TP={tp} (mean target): KL (1 rank) = {float(full.loss.detach()):.6f}; sum of ranks' cross-entropy = {ce:.6f} "
          f"(differs by the target's entropy, a constant for the indexer); grad rel. diff = {reldiff(g_sum, g_full, f'TP={tp} mean'):.2e}")
    # per_head target: indexer head h pairs with attention head h, so the indexer heads split too
    b2 = dict(b, q_i=b["q_i"].repeat(1, heads // b["q_i"].shape[1], 1)[:, :heads].contiguous(),
              w=b["w"].repeat(1, heads // b["w"].shape[1])[:, :heads].contiguous())
    full, g_full = loss_and_grads(b2, b2["q"], b2["q_i"], b2["w"], target="per_head")
    parts, dq, dk, dw = [], [], [], []
    for rank in range(tp):
        sl = slice(rank * hs, (rank + 1) * hs)
        res, g = loss_and_grads(b2, b2["q"][:, sl], b2["q_i"][:, sl], b2["w"][:, sl], target="per_head",
                                total_heads=heads)
        parts.append(res.loss.detach())
        dq.append(g[0])
        dk.append(g[1])
        dw.append(g[2])
    g_sum = [torch.cat(dq, 1), all_reduce(dk), torch.cat(dw, 1)]  # only k_I (shared) needs the all-reduce
    print(f"TP={tp} (per_head target): KL (1 rank) = {float(full.loss.detach()):.6f}; sum over ranks = "
          f"{float(all_reduce(parts)):.6f}; grad rel. diff = {reldiff(g_sum, g_full, f'TP={tp} per_head'):.2e}")


def context_parallel(b, cp):
    full, g_full = loss_and_grads(b, b["q"], b["q_i"], b["w"])
    cu = b["cu"].tolist()
    # zigzag split: every sequence in 2 * cp pieces; rank r takes pieces r and 2 cp - 1 - r (balances causal work)
    rows_of = [[] for _ in range(cp)]
    for s, e in zip(cu[:-1], cu[1:]):
        bounds = torch.linspace(s, e, 2 * cp + 1).round().long().tolist()
        for r in range(cp):
            for piece in (r, 2 * cp - 1 - r):
                rows_of[r] += list(range(bounds[piece], bounds[piece + 1]))
    total, dk = [], []
    dq, dw = torch.zeros_like(g_full[0]), torch.zeros_like(g_full[2])
    for r in range(cp):
        rows = torch.tensor(rows_of[r], device=b["q"].device)
        res, g = loss_and_grads(b, b["q"][rows], b["q_i"][rows], b["w"][rows], rows=rows)
        total.append(res.loss.detach())
        dq[rows], dw[rows] = g[0], g[2]  # local rows: no communication
        dk.append(g[1])  # all keys: sum over ranks (all-reduce, or reduce-scatter to the keys' owners)
    g_sum = [dq, all_reduce(dk), dw]
    print(f"CP={cp}: loss (1 rank) = {float(full.loss.detach()):.6f}; sum over ranks = {float(all_reduce(total)):.6f}; "
          f"grad rel. diff = {reldiff(g_sum, g_full, f'CP={cp}'):.2e}; valid rows = {int(full.num_tokens)} of {b['mask'].numel()}")


def sparse_tensor_parallel(b, tp, topk=16):
    heads = b["q"].shape[1]
    logits = torch.randn(b["q"].shape[0], b["k"].shape[0], device=b["q"].device)
    ks, ke = packed_bounds(b["cu"], causal=True)
    cols = torch.arange(logits.shape[1], device=logits.device)
    logits.masked_fill_((cols < ks[:, None]) | (cols >= ke[:, None]), float("-inf"))
    idx = logits.topk(topk, dim=1).indices.int()  # out-of-range picks of short rows are dropped by the bounds

    def run(q, total=None):
        x = [t.detach().clone().requires_grad_(True) for t in (b["q_i"], b["k_i"], b["w"])]
        res = sparse_indexer_kl_loss(*x, q, b["k"], idx, cu_seqlens=b["cu"], token_mask=b["mask"],
                                     total_heads=total, reduction="sum", deterministic=True)
        res.loss.backward()
        return [t.grad for t in x]

    g_full = run(b["q"])
    hs = heads // tp
    grads = [run(b["q"][:, r * hs:(r + 1) * hs], total=heads) for r in range(tp)]
    g_sum = [all_reduce([g[i] for g in grads]) for i in range(3)]
    print(f"TP={tp} sparse stage (top-{topk}): grad rel. diff = {reldiff(g_sum, g_full, f'TP={tp} sparse'):.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--dtype", choices=["float64", "bfloat16"], default=None,
                    help="default: bfloat16 on an SM90 GPU (the kernels' sizes), else float64 (exact)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    hopper = dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0)
    dtype = getattr(torch, args.dtype or ("bfloat16" if hopper else "float64"))
    torch.set_default_dtype(torch.float64)  # the reductions and comparisons; q_I, k_I, q, k take `dtype`
    if dtype == torch.bfloat16:  # DeepSeek-V3.2's head counts (Dqk 64 here to keep it small)
        b = make_batch([370, 640, 270], pad_to=1344, heads=128, dqk=64, heads_i=64, dim_i=64, device=dev, dtype=dtype)
        tol = 2e-2  # bf16 gradients (8 bits) summed over ranks
    else:
        b = make_batch([37, 64, 27], pad_to=144, heads=8, dqk=32, heads_i=4, dim_i=16, device=dev, dtype=dtype)
        tol = 1e-10
    rank_q = b["q"][:, : b["q"].shape[1] // args.tp]
    why = sm90.loss_unsupported(b["q_i"], b["k_i"], rank_q, b["k"], False)
    print(f"{dtype} on {dev}: the mean loss of a TP rank runs on "
          f"{'the SM90 kernels' if why is None else 'the portable code (' + why + ')'}")
    tensor_parallel(b, args.tp)
    context_parallel(b, args.cp)
    sparse_tensor_parallel(b, args.tp)
    bad = [(what, d) for what, d in CHECKS if not d <= tol]
    if bad:
        raise SystemExit(f"FAILED (relative tolerance {tol:g}): {bad}")
    print(f"all {len(CHECKS)} decompositions match the one-rank run (relative tolerance {tol:g})")


if __name__ == "__main__":
    main()
