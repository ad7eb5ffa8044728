"""Host (CPU) time per call of the training ops' Python wrappers on a GPU, and where it goes.

    python tools/training_host_overhead.py [--tokens 8192] [--seqs 4]

For each op: the GPU time of one call (events, after a sync), the host time of one call (wall time until the
call returns while the GPU is still busy with a long matmul queued before it, so no call waits for the GPU
unless it synchronises), and the top cProfile entries of the host path.
"""
import argparse
import cProfile
import pstats
import time

import torch

from deep_indexer.training import indexer_kl_loss, indexer_logits


def measure(name, fn, iters=20):
    busy_a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    gpu = s.elapsed_time(e) / iters * 1e-3
    host = []
    for _ in range(iters):
        for _ in range(20):  # ~20 ms of queued GPU work: the call below should not wait for the GPU
            busy_a @ busy_a
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    host.sort()
    print(f"{name}: GPU+host back-to-back {gpu * 1e3:.3f} ms per call; host alone median {host[len(host) // 2] * 1e3:.3f} "
          f"ms (min {host[0] * 1e3:.3f})")
    for _ in range(20):
        busy_a @ busy_a
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=4)
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    t = args.tokens
    q_i = (torch.randn(t, 64, 128, device=dev, generator=g) * 0.3).bfloat16()
    k_i = (torch.randn(t, 128, device=dev, generator=g) * 0.3).bfloat16()
    w = torch.randn(t, 64, device=dev, generator=g) * 0.1
    cu = torch.tensor([0, t], dtype=torch.int32)

    def logits_fwd():
        with torch.no_grad():
            indexer_logits(q_i, k_i, w, cu_seqlens=cu, backend="sm90")

    measure(f"indexer_logits fwd T={t}", logits_fwd)
    leaves = [x.clone().requires_grad_(True) for x in (q_i, k_i, w)]
    out = indexer_logits(*leaves, cu_seqlens=cu, backend="sm90")
    grad = torch.randn(out.shape, device=dev, generator=g)
    measure(f"indexer_logits bwd T={t}", lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True))
    del out, grad

    n, s = args.seqs, 2048
    tt = n * s
    q = (torch.randn(tt, 64, 128, device=dev, generator=g)).bfloat16()
    k = (torch.randn(tt, 64, 128, device=dev, generator=g)).bfloat16()
    qh = (torch.randn(tt, 64, 64, device=dev, generator=g) * 0.3).bfloat16()
    kh = (torch.randn(tt, 64, device=dev, generator=g) * 0.3).bfloat16()
    wh = torch.randn(tt, 64, device=dev, generator=g) * 0.1
    lse = torch.full((tt, 64), 5.0, device=dev)
    cu2 = torch.arange(0, tt + 1, s, dtype=torch.int32)

    def per_head_fwd():
        with torch.no_grad():
            indexer_kl_loss(qh, kh, wh, q, k, 128 ** -0.5, cu_seqlens=cu2, attn_lse=lse, target="per_head")

    measure(f"per_head loss fwd {n}x{s}", per_head_fwd)


if __name__ == "__main__":
    main()
