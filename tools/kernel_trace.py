"""Timelines of cold-L2 decode calls (metadata, then logits) and top-k calls from the kernels'
DI_KERNEL_TRACE build.

    python3 tools/kernel_trace.py D1 D2 K-D2 K-P2 [--dtype bfloat16] [--json FILE]

The kernel is compiled with -DDI_KERNEL_TRACE (a separate JIT cache entry): every role prints its
entry/exit %globaltimer and %clock64 marks (include/deep_indexer/common/trace.cuh):
    meta : 0 context_lens in (thread 0), 1 first scan done, 2 q, r known, 3 prefix sums stored, 4 own splits
           written, 5 after the chunk loop, 6 end
    q    : 0 after __syncthreads, 1 first sequence known (schedule + context_lens), 2 first q issued,
           3 first q landed (the traced build waits for it)
    kv   : 0 after __syncthreads, 1 first group known, 2 first block-table ids in, 3 first tile issued, 4 walk done,
           5 a plain load from the first tile's block returned, 6 total wait for free stages, 7 schedule row in
           (q: 7 likewise, 4 its first context length in; the first work is resolved before __syncthreads)
    math : 0 after __syncthreads, 1 first tile full, 2 q ready, 3 first tile done, 4 last tile done,
           5 total wait for full stages
    topk : thread 0 of each CTA, its first row. Buffered kernel (topk.cuh): 0 sample in, 1 threshold known,
           2 own filter done, 3 survivors complete (cluster), 4 selection threshold, 5 emitted, 6 row end,
           7 cycles in fallbacks (all rows); n = the first row's survivors. Resident kernel (topk_resident.cuh,
           from the CTA's entry): 7 past the PDL wait, 0 keys in, 1 / 2 radix pass 0 / 1 done, 4 selection
           threshold, 3 output positions known, 5 emitted, 6 row end
DI_JIT_EXTRA_FLAGS=-DDI_TRACE_ROW=n gives the buffered top-k kernel's marks for each CTA's n-th row instead
(from that row's start: a steady-state row).
A shape is a benchmark id (D1..D9, K-* top-k, KF-<decode id>[:k]: the fused decode call with its metadata) or
B:next_n:avg[:H]; a decode shape + "-FP4": FP4 q and cache. Entries / exits: %globaltimer after the first entry of any role.
The report gives, per role and mark, the median and max over CTAs in ns (clock64 converted with the
clock rate measured from the same records), the spread of CTA starts and the kernel span.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile

os.environ["DI_JIT_EXTRA_FLAGS"] = (os.environ.get("DI_JIT_EXTRA_FLAGS", "") + " -DDI_KERNEL_TRACE").strip()

import torch  # noqa: E402

import deep_indexer as di  # noqa: E402
from deep_indexer import bench  # noqa: E402

ROLES = ("meta", "q", "kv", "math", "topk")
LINE = re.compile(r"DI_TRACE (\w+) cta=(\d+) idx=(\d+) n=(\d+) gt0=(\d+) gt1=(\d+) c=([\d,]+) end=(\d+)")


def capture(fn) -> str:
    """Runs fn with the process's fd 1 sent to a file (device printf writes there) and returns it."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 1)
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read().decode(errors="replace")


def analyse(text: str) -> dict:
    recs = []
    for m in LINE.finditer(text):
        role, cta, idx, n, gt0, gt1, c, end = m.groups()
        recs.append({"role": role, "cta": int(cta), "idx": int(idx), "n": int(n), "gt0": int(gt0), "gt1": int(gt1),
                     "c": [int(v) for v in c.split(",")], "end": int(end)})
    if not recs:
        return {"records": 0}
    # cycles per ns from the records long enough for %globaltimer's granularity
    rates = [r["end"] / (r["gt1"] - r["gt0"]) for r in recs if r["gt1"] - r["gt0"] > 2000]
    ghz = statistics.median(rates) if rates else 1.755
    t0 = min(r["gt0"] for r in recs)
    out = {"records": len(recs), "clock_GHz": ghz, "span_ns": max(r["gt1"] for r in recs) - t0,
           "cta_start_ns": {"median": statistics.median(r["gt0"] - t0 for r in recs),
                            "max": max(r["gt0"] - t0 for r in recs)}}
    for role in ROLES:
        rr = [r for r in recs if r["role"] == role]
        if not rr:
            continue
        d = {"count": len(rr), "items_median": statistics.median(r["n"] for r in rr),
             "items_max": max(r["n"] for r in rr)}
        for i in range(8):
            v = [r["c"][i] / ghz for r in rr if r["c"][i] > 0]
            if v:
                d[f"mark{i}_ns"] = (round(statistics.median(v)), round(max(v)))
        ends = [r["end"] / ghz for r in rr]
        d["end_ns"] = (round(statistics.median(ends)), round(max(ends)))
        fin = [r["gt1"] - t0 for r in rr]
        d["exit_after_first_start_ns"] = (round(statistics.median(fin)), round(max(fin)))
        beg = [r["gt0"] - t0 for r in rr]
        d["start_after_first_start_ns"] = (round(min(beg)), round(statistics.median(beg)), round(max(beg)))
        out[role] = d
    return out


