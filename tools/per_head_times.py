"""Times of the SM90 `per_head` warm-up loss path (training/sm90.py) at the seeds' sizes (H = H_I = 64, Dqk = 128,
D_I = 64, packed causal sequences of 2048): the two C++ entries (forward kernel; backward: both kernels), and the whole ops, against
torch SDPA flash attention forward / backward on the same q / k / v.

    python tools/per_head_times.py [--seqs 4 16] [--iters 10]
"""
import argparse

import torch

from deep_indexer import _C
from deep_indexer.training import indexer_kl_loss, packed_bounds
from deep_indexer.training import sm90 as fast


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def timed(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        s, e = ev(), ev()
        s.record()
        for _ in range(args.iters):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / args.iters

    h, dqk, di, seq = 64, 128, 64, 2048
    print(f"# {torch.cuda.get_device_name()}, H = H_I = {h}, Dqk = {dqk}, D_I = {di}, sequences of {seq} (ms)")
    print("| seqs | fwd entry | bwd entry (both kernels) | loss fwd | loss bwd | SDPA fwd | SDPA bwd |")
    print("|---|---|---|---|---|---|---|")
    for n in args.seqs:
        t = n * seq
        g = torch.Generator(device="cuda").manual_seed(0)
        r = lambda *s, std=1.0: (torch.randn(*s, device="cuda", generator=g) * std).bfloat16()  # noqa: E731
        q4, k4, v4 = r(n, h, seq, dqk), r(n, h, seq, dqk), r(n, h, seq, dqk)
        q, k = q4.permute(0, 2, 1, 3).reshape(t, h, dqk), k4.permute(0, 2, 1, 3).reshape(t, h, dqk)
        q_i, k_i = r(t, h, di, std=0.3), r(t, di, std=0.3)
        w = torch.randn(t, h, device="cuda", generator=g) * 0.1
        cu = torch.arange(0, t + 1, seq, dtype=torch.int32)
        ks, ke = (x.cuda() for x in packed_bounds(cu))
        scale = dqk ** -0.5
        out = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, True, False, scale=scale)
        lse = out[1].permute(0, 2, 1).reshape(t, h).float().contiguous()
        ks32, ke32 = ks.int(), ke.int()
        kl, lse_i, mass = (torch.zeros(t, h, device="cuda") for _ in range(3))
        row = {"fwd entry": timed(lambda: _C.bf16_per_head_fwd(q, k, q_i, k_i, ks32, ke32, lse, w, kl, lse_i, mass,
                                                               scale))}
        gv = torch.full((t,), 1.0 / t / h, device="cuda")
        dq, dw = torch.zeros(t, h, di, device="cuda"), torch.zeros(t, h, device="cuda")
        row["bwd entry"] = timed(lambda: _C.bf16_per_head_bwd(q, k, q_i, k_i, ks32, ke32, lse, w, lse_i, mass, gv, dq, dw,
                                                              scale))
        leaves = [x.clone().requires_grad_(True) for x in (q_i, k_i, w)]

        def fwd():
            with torch.no_grad():
                indexer_kl_loss(*leaves, q, k, scale, cu_seqlens=cu, attn_lse=lse, target="per_head")

        def fwd_bwd():
            for x in leaves:
                x.grad = None
            indexer_kl_loss(*leaves, q, k, scale, cu_seqlens=cu, attn_lse=lse, target="per_head").loss.backward()

        row["loss fwd"] = timed(fwd)
        row["loss bwd"] = timed(fwd_bwd) - row["loss fwd"]
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qa, ka, va = (x.clone().requires_grad_(True) for x in (q4, k4, v4))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            def sdpa_f():
                with torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale)

            gout = torch.randn_like(q4)

            def sdpa_fb():
                for x in (qa, ka, va):
                    x.grad = None
                torch.nn.functional.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale).backward(gout)

            row["SDPA fwd"] = timed(sdpa_f)
            row["SDPA bwd"] = timed(sdpa_fb) - row["SDPA fwd"]
        print(f"| {n} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |")


if __name__ == "__main__":
    main()
