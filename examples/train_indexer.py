"""Train a lightning indexer to match a frozen attention on synthetic data (warm-up stage), then draw its loss.

The "model": token embeddings x [T, d] from a small vocabulary, and a frozen multi-head attention whose
heads look for tokens of the same kind (a bilinear form close to the identity) or for a random bilinear
pattern. The indexer (q_I = x W_q, k_I = x W_k, weights = x W_w, DeepSeek-V3.2's form) learns with
`indexer_kl_loss` (target = head-mean of the attention softmax) on fresh packed causal sequences every
step. At the end it prints how much attention mass the indexer's top-k keys capture, against top-k of
random scores. CPU: about 10 s at the default size (on a busy machine, OMP_NUM_THREADS=1 avoids thread
oversubscription); uses the GPU when there is one (bf16 inputs).

    python examples/train_indexer.py [--steps 300] [--tokens 256] [--out train_indexer_loss.png]
"""
import argparse
import time

import torch

from deep_indexer.training import indexer_kl_loss, indexer_logits, packed_bounds


class Indexer(torch.nn.Module):
    def __init__(self, d_model, heads, dim):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.wq = torch.nn.Linear(d_model, heads * dim, bias=False)
        self.wk = torch.nn.Linear(d_model, dim, bias=False)
        self.ww = torch.nn.Linear(d_model, heads, bias=False)

    def forward(self, x):
        q_i = self.wq(x).view(x.shape[0], self.heads, self.dim)
        return q_i, self.wk(x), self.ww(x) * self.heads ** -0.5


class FrozenAttention:
    """q, k of a frozen MQA attention (one key head): half the heads match same-kind tokens, half are random."""

    def __init__(self, d_model, heads, dqk, gen, device):
        self.wk = torch.randn(d_model, dqk, generator=gen).to(device) / d_model ** 0.5
        mats = []
        for h in range(heads):
            if h % 2 == 0:  # same-kind lookup: q ~ k
                m = torch.eye(dqk) + 0.3 * torch.randn(dqk, dqk, generator=gen) / dqk ** 0.5
            else:
                m = torch.randn(dqk, dqk, generator=gen) / dqk ** 0.5
            mats.append(m)
        self.wq = torch.stack([self.wk.cpu() @ m for m in mats], 1).to(device)  # [d, H, dqk]
        self.scale = 4.0 / dqk ** 0.5  # a peaked attention

    def __call__(self, x):
        return torch.einsum("td,dhe->the", x, self.wq), x @ self.wk


def batch(vocab_emb, tokens, seqs, gen, device):
    ids = torch.randint(0, vocab_emb.shape[0], (tokens,), generator=gen)
    x = vocab_emb[ids] + 0.1 * torch.randn(tokens, vocab_emb.shape[1], generator=gen)
    cuts = torch.sort(torch.randperm(tokens - 1, generator=gen)[: seqs - 1] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]).int()
    return x.to(device), cu.to(device)


@torch.no_grad()
def topk_mass(indexer, attn, x, cu, k):
    """Mean attention (head-mean) probability mass on the indexer's top-k keys, and on k random valid keys."""
    q_i, k_i, w = indexer(x)
    q, kk = attn(x)
    ks, ke = packed_bounds(cu)
    logits = indexer_logits(q_i, k_i, w, cu_seqlens=cu)
    cols = torch.arange(x.shape[0], device=x.device)
    invalid = (cols < ks[:, None]) | (cols >= ke[:, None])
    p = torch.softmax((attn.scale * torch.einsum("the,se->hts", q, kk)).masked_fill(invalid, float("-inf")), -1).mean(0)
    rows = (ke - ks) > k  # rows where the choice matters
    top = logits.topk(k, dim=1).indices
    rnd = torch.rand(logits.shape, device=x.device).masked_fill(invalid, -1).topk(k, dim=1).indices
    return float(p.gather(1, top).sum(1)[rows].mean()), float(p.gather(1, rnd).sum(1)[rows].mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per step (packed causal sequences)")
    ap.add_argument("--seqs", type=int, default=4, help="sequences per step")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8, help="attention heads")
    ap.add_argument("--dqk", type=int, default=32)
    ap.add_argument("--index-heads", type=int, default=4)
    ap.add_argument("--index-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="train_indexer_loss.png")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    vocab_emb = torch.randn(args.vocab, args.d_model, generator=gen)
    attn = FrozenAttention(args.d_model, args.heads, args.dqk, gen, dev)
    indexer = Indexer(args.d_model, args.index_heads, args.index_dim).to(dev)
    opt = torch.optim.Adam(indexer.parameters(), lr=args.lr)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    x, cu = batch(vocab_emb, args.tokens, args.seqs, gen, dev)
    before = topk_mass(indexer, attn, x, cu, args.topk)
    losses = []
    t0 = time.time()
    for step in range(args.steps):
        x, cu = batch(vocab_emb, args.tokens, args.seqs, gen, dev)
        with torch.no_grad():
            q, k = attn(x)  # frozen
        q_i, k_i, w = indexer(x)
        res = indexer_kl_loss(q_i.to(dtype), k_i.to(dtype), w, q.to(dtype), k.to(dtype), attn.scale, cu_seqlens=cu)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        opt.step()
        losses.append(float(res.loss.detach()))
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  KL {losses[-1]:.4f}  ({time.time() - t0:.1f} s)")
    after = topk_mass(indexer, attn, x, cu, args.topk)
    print(f"attention mass on the indexer's top-{args.topk}: {before[0]:.3f} before, {after[0]:.3f} after "
          f"(random {args.topk} keys: {after[1]:.3f})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("KL(attention || indexer), mean per token")
    ax.set_yscale("log")
    ax.set_title(f"indexer warm-up: {args.tokens} tokens/step, H={args.heads}, H_I={args.index_heads}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"loss curve: {args.out}")


if __name__ == "__main__":
    main()
