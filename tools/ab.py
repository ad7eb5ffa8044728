"""In-process A/B timing of kernel variants chosen by environment switches.

    python3 tools/ab.py --variants "DI_PAGED_MATH_WGS=3;DI_PAGED_MATH_WGS=4" D3 D4 64:1:32768:128
    python3 tools/ab.py --variants ";DI_JIT_EXTRA_FLAGS=-DX=1 -DY,DI_PAGED_MATH_WGS=4" D3
    python3 tools/ab.py --variants "DI_MQA_SPLIT_RELU=0;DI_MQA_SPLIT_RELU=1" P1 P2 4096:32768:causal:32:64

A shape is a benchmark id (P1..P5, P2c, D1..D7, K-* top-k, KF-<decode id>[:k] the fused decode call with its
metadata), K:rows:avg:k (top-k, decode pattern), S:SKV:causal|cp[:H[:D[:max_seqlen_k]]] (prefill, fp32, clean) or
B:next_n:avg[:H] (decode, D = 128, block 64, fp32, no clean; a decode shape + "-FP4": FP4 q and cache). The inputs are drawn once
per shape; the variants then alternate for --rounds rounds, each timed like the benchmark (cold L2,
median of --iters calls, L2 flushed by a read unless --flush write), so that machine drift and input placement affect every variant alike.
The switches are read per call by the extension (getenv), so setting os.environ is enough.
A change to the kernel headers is timed against the code before it without a switch in the source: put the
old headers in a folder (git archive HEAD include | tar -x -C /tmp/old) and give one variant
DI_JIT_EXTRA_FLAGS=-I/tmp/old/include; the extra flags come before the package's include folder on the
nvcc line (and in the cache key), so that variant's kernels are built from the old headers.
--compare MODULE adds, for prefill shapes, MODULE.fp8_mqa_logits (a module with the reference's API,
e.g. tools/deepgemm_ref.py with PYTHONPATH=tools) as one more variant on the same inputs, after a
check that its logits match ours.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics

import torch

from deep_indexer import bench


def parse_variant(v: str) -> dict:
    return dict(kv.strip().split("=", 1) for kv in v.split(",") if "=" in kv)


def logits_agreement(ours: torch.Tensor, theirs: torch.Tensor) -> str:
    """Relative diff 1 - 2<x,y>/(|x|^2+|y|^2) over our finite entries, and whether the -inf masks agree."""
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    valid = torch.isfinite(ours)
    x, y = ours[valid].double(), theirs[valid].double()
    diff = float(1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp(min=1e-300))
    masks = bool(torch.equal(ours == float("-inf"), theirs == float("-inf")))
    return f"relative diff {diff:.2e}, -inf masks {'identical' if masks else 'DIFFER'}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="+")
    p.add_argument("--variants", required=True, help="';'-separated variants, each ','-separated NAME=VALUE assignments ('' = default)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--flush", choices=("write", "read"), default="read", help="L2 flush (see deep_indexer.bench)")
    p.add_argument("--host-slack-us", type=float, default=100.0, help="see deep_indexer.bench")
    p.add_argument("--compare", default=None, help="module with the reference's fp8_mqa_logits (prefill shapes)")
    a = p.parse_args()
    other = importlib.import_module(a.compare) if a.compare else None
    dev = torch.device("cuda")
    timer = bench.Timer(dev, a.flush, a.host_slack_us)
    variants = a.variants.split(";")
    keys = sorted({k for v in variants for k in parse_variant(v)})

    def use_variant(v: str) -> None:  # this variant's environment alone ("" = none of the variants' keys)
        for k in keys:
            os.environ.pop(k, None)
        os.environ.update(parse_variant(v))

    for sid in a.shapes:
        if sid.startswith("K:"):  # K:rows:avg:k, a decode-pattern top-k shape of one's own
            rows, avg, k = (int(v) for v in sid.split(":")[1:])
            bench.TOPK_SHAPES[sid] = (rows, avg, "decode", k)
        fused = sid.startswith("KF-")
        one_call = fused or sid in bench.TOPK_SHAPES or bench.is_prefill_shape(sid)  # else decode: a call per variant
        if fused:  # KF-<decode id>[:k]: the fused decode call with its metadata, as the bench times it
            x, k, run = bench.fused_decode_case(sid, dev)
            what = f"fused decode {bench.DECODE_SHAPES[sid[3:].partition(':')[0]]} k={k}"
        elif sid in bench.TOPK_SHAPES:  # the standalone top-k on the bench's logits
            what = f"top-k {bench.TOPK_SHAPES[sid]}"
            run = bench.topk_run(bench.topk_case(sid, dev, seed=1))
        elif one_call:
            S, SKV, pattern, H, D = bench.prefill_shape(sid)
            m = bench.prefill_max_seqlen_k(sid)
            what = f"S={S} SKV={SKV} {pattern} H={H} D={D}" + (f" max_seqlen_k={m}" if m else "")
            x, run = bench.prefill_case(sid, dev)
        else:  # <decode id>-FP4: FP4 q and the FP4 paged cache
            fp4 = sid.endswith("-FP4")
            B, nn, avg, H = bench.decode_shape(sid.removesuffix("-FP4"))
            what = f"B={B} next_n={nn} H={H}" + (" FP4" if fp4 else "")
            x = bench.decode_inputs(B, nn, avg, H, 128, 64, dev, fp4=fp4)
        shape_variants = list(variants)
        runs = {}  # decode: per variant, with that variant's schedule (its metadata build may differ)
        if other is not None and bench.is_prefill_shape(sid):
            ref = f"compare:{a.compare}"
            runs[ref] = lambda x=x: other.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], True)
            print(f"{sid:>16} {ref} vs default: {logits_agreement(run(), runs[ref]())}", flush=True)
            shape_variants.append(ref)
        times = {v: [] for v in shape_variants}
        for _ in range(a.rounds):
            for v in shape_variants:
                use_variant(v)
                if v not in runs:
                    runs[v] = run if one_call else bench.decode_call(x)
                times[v].append(timer(runs[v], iters=a.iters))
        if fused or sid in bench.TOPK_SHAPES:  # deterministic: every variant must return the same indices
            outs = {}
            for v in shape_variants:
                use_variant(v)
                outs[v] = runs[v]().clone()
            first = shape_variants[0]
            same = [v or "default" for v in shape_variants if torch.equal(outs[v], outs[first])]
            print(f"{sid:>16} identical indices to [{first or 'default'}]: {len(same)} of {len(shape_variants)} variants"
                  + ("" if len(same) == len(shape_variants) else " (DIFFER)"), flush=True)
        use_variant("")
        for v in shape_variants:
            t = times[v]
            print(f"{sid:>16} {what} [{v or 'default'}]: median {statistics.median(t):7.1f} us  "
                  f"rounds {' '.join(f'{u:.1f}' for u in t)}", flush=True)


if __name__ == "__main__":
    main()
