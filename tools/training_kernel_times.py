"""Per-kernel times of the SM90 warm-up `mean` path (training/sm90.py) at DeepSeek-V3.2 sizes, one causal
sequence: each kernel's share of a forward / backward and its rate as a fraction of the bf16 GEMM rate.

    python tools/training_kernel_times.py [--tokens 16384] [--iters 5] [--logits-only]
"""
import argparse
import os

import torch

from deep_indexer import _C
from deep_indexer.reference import row_chunks
from deep_indexer.training import packed_bounds
from deep_indexer.training import sm90 as fast
from deep_indexer.training.bench import _timer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--logits-only", action="store_true", help="only the indexer logits op's kernels")
    args = ap.parse_args()
    t = n = args.tokens
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, std=1.0: (torch.randn(*s, device=dev, generator=g) * std).bfloat16()  # noqa: E731
    q, k = r(t, 128, 576), r(n, 576)
    q_i, k_i = r(t, 64, 128, std=0.3), r(n, 128, std=0.3)
    w = torch.randn(t, 64, device=dev, generator=g) * 0.1
    ks, ke = packed_bounds(torch.tensor([0, t], dtype=torch.int32))
    ks32, ke32 = ks.int().cuda(), ke.int().cuda()
    lse = torch.full((t, 128), 12.0, device=dev)  # any finite value: timing only
    a, b = torch.randn(8192, 8192, device=dev).bfloat16(), torch.randn(8192, 8192, device=dev).bfloat16()

    run = _timer(torch.device(dev))  # the training bench's timer: median of samples of 3 back-to-back calls

    def timed(fn):
        return run(fn, args.iters)

    rate = 2 * 8192 ** 3 / timed(lambda: torch.mm(a, b))
    rc = fast._rows_per_chunk(t, n)
    chunks = list(row_chunks(ks, ke, rc))
    p, di = fast._chunk_buffer(rc, n, dev), fast._chunk_buffer(rc, n, dev)
    plogp, mass, lse_i, pi = (torch.zeros(t, device=dev) for _ in range(4))
    gvec = torch.ones(t, device=dev)
    dq, dw = torch.zeros(t, 64, 128, device=dev), torch.zeros(t, 64, device=dev)
    pairs = t * (t + 1) / 2
    out = {}
    for cluster in () if args.logits_only else ("1", "2"):
        os.environ["DI_TRAINING_TARGET_CLUSTER"] = cluster
        out[f"target cluster={cluster}"] = (timed(lambda: [_C.bf16_training_target(
            q, k, lse, ks32, ke32, p, plogp, mass, r0, r1, 576 ** -0.5, 1 / 128) for r0, r1, _, _ in chunks]),
            2 * 128 * 576 * pairs)
    os.environ.pop("DI_TRAINING_TARGET_CLUSTER", None)
    if not args.logits_only:
        mean_loss_kernels(out, timed, q, k, q_i, k_i, w, ks32, ke32, lse, p, di, plogp, mass, lse_i, pi, gvec, dq, dw,
                          chunks, t, pairs, dev)
    # the indexer logits op alone (forward: the prefill kernel's bf16 form into [T, T] fp32, -inf fill included;
    # backward: dk (with the sign mask) + masked dq kernels and the dk partial sum, for a dense incoming gradient)
    logits = torch.empty(t, n, device=dev)
    out["indexer_logits fwd"] = (timed(lambda: _C.bf16_indexer_logits(q_i, k_i, w, ks32, ke32, logits)),
                                 2 * 64 * 128 * pairs)
    grad = torch.randn(t, n, device=dev)
    ks_cpu, ke_cpu = ks.cpu(), ke.cpu()
    out["indexer_logits bwd (6 H_I D_I counted)"] = (
        timed(lambda: fast.logits_bwd(grad, q_i, k_i, w, ks32, ke32, ks_cpu, ke_cpu)), 6 * 64 * 128 * pairs)
    mask = torch.empty(t, fast.mask_words_per_row(n), dtype=torch.int32, device=dev)
    dq16 = torch.empty(t, 64, 128, device=dev, dtype=torch.bfloat16)
    out["indexer_dk (logits, writes the mask)"] = (timed(lambda: _C.bf16_indexer_logits_bwd_dk(
        q_i, k_i, w, ks32, ke32, grad, 0, None, None, None, None, 0, t, 0, n, mask, 0)), 4 * 64 * 128 * pairs)
    out["indexer_dq (logits, masked: 1 GEMM)"] = (timed(lambda: _C.bf16_indexer_logits_bwd_dq(
        q_i, k_i, w, ks32, ke32, grad, 0, dq16, dw, 0, t, mask, 0, 0, n)), 2 * 64 * 128 * pairs)
    del logits, grad, mask
    print(f"# {torch.cuda.get_device_name()}, T = {t} causal, {len(chunks)} chunk(s) of {rc} rows; "
          f"bf16 GEMM {rate / 1e12:.0f} TFLOP/s")
    print("| kernel | ms | TFLOP/s (its own GEMM work) | of GEMM |\n|---|---|---|---|")
    for name, (sec, flops) in out.items():
        print(f"| {name} | {sec * 1e3:.2f} | {flops / sec / 1e12:.1f} | {flops / sec / rate:.2f} |")


def mean_loss_kernels(out, timed, q, k, q_i, k_i, w, ks32, ke32, lse, p, di, plogp, mass, lse_i, pi, gvec, dq, dw,
                      chunks, t, pairs, dev):
    out["logits_stats"] = (timed(lambda: [_C.bf16_indexer_logits_stats(q_i, k_i, w, ks32, ke32, p, lse_i, pi, r0, r1)
                                          for r0, r1, _, _ in chunks]), 2 * 64 * 128 * pairs)
    out["indexer_dk (loss)"] = (timed(lambda: [_C.bf16_indexer_logits_bwd_dk(
        q_i, k_i, w, ks32, ke32, p, r0, gvec, torch.ones(t, device=dev), lse_i, di, r0, r1, lo, hi)
        for r0, r1, lo, hi in chunks]), 4 * 64 * 128 * pairs)
    out["indexer_dq"] = (timed(lambda: [_C.bf16_indexer_logits_bwd_dq(q_i, k_i, w, ks32, ke32, di, r0, dq, dw, r0, r1)
                                        for r0, r1, _, _ in chunks]), 4 * 64 * 128 * pairs)


if __name__ == "__main__":
    main()
