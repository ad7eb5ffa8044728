"""Top-k recall of the indexer on FP4 inputs vs FP8 and bf16 inputs (CPU by default, GPU if asked).

For each input kind and key count N it draws R query rows (H heads x D) and N keys, computes the indexer
logits I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) three ways:

  bf16: q, k rounded to bfloat16, product in fp32;
  fp8:  q and k per-token fp8 (deep_indexer.quant.per_token_cast_to_fp8; q's scale folded into the weights,
        as engines do), logits by deep_indexer.reference.mqa_logits (fp32);
  fp4:  q and k per-token FP4 (deep_indexer.quant.per_token_cast_to_fp4, DeepGEMM's format), logits by
        deep_indexer.reference.mqa_logits on the FP4 inputs (dequantized, fp32);

and reports recall@k = |topk(a) & topk(b)| / k averaged over rows, for k = 512 and 2048.

Input kinds:
  random:    q, k ~ N(0, 1) i.i.d.;
  realistic: low-rank q/k (a shared rank-16 latent space: k = z_k B + 0.3 noise, q[h] = z_q A_h + 0.3 noise),
             2-4 outlier channels scaled 10-30x on both sides, token norms log-normal (sigma 0.3).
Weights are N(0, 1) / sqrt(H) (positive and negative) in both.

    python tools/fp4_recall.py                  # defaults: H 64, D 128, N 8192 and 32768, 64 rows, 2 seeds
    python tools/fp4_recall.py --device cuda --rows 256 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from deep_indexer import quant, reference


def make_inputs(kind: str, rows: int, n: int, h: int, d: int, g: torch.Generator):
    def randn(*s):
        return torch.randn(*s, generator=g)

    if kind == "random":
        q, k = randn(rows, h, d), randn(n, d)
    elif kind == "realistic":
        r = 16
        b = randn(r, d) / math.sqrt(r)
        a = randn(h, r, d) / math.sqrt(r)
        k = randn(n, r) @ b + 0.3 * randn(n, d)
        q = torch.einsum("tr,hrd->thd", randn(rows, r), a) + 0.3 * randn(rows, h, d)
        n_out = int(torch.randint(2, 5, (1,), generator=g))
        ch = torch.randperm(d, generator=g)[:n_out]
        mag = 10 + 20 * torch.rand(n_out, generator=g)
        k[:, ch] *= mag
        q[..., ch] *= mag
        k *= torch.exp(0.3 * randn(n, 1))
        q *= torch.exp(0.3 * randn(rows, 1, 1))
    else:
        raise ValueError(f"kind: expected 'random' or 'realistic', got {kind!r}")
    w = randn(rows, h) / math.sqrt(h)
    return q, k, w


def logits_bf16(q, k, w, chunk=4096):
    qb, kb = q.bfloat16().float(), k.bfloat16().float()
    out = torch.empty(q.shape[0], k.shape[0], device=q.device)
    for c0 in range(0, k.shape[0], chunk):
        prod = torch.matmul(qb, kb[c0:c0 + chunk].t())  # [rows, H, cols]
        out[:, c0:c0 + chunk] = prod.relu_().mul_(w.unsqueeze(-1)).sum(1)
    return out


def full_range(rows, n, dev):
    return torch.zeros(rows, dtype=torch.int32, device=dev), torch.full((rows,), n, dtype=torch.int32, device=dev)


def logits_fp8(q, k, w):
    q8, qs = quant.per_token_cast_to_fp8(q)  # qs [rows, H]
    kv = quant.per_token_cast_to_fp8(k)
    return reference.mqa_logits(q8, kv, (w * qs).float(), *full_range(q.shape[0], k.shape[0], q.device))


def logits_fp4(q, k, w):
    q4, k4 = quant.per_token_cast_to_fp4(q), quant.per_token_cast_to_fp4(k)
    return reference.mqa_logits(q4, k4, w.float(), *full_range(q.shape[0], k.shape[0], q.device))


def recall(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    ia, ib = a.topk(k, dim=1).indices, b.topk(k, dim=1).indices
    hit = torch.zeros_like(a, dtype=torch.bool).scatter_(1, ia, True).gather(1, ib)
    return hit.float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=64, help="query rows per case")
    p.add_argument("--keys", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--topk", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--kinds", nargs="+", default=["random", "realistic"])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    results = []
    print(f"H {args.heads}, D {args.dim}, {args.rows} rows x {args.seeds} seeds per case, device {args.device}")
    print("| inputs | keys | k | fp4 vs bf16 | fp4 vs fp8 | fp8 vs bf16 |")
    print("|---|---|---|---|---|---|")
    for kind in args.kinds:
        for n in args.keys:
            acc = {kk: [0.0, 0.0, 0.0] for kk in args.topk}
            t0 = time.time()
            for seed in range(args.seeds):
                g = torch.Generator().manual_seed(1000 * seed + n + (7 if kind == "realistic" else 0))
                q, k, w = (x.to(args.device) for x in make_inputs(kind, args.rows, n, args.heads, args.dim, g))
                lb, l8, l4 = logits_bf16(q, k, w), logits_fp8(q, k, w), logits_fp4(q, k, w)
                for kk in args.topk:
                    acc[kk][0] += recall(lb, l4, kk) / args.seeds
                    acc[kk][1] += recall(l8, l4, kk) / args.seeds
                    acc[kk][2] += recall(lb, l8, kk) / args.seeds
            for kk in args.topk:
                r4b, r48, r8b = acc[kk]
                print(f"| {kind} | {n} | {kk} | {r4b:.4f} | {r48:.4f} | {r8b:.4f} |", flush=True)
                results.append(dict(inputs=kind, keys=n, k=kk, fp4_vs_bf16=r4b, fp4_vs_fp8=r48, fp8_vs_bf16=r8b,
                                    rows=args.rows, seeds=args.seeds, heads=args.heads, dim=args.dim,
                                    seconds=time.time() - t0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
