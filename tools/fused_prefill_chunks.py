"""Fused prefill top-k (fp8_mqa_topk_indices) against the logits alone, by chunk size: a chunk
whose logits fit the L2 may be selected from the L2 instead of HBM.

    python3 tools/fused_prefill_chunks.py P2 P3 P5 --k 2048 512 --chunks 0 128 256 512 1024 --overlap 0 1

0 = the op's default chunk (workspace rows); --overlap 1 splits it over two streams (the op's default). The variants alternate over --rounds rounds (cold L2, median of --iters
calls each, like the benchmark); prints each median and its ratio to the logits alone
(clean_logits=False) in the same rounds.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import deep_indexer as di
from deep_indexer import bench


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="+", help="prefill ids (P1..P5) or S:SKV:causal|cp[:H[:D]]")
    p.add_argument("--k", type=int, nargs="+", default=[2048])
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 512, 1024])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--overlap", type=int, nargs="+", default=[1])
    a = p.parse_args()
    dev = torch.device("cuda")
    timer = bench.Timer(dev, "read")
    for sid in a.shapes:
        S, SKV, pattern, H, D = bench.prefill_shape(sid)
        x = bench.prefill_inputs(S, SKV, pattern, H, D, dev)
        calls = {"logits": lambda: di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], False)}
        ref = {}
        for k in a.k:
            out = torch.empty(S, k, dtype=torch.int32, device=dev)
            names = []
            for c in a.chunks:
                for ov in a.overlap:
                    name = f"k={k} chunk={c or 'default'} overlap={ov}"
                    names.append(name)
                    calls[name] = (lambda k=k, c=c, ov=ov, out=out: di.fp8_mqa_topk_indices(
                        x["q"], x["kv"], x["weights"], x["ks"], x["ke"], k, chunk_rows=c or None, out=out,
                        overlap=bool(ov)))
            # every chunk size and form must give the same indices
            for name in names:
                out.fill_(-7)
                calls[name]()
                torch.cuda.synchronize()
                got = out.clone()
                if k in ref:
                    assert torch.equal(got, ref[k]), f"{sid} {name}: indices differ from the first variant"
                else:
                    ref[k] = got
        times = {n: [] for n in calls}
        for _ in range(a.rounds):
            for n, f in calls.items():
                times[n].append(timer(f, iters=a.iters))
        base = statistics.median(times["logits"])
        print(f"== {sid} S={S} SKV={SKV} {pattern} H={H} D={D}: logits alone {base:.1f} us", flush=True)
        for n, t in times.items():
            m = statistics.median(t)
            print(f"  {n:>34}: {m:9.1f} us  {m / base:5.3f}x  rounds {' '.join(f'{u:.1f}' for u in t)}", flush=True)
        del x, calls, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