def show(a: dict) -> None:
    print(f"  span {a.get('span_ns')} ns, CTA starts {a.get('cta_start_ns')}")
    for role in ROLES:
        if role in a:
            marks = " ".join(f"{k[4]}:{v[0]}/{v[1]}" for k, v in a[role].items() if k.startswith("mark"))
            print(f"    {role:5s} n={a[role]['items_median']} marks(median/max ns) {marks} "
                  f"end {a[role]['end_ns'][0]}/{a[role]['end_ns'][1]}")
            print(f"          entries (min/median/max ns after the first) {a[role]['start_after_first_start_ns']}, "
                  f"exits (median/max) {a[role]['exit_after_first_start_ns']}")


def pick(runs: list) -> dict:
    """The run with the shortest span (the least disturbed)."""
    return min(runs, key=lambda a: a.get("span_ns", 1e18))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--json", default="")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="logits dtype of the K-* top-k shapes")
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = bench.Timer(dev, "read")
    res = {}
    for sid in args.shapes:
        if sid.startswith("KF-"):  # fused decode: metadata, logits and top-k on one timeline
            _, k, fused = bench.fused_decode_case(sid, dev)
            capture(lambda: [fused() for _ in range(3)])
            runs = []
            for _ in range(5):
                timer.flush_l2()
                runs.append(analyse(capture(fused)))
            best = pick(runs)
            res[sid] = {"best": best, "spans_ns": [a.get("span_ns") for a in runs]}
            print(f"== {sid} (k={k}, metadata + logits + top-k): spans {res[sid]['spans_ns']} ns")
            show(best)
            continue
        if sid in bench.TOPK_SHAPES:
            case = bench.topk_case(sid, dev, seed=1)
            case["logits"] = case["logits"].to(getattr(torch, args.dtype))
            run = bench.topk_run(case)
            capture(lambda: [run() for _ in range(3)])
            runs, data_warm, warm = [], [], []
            for _ in range(3):
                timer.flush_l2()
                runs.append(analyse(capture(run)))
                # the logits back in L2 (as after the logits kernel), the kernel's code not
                timer.flush_l2()
                lg = case["logits"]
                torch.sum(lg, dim=1, out=torch.empty(lg.shape[0], dtype=lg.dtype, device=dev))
                data_warm.append(analyse(capture(run)))
                warm.append(analyse(capture(run)))  # code and data in L2 (and in the SMs' caches)
            best = pick(runs)
            res[sid] = {"best": best, "spans_ns": [a.get("span_ns") for a in runs], "data_warm": pick(data_warm),
                        "warm": pick(warm)}
            print(f"== {sid} ({bench.TOPK_SHAPES[sid]}, {args.dtype}): spans {res[sid]['spans_ns']} ns")
            for name, a in (("cold", best), ("data in L2, code cold", res[sid]["data_warm"]), ("warm", res[sid]["warm"])):
                print(f"  {name}:", end="")
                show(a)
            continue
        B, nn, avg, H = bench.decode_shape(sid.removesuffix("-FP4"))
        x, run = bench.decode_case(sid, dev)
        run_meta = lambda: di.get_paged_mqa_logits_metadata(x["context_lens"], 64)
        capture(lambda: [run() for _ in range(3)] + [run_meta() for _ in range(3)])  # compile + warm up
        metas = []
        for _ in range(3):
            timer.flush_l2()
            metas.append(analyse(capture(run_meta)))
        runs = []
        for _ in range(3):
            timer.flush_l2()
            runs.append(analyse(capture(run)))
        saved = os.dup(1)  # event time of the traced build (printf included), its output dropped
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            try:
                us = timer(run, 5)
            finally:
                os.dup2(saved, 1)
                os.close(saved)
        best = pick(runs)
        best["traced_event_us"] = us
        capture(run)
        best["warm"] = analyse(capture(run))  # no flush: everything it reads is in L2
        capture(run_meta)
        meta_warm = analyse(capture(run_meta))
        res[sid] = {"best": best, "spans_ns": [a.get("span_ns") for a in runs], "metadata": metas,
                    "metadata_warm": meta_warm}
        print(f"== {sid} (B={B} next_n={nn} avg={avg}): spans {res[sid]['spans_ns']} ns, "
              f"traced event time {us:.1f} us")
        for name, a in (("cold", best), ("warm", best["warm"]), ("meta cold", metas[0]), ("meta warm", meta_warm)):
            print(f"  {name}:", end="")
            show(a)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
