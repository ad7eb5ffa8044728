"""Benchmark of the indexer-training ops against the bars they are measured by.

    python -m deep_indexer.training.bench [--case all|per_head|mean|logits ...] [--tokens 8192 ...] [--seqs 4 ...]

Cases (CUDA, bf16 inputs; one causal sequence per `--tokens` value, or `--seqs` packed sequences of 2048):
  per_head  H = H_I = 64, Dqk = 128, D_I = 64, n packed sequences of 2048 tokens: forward / backward time of
            indexer_kl_loss(target="per_head") against torch SDPA's flash-attention forward / backward on
            the same q, k (v = k-sized) as [n, 64, 2048, 128] (the attention alone; its backward takes a
            random output gradient).
  mean      H = 128, Dqk = 576 (one key head), H_I = 64, D_I = 128, causal: TFLOP/s counting per valid (t, s)
            pair 2 (H Dqk + H_I D_I) forward and 2 (H Dqk + 3 H_I D_I) backward, against the bf16 GEMM
            rate measured in the same run.
  logits    indexer_logits alone at the `mean` sizes: the forward op (no grad) and the backward of its output for
            a dense gradient; 2 H_I D_I per pair forward, 6 H_I D_I backward (S recomputed, dq_I, dk_I: as the
            mean loss's backward counts its indexer side), also reported counting 4.
`--backends` (auto / torch / sm90) picks the paths of the mean and logits cases.
The attention LSE is passed in (from the SDPA flash forward for per_head; computed once for mean) so
the timed forward is the loss's own sweep. `--smoke` runs tiny shapes on any device (a check of the
script, not a measurement).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from ..bench import source_commit
from .ops import indexer_kl_loss, indexer_logits


def _timer(dev):
    if dev.type == "cuda":
        def run(fn, iters, reps=3):
            # the median over `iters` samples, each the mean of `reps` back-to-back calls (so host work overlaps the
            # previous call's kernels, as in a training step), after two warm-ups: one stalled call cannot decide it
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(reps):
                    fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e-3 / reps)
            return statistics.median(times)
    else:
        def run(fn, iters):
            fn()
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t) / iters
    return run


def _rand(*shape, dev, std=1.0, gen=None):
    return (torch.randn(*shape, device=dev, generator=gen) * std).bfloat16()


def _fwd_bwd(make_loss, leaves, timer, iters, loss_fn=False):
    """(forward seconds, backward seconds) of make_loss() then loss.backward() (loss_fn: make_loss(backward) runs its
    own backward when `backward` is true)."""
    def fwd():
        with torch.no_grad():
            make_loss(False) if loss_fn else make_loss()

    t_f = timer(fwd, iters)

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        make_loss(True) if loss_fn else make_loss().backward()

    t_fb = timer(fwd_bwd, iters)
    return t_f, max(t_fb - t_f, 0.0)


def gemm_rate(dev, timer, n=8192):
    a, b = torch.randn(n, n, device=dev).bfloat16(), torch.randn(n, n, device=dev).bfloat16()
    t = timer(lambda: torch.mm(a, b), 10)
    return 2 * n ** 3 / t


def bench_per_head(dev, seqs, seq_len, timer, iters):
    h, dqk, di = 64, 128, 64
    t = seqs * seq_len
    g = torch.Generator(device=dev).manual_seed(0)
    q4 = _rand(seqs, h, seq_len, dqk, dev=dev, gen=g)
    k4 = _rand(seqs, h, seq_len, dqk, dev=dev, gen=g)
    v4 = _rand(seqs, h, seq_len, dqk, dev=dev, gen=g)
    scale = dqk ** -0.5
    rows = []
    sdpa_f = sdpa_b = float("nan")
    lse = None
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            qa, ka, va = (x.clone().requires_grad_(True) for x in (q4, k4, v4))
            gout = torch.randn_like(q4)

            def sdpa(backward):  # the attention alone: no reduction of its output in the timed forward
                out = torch.nn.functional.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale)
                if backward:
                    out.backward(gout)

            sdpa_f, sdpa_b = _fwd_bwd(sdpa, (qa, ka, va), timer, iters, loss_fn=True)
        out = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, True, False, scale=scale)
        lse = out[1].permute(0, 2, 1).reshape(t, h).float()  # [B, H, S] -> [T, H]
    # the per_head operator's own layout: keys per head ([T, H_kv = H, Dqk])
    q = q4.permute(0, 2, 1, 3).reshape(t, h, dqk)
    k = k4.permute(0, 2, 1, 3).reshape(t, h, dqk)
    q_i = _rand(t, h, di, dev=dev, std=0.3, gen=g).requires_grad_(True)
    k_i = _rand(t, di, dev=dev, std=0.3, gen=g).requires_grad_(True)
    w = (torch.randn(t, h, device=dev, generator=g) * 0.1).requires_grad_(True)
    cu = torch.arange(0, t + 1, seq_len, dtype=torch.int32)  # on the host: no sync in the ops
    f, b = _fwd_bwd(lambda: indexer_kl_loss(q_i, k_i, w, q, k, scale, cu_seqlens=cu, attn_lse=lse,
                                            target="per_head").loss, (q_i, k_i, w), timer, iters)
    rows.append((f"per_head {seqs}x{seq_len}", f, b, f"SDPA flash fwd {sdpa_f * 1e3:.2f} ms bwd {sdpa_b * 1e3:.2f} ms; "
                 f"ratio fwd {f / sdpa_f:.2f}x (bar 1.4x), bwd {b / sdpa_b:.2f}x (bar 0.7x)"))
    return rows


def bench_mean(dev, tokens, timer, iters, rate, logits_only=False, backends=("auto",)):
    h, dqk, hi, di = 128, 576, 64, 128
    g = torch.Generator(device=dev).manual_seed(1)
    q = _rand(tokens, h, dqk, dev=dev, gen=g)
    k = _rand(tokens, dqk, dev=dev, gen=g)
    q_i = _rand(tokens, hi, di, dev=dev, std=0.3, gen=g).requires_grad_(True)
    k_i = _rand(tokens, di, dev=dev, std=0.3, gen=g).requires_grad_(True)
    w = (torch.randn(tokens, hi, device=dev, generator=g) * 0.1).requires_grad_(True)
    cu = torch.tensor([0, tokens], dtype=torch.int32)  # on the host: no sync in the ops
    pairs = tokens * (tokens + 1) / 2
    rows = []
    if logits_only:
        # the op alone: the forward under no_grad, the backward as autograd.grad of its output for a dense
        # incoming gradient (the graph kept; nothing else timed)
        ff, fb = 2 * hi * di * pairs, 6 * hi * di * pairs
        for backend in backends:
            be = "sm90" if backend == "auto" and dev.type == "cuda" else ("torch" if backend == "auto" else backend)

            def fwd_only():
                with torch.no_grad():
                    indexer_logits(q_i, k_i, w, cu_seqlens=cu, backend=be)

            f = timer(fwd_only, iters)
            out = indexer_logits(q_i, k_i, w, cu_seqlens=cu, backend=be)
            grad = torch.randn(out.shape, device=dev, generator=g)
            b = timer(lambda: torch.autograd.grad(out, (q_i, k_i, w), grad, retain_graph=True), iters)
            del out, grad
            note = (f"fwd {ff / f / 1e12:.1f} TFLOP/s = {ff / f / rate:.2f} of GEMM (bar 0.6; the -inf fill of [T, T] "
                    f"fp32 included), bwd {fb / b / 1e12:.1f} TFLOP/s = {fb / b / rate:.2f} of GEMM counting 6 H_I D_I "
                    f"per pair as the mean loss's backward counts (bar 0.6; {fb / b / rate / 1.5:.2f} counting 4)")
            rows.append((f"logits {tokens} {be}", f, b, note))
    else:
        scale = 192 ** -0.5
        ff, fb = 2 * (h * dqk + hi * di) * pairs, 2 * (h * dqk + 3 * hi * di) * pairs
        lse = indexer_kl_loss(q_i.detach(), k_i.detach(), w.detach(), q, k, scale, cu_seqlens=cu).attn_lse
        for backend in backends:
            f, b = _fwd_bwd(lambda: indexer_kl_loss(q_i, k_i, w, q, k, scale, cu_seqlens=cu, attn_lse=lse,
                                                    backend=backend).loss, (q_i, k_i, w), timer, iters)
            note = (f"fwd {ff / f / 1e12:.1f} TFLOP/s = {ff / f / rate:.2f} of GEMM (bar 0.55), "
                    f"bwd {fb / b / 1e12:.1f} TFLOP/s = {fb / b / rate:.2f} of GEMM (bar 0.45)")
            rows.append((f"mean {tokens} {backend}", f, b, note))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs="+", default=["all"], choices=["all", "per_head", "mean", "logits"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--iters", type=int, default=5, help="timed samples of 3 back-to-back calls per measurement (the median is reported)")
    ap.add_argument("--backends", nargs="+", default=["auto"], choices=["auto", "torch", "sm90"],
                    help="backends of the mean and logits cases (auto: the SM90 kernels where they apply)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script only)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    timer = _timer(dev)
    seq_len = 2048
    if args.smoke:
        args.tokens, args.seqs, seq_len, args.iters = [256], [2], 128, 1
    rate = gemm_rate(dev, timer, 1024 if args.smoke else 8192)

    commit = source_commit()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"# {name}, {datetime.date.today()}, commit {commit}, torch {torch.__version__}; "
          f"bf16 GEMM {rate / 1e12:.0f} TFLOP/s. Backend per row: auto = SM90 kernels where they apply.")
    print("| case | forward ms | backward ms | notes |\n|---|---|---|---|")
    rows = []

    def fresh():  # each case from an empty allocator cache (a case after a larger one ran slower without it)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    if "all" in args.case or "per_head" in args.case:
        for n in args.seqs:
            fresh()
            rows += bench_per_head(dev, n, seq_len, timer, args.iters)
    if "all" in args.case or "mean" in args.case:
        for t in args.tokens:
            fresh()
            rows += bench_mean(dev, t, timer, args.iters, rate, backends=args.backends)
    if "all" in args.case or "logits" in args.case:
        for t in args.tokens:
            fresh()
            rows += bench_mean(dev, t, timer, args.iters, rate, logits_only=True, backends=args.backends)
    for name, f, b, note in rows:
        print(f"| {name} | {f * 1e3:.2f} | {b * 1e3:.2f} | {note} |")


if __name__ == "__main__":
    main()
