"""Runs the indexer logits backward kernels (dk with the sign mask, then the masked dq) three times on one causal
sequence, for a profiler to pick launches from:

    ncu --kernel-name regex:training_indexer_d --launch-skip 2 --launch-count 2 ... \\
        python3 tools/training_bwd_profile.py [--tokens 8192]
"""
import argparse

import torch

from deep_indexer import _C
from deep_indexer.training import packed_bounds
from deep_indexer.training import sm90 as fast


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    t = n = ap.parse_args().tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q_i = (torch.randn(t, 64, 128, device="cuda", generator=g) * 0.3).bfloat16()
    k_i = (torch.randn(n, 128, device="cuda", generator=g) * 0.3).bfloat16()
    w = torch.randn(t, 64, device="cuda", generator=g) * 0.1
    ks, ke = (x.int().cuda() for x in packed_bounds(torch.tensor([0, t], dtype=torch.int32)))
    grad = torch.randn(t, n, device="cuda", generator=g)
    mask = torch.empty(t, fast.mask_words_per_row(n), dtype=torch.int32, device="cuda")
    dq = torch.empty(t, 64, 128, device="cuda", dtype=torch.bfloat16)
    dw = torch.empty(t, 64, device="cuda")
    for _ in range(3):
        _C.bf16_indexer_logits_bwd_dk(q_i, k_i, w, ks, ke, grad, 0, None, None, None, None, 0, t, 0, n, mask, 0)
        _C.bf16_indexer_logits_bwd_dq(q_i, k_i, w, ks, ke, grad, 0, dq, dw, 0, t, mask, 0, 0, n)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
